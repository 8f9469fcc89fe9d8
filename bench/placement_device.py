"""GPU placement on a GPU host: trainer processes launched the way the worker launches them see only
the GPUs their run was given (issue 16, "done when").

On the device machine (no Django or Celery there, so the worker's two Django-free modules are loaded
from their files)::

    python -m bench.placement_device --out bench/results/placement-h200.json

1. The worker's inventory, found as a worker finds it (``nvidia-smi``, no variables set).
2. A placement for a run with a named vLLM server (no vLLM on this machine) and
   ``trainer: {gpus: min(2, GPUs)}``, planned by ``controlplane/runs/placement.py``.
3. The trainer command built by ``worker/launch.py`` (``torch.distributed.run`` when 2 GPUs), and
   the same devices under ``torch.distributed.run --nproc-per-node 1``, each running this module's
   ``--probe``: every rank records ``torch.cuda.device_count()``, the UUID of its ``cuda:LOCAL_RANK``
   and ``trainer.processes.host.rank_layout``; the check is that each rank sees exactly its run's GPUs and that
   its device is the physical GPU ``nvidia-smi`` lists under the assigned index.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _load(relative: str, name: str):
    """Import one file of the repository without its package's ``__init__`` (worker/ imports Celery)."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smi_gpus() -> dict[str, dict[str, str]]:
    """``{index: {"uuid", "name"}}`` from nvidia-smi."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    gpus = {}
    for line in out.splitlines():
        index, uuid, name = (part.strip() for part in line.split(",", 2))
        gpus[index] = {"uuid": uuid.removeprefix("GPU-"), "name": name}
    return gpus


def probe(out_dir: Path) -> None:
    """One rank: what it sees, written to ``<out_dir>/rank-<RANK>.json``."""
    import torch

    from trainer.processes.host import rank_layout

    local = int(os.environ.get("LOCAL_RANK", 0))
    distributed = "RANK" in os.environ
    torch.cuda.set_device(local)
    if distributed:
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local))
    # A collective, so that NCCL really ran on the devices each rank was given.
    x = torch.ones(1, device="cuda")
    if distributed:
        torch.distributed.all_reduce(x)
    layout = rank_layout(torch.device("cuda", local))
    rank = int(os.environ.get("RANK", 0))
    record = {
        "rank": rank,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_count": torch.cuda.device_count(),
        "device_uuid": str(torch.cuda.get_device_properties(local).uuid).removeprefix("GPU-"),
        "all_reduce_sum": float(x.item()),
        "layout": layout,
    }
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(record, indent=1))
    if distributed:
        torch.distributed.destroy_process_group()


def launch_and_check(
    argv: list[str], devices: dict[str, str], assigned: list[str], smi: dict
) -> dict[str, Any]:
    """Run ``argv`` (probes) with ``devices`` set; check every rank against ``assigned``."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(devices)
    with tempfile.TemporaryDirectory() as tmp:
        full = [*argv, str(tmp)]
        proc = subprocess.run(full, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank-*.json"))]
    problems = []
    if proc.returncode != 0:
        problems.append(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    expected_world = len(ranks)
    for record in ranks:
        if record["device_count"] != len(assigned):
            problems.append(f"rank {record['rank']} sees {record['device_count']} GPUs, assigned {assigned}")
        mine = next(r for r in record["layout"] if r["rank"] == record["rank"])
        gpu = assigned[mine["local_rank"]]
        if mine["gpu"] != gpu:
            problems.append(f"rank {record['rank']}: layout says GPU {mine['gpu']}, expected {gpu}")
        if record["device_uuid"] != smi[gpu]["uuid"]:
            problems.append(f"rank {record['rank']}: device UUID {record['device_uuid']} is not GPU {gpu}'s")
        if record["all_reduce_sum"] != expected_world:
            problems.append(f"rank {record['rank']}: all_reduce gave {record['all_reduce_sum']}")
    return {
        "argv": [a if a != sys.executable else "python" for a in argv],
        "devices": devices,
        "assigned": assigned,
        "ranks": ranks,
        "passed": not problems and bool(ranks),
        "problems": problems,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--probe", type=Path, default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.probe is not None or rest:
        probe(Path(args.probe or rest[-1]))
        return 0
    os.environ.pop("GRPO_WORKER_GPUS", None)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    inventory_mod = _load("worker/inventory.py", "grpo_worker_inventory")
    launch = _load("worker/launch.py", "grpo_worker_launch")
    from controlplane.runs.placement import placement_plan
    from trainer.config.resources import parse_resources

    inventory = list(inventory_mod.worker_gpus())
    smi = smi_gpus()
    n = min(2, len(inventory))
    resources = parse_resources({"server": "external", "trainer": {"gpus": n}})
    plan = placement_plan(
        resources=resources, inventory=inventory, busy=set(), host=socket.gethostname(), worker="device"
    )
    trainer = plan["trainer"]
    module = ["-m", "bench.placement_device", "--probe"]
    cases = []
    argv, devices, launcher = launch.trainer_command(trainer, module)
    cases.append(
        {
            "case": f"the worker's command ({launcher})",
            **launch_and_check(argv, devices, trainer["gpus"], smi),
        }
    )
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        *module,
    ]
    one = trainer["gpus"][:1]
    cases.append(
        {
            "case": "torch.distributed.run --nproc-per-node 1 on the run's first GPU",
            **launch_and_check(torchrun, launch.devices_env(one), one, smi),
        }
    )
    report = {
        "inventory": inventory,
        "nvidia_smi": smi,
        "placement": plan,
        "cases": cases,
        "passed": all(c["passed"] for c in cases),
    }
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
