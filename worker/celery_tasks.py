"""Celery tasks: the ping check and run supervision."""

from __future__ import annotations

import os
import socket

from worker.celery import app


@app.task(name="worker.ping")
def ping(payload: str = "ping") -> dict:
    """Round-trip check: returns which worker process answered (used by tests and health checks)."""
    return {"payload": payload, "hostname": socket.gethostname(), "pid": os.getpid()}


@app.task(
    name="worker.run_supervise",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=None,  # a run may wait for GPUs as long as it takes (see PlacementWait below)
    time_limit=None,
    soft_time_limit=None,
)
def run_supervise(self, run_id: int) -> str:
    """Launch and watch one attempt of a run until it ends (routed to ``settings.GRPO_RUNS_QUEUE``).

    Long-running by design: acks late, no time limit; a redelivered copy finds the run no longer
    queued and returns ``skipped``. A run that must wait for GPUs is retried every
    ``GRPO_PLACEMENT_RETRY_S`` (the task is requeued, so other runs and workers are not held up).
    """
    from django.conf import settings

    from controlplane.runs.services import PlacementWait
    from worker.supervisor import supervise_run

    try:
        return supervise_run(run_id=run_id, task_id=self.request.id, worker_name=self.request.hostname or "")
    except PlacementWait as wait:
        # Its GPUs (or named server) are busy: the run stays queued, and this task comes back later,
        # to this worker or another of the pool.
        raise self.retry(countdown=settings.GRPO_PLACEMENT_RETRY_S, exc=wait) from None


@app.task(
    name="worker.run_node",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=False,  # a lost host's part is not run again: the attempt fails, naming it
    time_limit=None,
    soft_time_limit=None,
)
def run_node(self, run_id: int, attempt: int, index: int) -> str:
    """A further host's part of a trainer across hosts, until the attempt ends (sent by the run's first
    host to this worker's own queue: :mod:`controlplane.runs.services.nodes`)."""
    from worker.nodes import supervise_node

    return supervise_node(
        run_id=run_id, attempt=attempt, index=index, worker_name=self.request.hostname or ""
    )


@app.task(name="worker.runs_check_stale")
def runs_check_stale() -> list[int]:
    """Fail live runs whose supervisor stopped sending heartbeats (Celery beat, every minute)."""
    from controlplane.runs.services import runs_fail_stale

    return runs_fail_stale()
