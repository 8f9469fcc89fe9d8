"""How the worker launches a placed run's processes: command lines and device variables.

Kept free of Django so that the same functions build the commands on a GPU host without the control
plane installed (``bench/placement_device.py`` checks them on the device machine).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["Rendezvous", "devices_env", "trainer_command", "vllm_placement_flags"]


@dataclass(frozen=True)
class Rendezvous:
    """A trainer across hosts: ``nodes`` hosts meet at ``endpoint`` (``HOST:PORT`` of the first
    host, which ``hosts_store``) under ``run_id`` (one per run attempt)."""

    nodes: int
    endpoint: str
    run_id: str
    hosts_store: bool


def devices_env(gpus: list[str] | None) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a process group placed on ``gpus`` (nothing on a CPU worker)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}


def vllm_placement_flags(place: dict, *, default: list[str]) -> list[str]:
    """``trainer serve`` flags for the placement's vLLM block: parallel sizes, memory share and
    context length (``default``: the registered model's own flags, e.g. the tiny model's context)."""
    flags: list[str] = []
    if place.get("max_model_len"):
        flags += ["--max-model-len", str(place["max_model_len"])]
    else:
        flags += default
    if (place.get("tensor_parallel_size") or 1) > 1:
        flags += ["--tensor-parallel-size", str(place["tensor_parallel_size"])]
    if (place.get("data_parallel_size") or 1) > 1:
        flags += ["--data-parallel-size", str(place["data_parallel_size"])]
    if place.get("gpu_memory_utilization") is not None:
        flags += ["--gpu-memory-utilization", str(place["gpu_memory_utilization"])]
    return flags


def trainer_command(
    place: dict,
    module_argv: list[str],
    *,
    python: str = sys.executable,
    rendezvous: Rendezvous | None = None,
) -> tuple[list[str], dict[str, str], str]:
    """``(argv, device variables, launcher)`` for the trainer's part of a placement.

    ``module_argv`` is what follows the interpreter (``["-m", "trainer", "train", ...]``). More than
    one process: ``torch.distributed.run --standalone --nproc-per-node N`` (a free rendezvous port,
    so runs side by side never clash); each rank takes ``cuda:LOCAL_RANK`` among the GPUs in
    ``CUDA_VISIBLE_DEVICES``, and only rank 0 reports, talks to vLLM and sends weights. A trainer
    across hosts (``rendezvous``): every host runs ``torch.distributed.run --nnodes N --nproc-per-node
    P --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID``, the first host hosting the store.
    """
    processes = int(place.get("processes") or 1)
    if rendezvous is not None:
        flags = [
            "--nnodes",
            str(rendezvous.nodes),
            "--nproc-per-node",
            str(processes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rendezvous.endpoint,
            "--rdzv-id",
            rendezvous.run_id,
            # explicit: two hosts that resolve alike (or two workers of one machine) never both host it
            "--rdzv-conf",
            f"is_host={1 if rendezvous.hosts_store else 0}",
        ]
        launcher = "torch.distributed.run " + " ".join(flags)
        argv = [python, "-m", "torch.distributed.run", *flags, *module_argv]
    elif processes > 1:
        launcher = f"torch.distributed.run --standalone --nproc-per-node {processes}"
        argv = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
        argv += module_argv
    else:
        launcher = "python " + " ".join(module_argv[:3])
        argv = [python, *module_argv]
    return argv, devices_env(place.get("gpus")), launcher
