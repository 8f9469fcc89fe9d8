"""What a worker host offers runs: its GPUs, and its announcement to the control plane.

The GPUs are ``GRPO_WORKER_GPUS`` ("0,1,2,3", or "none"; empty counts as unset), else ``CUDA_VISIBLE_DEVICES``, else every
GPU ``nvidia-smi`` lists, else none (a CPU worker). Ids are kept as ``CUDA_VISIBLE_DEVICES`` names
them (indices or UUIDs), because that is what each run's processes are given.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence

logger = logging.getLogger(__name__)

__all__ = ["parse_gpu_list", "worker_announce", "worker_gpus", "worker_retire"]


def parse_gpu_list(text: str) -> list[str]:
    """``"0,1, 2"`` -> ``["0", "1", "2"]``; ``""``, ``"none"`` and ``"-1"`` -> ``[]`` (no GPU)."""
    text = text.strip()
    if text.lower() in ("", "none", "-1"):
        return []
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU list {text!r} names a GPU twice")
    return ids


def _nvidia_smi_gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


@functools.lru_cache(maxsize=1)
def worker_gpus() -> tuple[str, ...]:
    """This worker's GPUs (see the module docstring); read once per process."""
    declared = os.environ.get("GRPO_WORKER_GPUS", "")
    if declared.strip():  # empty counts as unset (a compose file's "${GRPO_WORKER_GPUS:-}")
        return tuple(parse_gpu_list(declared))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(parse_gpu_list(visible))
    return tuple(_nvidia_smi_gpus())


def worker_announce(*, name: str, queues: Sequence[str]) -> None:
    """Register this worker (its pools, GPUs and CPUs) with the control plane; never raises."""
    from django.conf import settings

    from controlplane.runs.worker_hosts import worker_host_register

    try:
        gpus = worker_gpus()
        worker_host_register(
            name=name, host=settings.GRPO_WORKER_HOST, queues=queues, gpus=gpus, cpus=os.cpu_count() or 1
        )
        logger.info("worker %s: pools %s, GPUs %s", name, ",".join(queues), ",".join(gpus) or "none")
    except Exception:
        logger.exception("worker %s: could not register with the control plane", name)


def worker_retire(*, name: str) -> None:
    """Remove this worker's registration on a clean shutdown; never raises."""
    from controlplane.runs.worker_hosts import worker_host_unregister

    try:
        worker_host_unregister(name=name)
    except Exception:
        logger.warning("worker %s: could not unregister", name, exc_info=True)
