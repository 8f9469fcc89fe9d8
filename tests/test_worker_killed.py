"""The Celery worker killed (``kill -9`` of its whole process tree) while it supervises a run, then a
new worker resumes the run.

A dedicated worker (its own queue) takes the run, on the session's vLLM server (the per-run server's
group going down with its supervisor is tests/faults/test_run_faults.py's); once the run is past its
first checkpoint, every process of the worker gets SIGKILL, as when its machine or container dies. Then:

* the trainer's process group goes down with it (its ``worker.guard`` sees its parent vanish),
  and the run is marked ``failed`` naming the lost worker once its heartbeat is
  ``GRPO_RUN_STALE_AFTER_S`` old, on the next read (the API, the pages, the periodic check);
* resumed by a new worker, what the trainer wrote reaches Postgres once, from the byte offsets the
  killed worker had committed (``worker/tailer.py``): no step lost or doubled;
* the trainer's processes never see the control plane's credentials.
"""

from __future__ import annotations

import json
import os
import signal
import time
from itertools import groupby
from pathlib import Path

import pytest
import yaml
from django.conf import settings
from django.contrib.auth import get_user_model

from controlplane.runs import services
from controlplane.runs.models import Checkpoint, CompletionSample, MetricPoint, Run, RunFileCursor, RunStatus
from tests.conftest import SESSION_SERVERS_ENV, start_celery_worker
from trainer.reporting.sinks import COMPLETIONS_FILE, METRICS_FILE
from worker.processes import descendants, group_members, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # not `faults`: it restarts no shared service

MAX_STEPS = 6
STALE_AFTER_S = 6.0
RUN_DOC = {
    "model": "tiny",
    "train_dataset": "arithmetic-small",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {
        "max_steps": MAX_STEPS,
        "num_generations": 4,
        "max_completion_length": 16,
        "save_steps": 2,
        "log_completions": True,
        "gradient_checkpointing": False,
        "dtype": "float32",
        "disable_tqdm": True,
    },
}


def environment_names(pid: int) -> set[str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return {entry.split(b"=", 1)[0].decode() for entry in fh.read().split(b"\0") if entry}


def jsonl_values(path: Path, name: str) -> dict[int, float]:
    """step -> value of ``name`` as the trainer wrote them to metrics.jsonl (a re-done step's last write wins)."""
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the line the kill cut
        if name in row:
            rows[int(row["step"])] = float(row[name])
    return rows


def completion_rows_expected(path: Path, boundary: int) -> int:
    """Rows the database must hold for the file: per attempt (bytes before/after ``boundary``),
    consecutive lines of a step are one block; a step keeps its longest block (re-done steps
    replace rows from index 0), at most GRPO_COMPLETIONS_PER_STEP."""
    data = path.read_bytes()
    longest: dict[int, int] = {}
    for part in (data[:boundary], data[boundary:]):
        steps = []
        for line in part.splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                continue  # the line the kill cut
        for step, block in groupby(steps):
            longest[step] = max(longest.get(step, 0), len(list(block)))
    return sum(min(n, settings.GRPO_COMPLETIONS_PER_STEP) for n in longest.values())


@pytest.mark.django_db(transaction=True)
def test_killed_worker_takes_the_runs_processes_down_fails_the_run_and_a_resume_loses_no_step(
    django_db_setup, tiny_model_dir, session_server, tmp_path, monkeypatch
):
    queue = f"restart-{os.getpid()}"
    monkeypatch.setattr(settings, "GRPO_RUNS_QUEUE", queue)
    monkeypatch.setattr(settings, "GRPO_RUN_STALE_AFTER_S", STALE_AFTER_S)
    owner = get_user_model().objects.create_user(username="worker-restart")
    worker = start_celery_worker(queue, tmp_path / "worker-1.log", concurrency=1, env=SESSION_SERVERS_ENV)
    try:
        config = {**RUN_DOC, "resources": {"server": session_server}}
        run, _ = services.run_create(owner=owner, name="worker restarted", config=config)
        # Mid-run: its first checkpoint recorded and a step past it stored.
        wait_for(
            lambda: (
                (
                    Checkpoint.objects.filter(run_id=run.pk).exists()
                    and MetricPoint.objects.filter(run_id=run.pk, name="loss", step__gte=3).exists()
                )
                or Run.objects.get(pk=run.pk).is_terminal
            ),
            timeout_s=480,
            what="the run to pass its first checkpoint",
        )
        run = Run.objects.get(pk=run.pk)
        assert run.status == RunStatus.RUNNING, (run.status, run.failure_reason)
        # The trainer's processes (guard, trainer, rollout process) have no database or Redis.
        members = group_members(run.trainer_pid)
        assert len(members) >= 2
        for pid in members:
            leaked = environment_names(pid) & {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}
            assert not leaked, (pid, leaked, Path(f"/proc/{pid}/cmdline").read_bytes()[:300])
        assert run.vllm_pid is None  # the named server is not the run's
        groups = [run.trainer_pid]
        own = [pid for pid in [worker.pid, *descendants(worker.pid)] if os.getpgid(pid) not in groups]
        assert len(own) >= 2  # the worker's main process and the pool child running the supervisor
        for pid in own:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not any(group_members(g) for g in groups), timeout_s=30, what="the run's processes")
        orphans_gone_s = time.monotonic() - killed
        # The next read after the heartbeat is STALE_AFTER_S old marks the run failed.
        wait_for(
            lambda: services.runs_fail_stale() or Run.objects.get(pk=run.pk).is_terminal,
            timeout_s=STALE_AFTER_S + 30,
            what="the stale check",
            interval_s=0.5,
        )
        detected_s = time.monotonic() - killed
        failed = Run.objects.get(pk=run.pk)
        assert failed.status == RunStatus.FAILED
        assert "worker lost" in failed.failure_reason and "no heartbeat" in failed.failure_reason
        assert detected_s < STALE_AFTER_S + settings.GRPO_RUN_HEARTBEAT_S + 5
        print(
            "worker kill:",
            json.dumps({"orphans_gone_s": round(orphans_gone_s, 2), "failed_s": round(detected_s, 2)}),
        )
    finally:
        worker.stop(grace_s=5)
    out = Path(run.output_dir)
    boundary = (out / COMPLETIONS_FILE).stat().st_size  # attempt 1's lines end here

    worker = start_celery_worker(queue, tmp_path / "worker-2.log", concurrency=1, env=SESSION_SERVERS_ENV)
    try:
        services.run_resume(run=Run.objects.get(pk=run.pk))
        wait_for(lambda: Run.objects.get(pk=run.pk).is_terminal, timeout_s=480, what="the resumed run")
    finally:
        worker.stop(grace_s=15)
    run = Run.objects.get(pk=run.pk)
    assert run.status == RunStatus.COMPLETED and run.attempt == 2, (run.status, run.failure_reason)
    # Each step once: the trainer logs loss at every step. Rollout-side metrics (reward) are logged in
    # a window only if a group finished scoring in it (the spec's rule), so a step may lack reward in
    # the file too: the database holds exactly the file's (last attempt's) reward steps and values.
    steps = list(MetricPoint.objects.filter(run_id=run.pk, name="loss").values_list("step", flat=True))
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    # Issue 35 item 6: a worker-launched run ends if its groups stop varying (the run's stored
    # document is the user's; the launched one gets the worker's bound).
    launched = yaml.safe_load((out / "RUN.yaml").read_text())
    assert launched["args"]["max_dropped_groups"] == settings.GRPO_MAX_DROPPED_GROUPS == 1000
    assert "max_dropped_groups" not in run.config["args"]
    stored = MetricPoint.objects.filter(run_id=run.pk, name="reward").values_list("step", "value")
    assert len(stored) == len(dict(stored))
    assert dict(stored) == pytest.approx(jsonl_values(out / METRICS_FILE, "reward"))
    assert CompletionSample.objects.filter(run_id=run.pk).count() == completion_rows_expected(
        out / COMPLETIONS_FILE, boundary
    )
    cursors = dict(RunFileCursor.objects.filter(run_id=run.pk).values_list("name", "offset"))
    assert cursors == {
        METRICS_FILE: (out / METRICS_FILE).stat().st_size,
        COMPLETIONS_FILE: (out / COMPLETIONS_FILE).stat().st_size,
    }
