"""The workers that supervise runs: registered by the worker on start, removed on shutdown.

Services (``worker_host_register``, ``worker_host_unregister``) and the one read the API needs
(``pool_max_gpus``, ``pool_max_cpus``). The worker side that calls them is :mod:`worker.inventory`.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.utils import timezone

from controlplane.runs.models import WorkerHost


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
