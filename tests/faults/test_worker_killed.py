"""The Celery worker killed (``kill -9`` of its whole process tree) while it supervises a run.

A dedicated worker (its own queue) takes the run; once the run is live and its vLLM server process
group exists, every process of the worker gets SIGKILL, as when its machine or container dies. Then:
the run's process groups go down with it (each child's ``worker.guard`` sees its parent vanish), and
the run is marked ``failed`` naming the lost worker once its heartbeat is ``GRPO_RUN_STALE_AFTER_S``
old, on the next read (the API, the pages, the periodic check).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model

from controlplane.runs import services
from controlplane.runs.models import Run, RunStatus
from tests.conftest import start_celery_worker
from tests.test_runs_guard import group_members
from worker.processes import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.faults]

STALE_AFTER_S = 6.0
RUN_DOC = {
    "model": "tiny",
    "train_dataset": "arithmetic-small",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {"max_steps": 50, "num_generations": 4, "max_completion_length": 16, "dtype": "float32"},
}


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.django_db(transaction=True)
def test_killed_worker_takes_the_runs_processes_down_and_the_run_is_failed(
    django_db_setup, tiny_model_dir, tmp_path, monkeypatch
):
    queue = f"faults-{os.getpid()}"
    worker = start_celery_worker(queue, tmp_path / "worker.log", concurrency=1)
    try:
        monkeypatch.setattr(settings, "GRPO_RUNS_QUEUE", queue)
        monkeypatch.setattr(settings, "GRPO_RUN_STALE_AFTER_S", STALE_AFTER_S)
        owner = get_user_model().objects.create_user(username="worker-faults")
        run, _ = services.run_create(owner=owner, name="worker killed", config=RUN_DOC)
        run = wait_for(
            lambda: (r := Run.objects.get(pk=run.pk)).vllm_pid and group_members(r.vllm_pid) and r,
            timeout_s=120,
            what="the run's vLLM server to start",
        )
        groups = [g for g in (run.vllm_pid, run.trainer_pid) if g]
        # The worker's own processes (main + pool child running the supervisor), not the run's groups:
        # those must be taken down by their guards.
        own = [pid for pid in [worker.pid, *descendants(worker.pid)] if os.getpgid(pid) not in groups]
        assert len(own) >= 2
        for pid in own:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(
            lambda: not any(group_members(g) for g in groups),
            timeout_s=30,
            what="the run's processes to go down",
        )
        orphans_gone_s = time.monotonic() - killed
        # The next read after the heartbeat is STALE_AFTER_S old marks the run failed.
        wait_for(
            lambda: services.runs_fail_stale() or Run.objects.get(pk=run.pk).is_terminal,
            timeout_s=STALE_AFTER_S + 30,
            what="the stale check",
            interval_s=0.5,
        )
        detected_s = time.monotonic() - killed
        run = Run.objects.get(pk=run.pk)
        assert run.status == RunStatus.FAILED
        assert "worker lost" in run.failure_reason and "no heartbeat" in run.failure_reason
        assert detected_s < STALE_AFTER_S + settings.GRPO_RUN_HEARTBEAT_S + 5
        print(
            "worker kill:",
            json.dumps({"orphans_gone_s": round(orphans_gone_s, 2), "failed_s": round(detected_s, 2)}),
        )
    finally:
        worker.stop(grace_s=5)
