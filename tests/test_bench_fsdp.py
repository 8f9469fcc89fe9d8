"""``bench/fsdp.py`` on CPU: two gloo processes, FSDP2 through accelerate, the tiny Qwen3 shape.

The gradients of the trainer's step sharded over two processes must equal the single-device
gradients (fp32, same weights, same rows), also when one process's row is empty, and the JSON must
carry the correctness, ``batch/row_imbalance`` and throughput records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """Run the CPU smoke mode once (two processes) and return its JSON."""
    out = tmp_path_factory.mktemp("fsdp") / "fsdp-tiny.json"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free rendezvous port: no clash with concurrent runs
        "--nproc_per_node",
        "2",
        "-m",
        "bench.fsdp",
        "--device",
        "cpu",
        "--tiny",
        "--steps",
        "1",
        "--pg-timeout",
        "60",
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_gradients_match_single_device(report):
    cases = {c["case"]: c for c in report["correctness"]}
    assert set(cases) == {"full", "empty_row"}
    for case in cases.values():
        assert case["passed"], {k: v for k, v in case.items() if k != "params"}
        assert case["grad_max_rel_norm_diff"] <= 1e-4
        assert case["loss_rel_diff"] <= 1e-5
        assert case["params"], "no parameter compared"
        assert all(p["ref_norm"] > 0 for p in case["params"]), "a parameter got no gradient"
    full = cases["full"]
    assert all(row is not None for row in full["rows"]) and len(full["rows"]) == 2
    assert cases["empty_row"]["rows"][1] is None  # the rank that only runs the dummy forward


def test_report_fields(report):
    meta = report["meta"]
    assert meta["world_size"] == 2 and meta["process_group_backend"] == "gloo"
    for key in ("command", "torch", "transformers", "accelerate", "device", "args", "elapsed_s"):
        assert key in meta
    assert report["errors"] == [] and report["skipped"] == []

    assert report["steps"], "no step logged"
    for step in report["steps"]:
        assert step["batch/row_imbalance"] >= 1.0
        assert len(step["rows"]) == 2

    modes = {(r["mode"], r["gpus"]) for r in report["throughput"]}
    assert {("single_device", 1), ("fsdp2", 2)} <= modes
    for record in report["throughput"]:
        assert record["trained_tokens_per_s"] > 0
        assert len(record["fwd_bwd_s"]) == len(report["steps"])
    fsdp = next(r for r in report["throughput"] if r["mode"] == "fsdp2")
    assert fsdp["lm_head"] == "model"  # the fused head refuses FSDP2's sharded weight

    (scaling,) = report["scaling"]
    assert scaling["gpus"] == 2 and scaling["scaling"] > 0
    assert scaling["first_step_loss_rel_diff"] < 1e-3  # fp32 on CPU, fused vs unfused head
