"""Placing a run on a worker host: which of the host's GPUs its vLLM server and trainer get.

Pure functions (no database): :func:`controlplane.runs.services.run_claim` calls
:func:`placement_plan` under a per-host lock with the GPUs the host's live runs already hold, and
stores the returned document as ``Run.placement``, which is also the lease (a run holds its GPUs
while it is live). No scheduler beyond that: Celery queues carry runs to hosts, and a run that does
not fit stays queued and its task retries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config.resources import Resources

__all__ = ["Unplaceable", "Waiting", "node_plan", "placement_plan", "waiting_reason_for"]


class Unplaceable(Exception):
    """This worker can never meet the request (too few GPUs in all, or GPUs asked of a CPU worker)."""


@dataclass(frozen=True)
class Waiting:
    """The request fits this worker but not now: ``reason`` is shown on the run page."""

    reason: str


def waiting_reason_for(*, needed: int, free: int, total: int, host: str) -> str:
    return f"waiting for {needed} GPU{'s' if needed != 1 else ''}: {free} of {total} free on {host}"


def placement_plan(
    *,
    resources: Resources,
    inventory: list[str],
    busy: set[str],
    host: str,
    worker: str,
) -> dict[str, Any] | Waiting:
    """The placement document for ``resources`` on a worker whose GPUs are ``inventory`` (ids as
    ``CUDA_VISIBLE_DEVICES`` names them; empty on a CPU worker), of which ``busy`` are held by
    live runs. vLLM takes the lowest free ids, the trainer the next ones, so each process group
    gets a disjoint ``CUDA_VISIBLE_DEVICES``.

    Returns a :class:`Waiting` when too few are free now; raises :class:`Unplaceable` when the
    worker could never meet the request.
    """
    gpu_host = bool(inventory)
    if not gpu_host and resources.explicit_gpus():
        raise Unplaceable(
            f"the run asks for {resources.explicit_gpus()} GPUs and worker {worker} has none "
            "(a CPU worker): route it to a GPU pool with resources.pool, or drop the GPU counts"
        )
    vllm_n = resources.vllm_gpus_on(gpu_host=gpu_host)
    trainer_n = resources.trainer_gpus_on(gpu_host=gpu_host)
    needed = vllm_n + trainer_n
    if needed > len(inventory) and gpu_host:
        raise Unplaceable(
            f"the run needs {needed} GPUs (vLLM {vllm_n} + trainer {trainer_n}) and worker {worker} "
            f"has {len(inventory)}: lower resources.vllm.gpus / resources.trainer.gpus, or use a "
            "pool with larger hosts"
        )
    free = [gpu for gpu in inventory if gpu not in busy]
    if needed > len(free):
        return Waiting(waiting_reason_for(needed=needed, free=len(free), total=len(inventory), host=host))
    vllm_gpus, trainer_gpus = free[:vllm_n], free[vllm_n:needed]
    processes = resources.trainer_processes_on(gpu_host=gpu_host)
    nodes = {"nodes": resources.trainer_nodes} if resources.trainer_nodes > 1 else {}
    return {
        "host": host,
        "worker": worker,
        "gpus": vllm_gpus + trainer_gpus,
        "server": resources.server,
        "servers": list(resources.servers),
        "vllm": None
        if resources.server is not None
        else {
            "gpus": vllm_gpus,
            "tensor_parallel_size": resources.tensor_parallel_size,
            "data_parallel_size": resources.data_parallel_size,
            "gpu_memory_utilization": resources.gpu_memory_utilization,
            "max_model_len": resources.max_model_len,
        },
        "trainer": {"gpus": trainer_gpus, "processes": processes, "ranks": [], **nodes},
    }


def node_plan(
    *, resources: Resources, inventory: list[str], busy: set[str], host: str, worker: str
) -> dict[str, Any] | Waiting:
    """A further host's share of a trainer across hosts: its trainer GPUs (``gpus_per_node`` of the
    free ones; none on a CPU worker) and processes. Raises :class:`Unplaceable` when this host could
    never hold it; a :class:`Waiting` when not now."""
    gpu_host = bool(inventory)
    if not gpu_host and resources.trainer_gpus:
        raise Unplaceable(f"host {host} has no GPUs for resources.trainer.gpus_per_node")
    needed = resources.trainer_gpus_on(gpu_host=gpu_host)
    if needed > len(inventory) and gpu_host:
        raise Unplaceable(f"host {host} has {len(inventory)} GPUs, fewer than gpus_per_node {needed}")
    free = [gpu for gpu in inventory if gpu not in busy]
    if needed > len(free):
        return Waiting(waiting_reason_for(needed=needed, free=len(free), total=len(inventory), host=host))
    return {
        "host": host,
        "worker": worker,
        "gpus": free[:needed],
        "processes": resources.trainer_processes_on(gpu_host=gpu_host),
    }
