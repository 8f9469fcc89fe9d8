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
    time_limit=None,
    soft_time_limit=None,
)
def run_supervise(self, run_id: int) -> str:
    """Launch and watch one attempt of a run until it ends (routed to ``settings.GRPO_RUNS_QUEUE``).

    Long-running by design: acks late, no time limit; a redelivered copy finds the run no longer
    queued and returns ``skipped``.
    """
    from worker.supervisor import supervise_run

    return supervise_run(run_id=run_id, task_id=self.request.id)


@app.task(name="worker.runs_check_stale")
def runs_check_stale() -> list[int]:
    """Fail live runs whose supervisor stopped sending heartbeats (Celery beat, every minute)."""
    from controlplane.runs.services import runs_fail_stale

    return runs_fail_stale()
