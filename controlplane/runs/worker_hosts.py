"""The workers that supervise runs: registered by the worker on start, removed on shutdown.

Services (``worker_host_register``, ``worker_host_unregister``) and the reads the API and the claim
need (``pool_max_gpus``, ``pool_max_cpus``, ``pool_live_workers``). The worker side that calls them is :mod:`worker.inventory`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from django.utils import timezone

from controlplane.runs.models import WorkerHost

logger = logging.getLogger(__name__)
# Seconds the pool's workers have to answer a ping (a trainer across hosts counts the live ones).
PING_TIMEOUT_S = 1.0


def worker_host_register(
    *, name: str, host: str, queues: Sequence[str], gpus: Sequence[str], cpus: int
) -> WorkerHost:
    """Announce (or re-announce) a worker: its pools and the GPUs it places runs on."""
    worker, _ = WorkerHost.objects.update_or_create(
        name=name,
        defaults={
            "host": host,
            "queues": list(queues),
            "gpus": [str(g) for g in gpus],
            "cpus": max(1, int(cpus)),
            "started_at": timezone.now(),
        },
    )
    return worker


def worker_host_unregister(*, name: str) -> None:
    WorkerHost.objects.filter(name=name).delete()


def _pool_workers(pool: str) -> list[WorkerHost]:
    return list(WorkerHost.objects.filter(queues__contains=[pool]))


def pool_max_gpus(*, pool: str) -> int | None:
    """The most GPUs one registered worker of ``pool`` has; None when no worker of it is registered."""
    workers = _pool_workers(pool)
    return max(len(w.gpus or []) for w in workers) if workers else None


def pool_max_cpus(*, pool: str) -> int | None:
    """The most CPUs one registered worker of ``pool`` has; None when no worker of it is registered."""
    workers = _pool_workers(pool)
    return max(w.cpus for w in workers) if workers else None


def pool_live_workers(*, pool: str, exclude_host: str | None = None) -> list[WorkerHost]:
    """One worker per host of ``pool`` (other than ``exclude_host``) that answers a Celery ping now,
    in host order. A killed worker stays registered, so the registry alone is not enough; the broker
    down: none is known to be live."""
    from controlplane.celery import app

    registered = list(WorkerHost.objects.filter(queues__contains=[pool]).order_by("host", "name"))
    registered = [w for w in registered if w.host != exclude_host]
    if not registered:
        return []
    try:
        replies = app.control.ping(destination=[w.name for w in registered], timeout=PING_TIMEOUT_S)
    except Exception:
        logger.warning("could not ping the workers of pool %s", pool, exc_info=True)
        return []
    live = {name for reply in replies for name in reply}
    chosen: dict[str, WorkerHost] = {}
    for worker in registered:
        if worker.name in live:
            chosen.setdefault(worker.host, worker)
    return list(chosen.values())
