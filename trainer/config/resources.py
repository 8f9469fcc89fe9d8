"""The run document's ``resources`` block: what a run asks of the machine it is placed on.

::

    resources:
      vllm:                         # the run's own vLLM server (omit with `server:`)
        gpus: 2                     # default: tensor_parallel_size × data_parallel_size on a GPU
                                    # worker (1), none on a CPU worker
        tensor_parallel_size: 2     # default 1 (vLLM's --tensor-parallel-size)
        data_parallel_size: 1       # default 1 (vLLM's --data-parallel-size)
        gpu_memory_utilization: 0.9 # default: vLLM's own (0.9 on GPUs; 0.3 of host memory on CPU)
        max_model_len: 8192         # default: the run's lengths rounded up, within the model's limit
                                    # (1024 for the embedded tiny model): trainer/config/run_lengths.py
      trainer:
        gpus: 4                     # GPU worker: one process per GPU (default 1)
        processes: 2                # CPU worker: this many processes (default 1)
        # or across hosts: nodes: 2 with gpus_per_node: 8 (or processes_per_node: 2 on CPU workers)
      server: NAME                  # instead of `vllm`: an operator-registered external server
      # or, for rollouts spread over several registered servers (weights synced to each):
      # vllm: {servers: [NAME, NAME, ...]}
      pool: NAME                    # the Celery queue of the worker pool to run on

A trainer with more than one process runs under ``torch.distributed.run`` (FSDP2/DDP on GPUs,
DDP over gloo on CPU); with ``nodes: N`` it spans N worker hosts of its pool, each running its share
(``gpus_per_node`` / ``processes_per_node``) under one c10d rendezvous on the first. This module checks the block's shape and turns it into a
:class:`Resources`; it knows nothing of workers (the control plane checks names and capacity, the
worker assigns devices: :mod:`controlplane.runs.placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Resources", "parse_resources", "resources_errors"]

RESOURCE_KEYS = ("vllm", "trainer", "server", "pool")
VLLM_KEYS = (
    "gpus",
    "tensor_parallel_size",
    "data_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "servers",
)
TRAINER_KEYS = ("gpus", "processes", "nodes", "gpus_per_node", "processes_per_node")


@dataclass(frozen=True)
class Resources:
    """A validated ``resources`` block; ``None`` counts mean "the worker's default" (see module doc)."""

    vllm_gpus: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    trainer_gpus: int | None = None  # per node
    trainer_processes: int | None = None  # per node
    trainer_nodes: int = 1  # hosts the trainer spans (torch.distributed.run's c10d rendezvous)
    server: str | None = None  # the first (or only) named server
    pool: str | None = None
    servers: tuple[str, ...] = ()  # every named server, in the document's order (``server`` first)
    servers_field: str = "resources.server"  # where the document names them (for error messages)

    def vllm_gpus_on(self, *, gpu_host: bool) -> int:
        """GPUs the run's own vLLM server takes on a GPU / CPU worker (0 with an external server)."""
        if self.server is not None or not gpu_host:
            return 0
        return (
            self.vllm_gpus
            if self.vllm_gpus is not None
            else self.tensor_parallel_size * self.data_parallel_size
        )

    def trainer_gpus_on(self, *, gpu_host: bool) -> int:
        """GPUs the trainer takes on a GPU / CPU worker (one process per GPU)."""
        if not gpu_host:
            return 0
        # `processes` on a GPU worker: one GPU each (a document written for either kind of host).
        return self.trainer_gpus or self.trainer_processes or 1

    def gpus_on(self, *, gpu_host: bool) -> int:
        return self.vllm_gpus_on(gpu_host=gpu_host) + self.trainer_gpus_on(gpu_host=gpu_host)

    def explicit_gpus(self) -> int:
        """GPUs the document asks for by number (defaults excluded): what no worker may lack."""
        asked_vllm = self.vllm_gpus is not None or self.tensor_parallel_size * self.data_parallel_size > 1
        vllm = self.vllm_gpus_on(gpu_host=True) if asked_vllm else 0
        return vllm + (self.trainer_gpus or 0)

    def trainer_processes_on(self, *, gpu_host: bool) -> int:
        """Trainer processes (``torch.distributed.run --nproc-per-node``) on a GPU / CPU worker."""
        if gpu_host:
            return max(1, self.trainer_gpus_on(gpu_host=True))
        return self.trainer_processes or 1


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _name_ok(value: Any) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= 100
        and value.replace("-", "").replace("_", "").replace(".", "").isalnum()
    )


def resources_errors(block: Any) -> dict[str, str]:
    """Problems with a ``resources`` block, by field path (``resources.vllm.gpus``); empty when valid."""
    if block is None:
        return {}
    if not isinstance(block, dict):
        return {"resources": "must be a mapping with keys " + ", ".join(RESOURCE_KEYS)}
    errors: dict[str, str] = {}
    for key in block:
        if key not in RESOURCE_KEYS:
            errors[f"resources.{key}"] = f"unknown key; allowed: {', '.join(RESOURCE_KEYS)}"
    for key in ("server", "pool"):
        if key in block and not _name_ok(block[key]):
            errors[f"resources.{key}"] = "must be a name (letters, digits, '-', '_', '.')"
    vllm = block.get("vllm")
    if vllm is not None:
        if "server" in block:
            errors["resources.vllm"] = (
                "not used with resources.server (the named server is already running): remove one of them"
            )
        elif not isinstance(vllm, dict):
            errors["resources.vllm"] = "must be a mapping with keys " + ", ".join(VLLM_KEYS)
        else:
            errors.update(_vllm_errors(vllm))
    trainer = block.get("trainer")
    if trainer is not None:
        if not isinstance(trainer, dict):
            errors["resources.trainer"] = "must be a mapping with keys " + ", ".join(TRAINER_KEYS)
        else:
            errors.update(_trainer_errors(trainer))
    return errors


def _key_and_count_errors(
    part: dict, name: str, allowed: tuple[str, ...], counts: tuple[str, ...]
) -> dict[str, str]:
    """Unknown keys of ``resources.<name>`` and its ``counts`` that are not integers >= 1."""
    errors = {
        f"resources.{name}.{key}": f"unknown key; allowed: {', '.join(allowed)}"
        for key in part
        if key not in allowed
    }
    for key in counts:
        if key in part and not _positive_int(part[key]):
            errors[f"resources.{name}.{key}"] = f"must be an integer >= 1, got {part[key]!r:.40}"
    return errors


def _servers_errors(vllm: dict) -> dict[str, str]:
    """``resources.vllm.servers``: registered names, each once, and nothing else in ``vllm``."""
    servers = vllm["servers"]
    if not isinstance(servers, list) or not servers or not all(_name_ok(name) for name in servers):
        return {"resources.vllm.servers": "must be a list of registered server names, e.g. [vllm-a, vllm-b]"}
    if len(set(servers)) < len(servers):
        return {"resources.vllm.servers": f"names a server twice ({servers!r:.80}): give each once"}
    others = [key for key in vllm if key != "servers"]
    if others:
        return {
            "resources.vllm": f"servers names running servers: {', '.join(others)} would configure one this run "
            "starts; remove them"
        }
    return {}


def _vllm_errors(vllm: dict) -> dict[str, str]:
    if "servers" in vllm:
        return _servers_errors(vllm)
    errors = _key_and_count_errors(
        vllm, "vllm", VLLM_KEYS, ("gpus", "tensor_parallel_size", "data_parallel_size")
    )
    if not errors and "gpus" in vllm:
        tp, dp = vllm.get("tensor_parallel_size", 1), vllm.get("data_parallel_size", 1)
        if tp * dp != vllm["gpus"]:
            errors["resources.vllm.gpus"] = (
                f"must equal tensor_parallel_size × data_parallel_size = {tp} × {dp} = {tp * dp}, got "
                f"{vllm['gpus']}: set gpus to {tp * dp} or change the parallel sizes"
            )
    util = vllm.get("gpu_memory_utilization")
    if "gpu_memory_utilization" in vllm and not (
        isinstance(util, int | float) and not isinstance(util, bool) and 0 < util <= 1
    ):
        errors["resources.vllm.gpu_memory_utilization"] = f"must be a number in (0, 1], got {util!r:.40}"
    length = vllm.get("max_model_len")
    if "max_model_len" in vllm and not (_positive_int(length) and length >= 16):
        errors["resources.vllm.max_model_len"] = f"must be an integer >= 16, got {length!r:.40}"
    return errors


def _trainer_errors(trainer: dict) -> dict[str, str]:
    errors = _key_and_count_errors(trainer, "trainer", TRAINER_KEYS, TRAINER_KEYS)
    counts = [key for key in ("gpus", "processes", "gpus_per_node", "processes_per_node") if key in trainer]
    if len(counts) > 1:
        errors["resources.trainer"] = (
            f"give one of gpus / gpus_per_node (GPU workers: one process per GPU) or processes / "
            f"processes_per_node (CPU workers), not both ({' and '.join(counts)})"
        )
    elif trainer.get("nodes", 1) != 1 and counts and not counts[0].endswith("_per_node"):
        errors[f"resources.trainer.{counts[0]}"] = (
            f"with nodes, say what each node runs: {counts[0]}_per_node instead of {counts[0]}"
        )
    return errors


def parse_resources(block: Any) -> Resources:
    """A :class:`Resources` from a block :func:`resources_errors` accepted (``None``: all defaults)."""
    block = block or {}
    vllm = block.get("vllm") or {}
    trainer = block.get("trainer") or {}
    servers = tuple(vllm.get("servers") or ([block["server"]] if block.get("server") else []))
    return Resources(
        vllm_gpus=vllm.get("gpus"),
        tensor_parallel_size=vllm.get("tensor_parallel_size", 1),
        data_parallel_size=vllm.get("data_parallel_size", 1),
        gpu_memory_utilization=vllm.get("gpu_memory_utilization"),
        max_model_len=vllm.get("max_model_len"),
        trainer_gpus=trainer.get("gpus", trainer.get("gpus_per_node")),
        trainer_processes=trainer.get("processes", trainer.get("processes_per_node")),
        trainer_nodes=trainer.get("nodes", 1),
        server=servers[0] if servers else None,
        pool=block.get("pool"),
        servers=servers,
        servers_field="resources.vllm.servers" if vllm.get("servers") else "resources.server",
    )
