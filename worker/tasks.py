"""Celery tasks. Run supervision tasks are added with the runs app."""

from __future__ import annotations

import os
import socket

from worker.celery import app


@app.task(name="worker.ping")
def ping(payload: str = "ping") -> dict:
    """Round-trip check: returns which worker process answered (used by tests and health checks)."""
    return {"payload": payload, "hostname": socket.gethostname(), "pid": os.getpid()}
