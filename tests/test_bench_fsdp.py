"""``bench/fsdp.py`` on CPU: two gloo processes, FSDP2 through accelerate, the tiny Qwen3 shape.

The gradients of the trainer's step sharded over two processes, with the LM head fused with the
loss, must equal the single-device gradients of the model's own head (fp32, same weights, same
rows), also when one process's row is empty, and the JSON must carry the correctness,
``batch/row_imbalance`` and throughput records. On one process, ``--check-fused-head``: the FSDP2
step with the fused head against the unwrapped model, fused and unfused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _launch(out: Path, nproc: int, *extra: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free rendezvous port: no clash with concurrent runs
        "--nproc_per_node",
        str(nproc),
        "-m",
        "bench.fsdp",
        "--device",
        "cpu",
        "--tiny",
        "--pg-timeout",
        "60",
        "--out",
        str(out),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# Three torch.distributed processes start here (~30 s): the slow layer, not make test-fast.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """The CPU smoke mode (two processes) and the fused-head check (one process), launched together
    (start-up is most of their time); their JSONs by name."""
    tmp = tmp_path_factory.mktemp("fsdp")
    outs = {"smoke": tmp / "fsdp-tiny.json", "fused_head": tmp / "fused-head.json"}
    procs = {
        "smoke": _launch(outs["smoke"], 2, "--steps", "1"),
        "fused_head": _launch(outs["fused_head"], 1, "--check-fused-head"),
    }
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{stdout[-4000:]}\n{stderr[-6000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return {name: json.loads(out.read_text()) for name, out in outs.items()}


@pytest.fixture(scope="module")
def report(runs) -> dict:
    return runs["smoke"]


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
    # FSDP2 ran the fused head on its gathered weight; the reference the model's own head
    assert full["lm_head"] == {"single_device": "model", "fsdp2": ["fused", "fused"]}
    assert cases["empty_row"]["lm_head"] == {"single_device": "model", "fsdp2": ["fused", None]}


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
    heads = {(r["mode"], r["lm_head"]) for r in report["throughput"]}
    assert heads == {("single_device", "fused"), ("fsdp2", "fused")}  # the same work on both sides

    (scaling,) = report["scaling"]
    assert scaling["gpus"] == 2 and scaling["scaling"] > 0
    assert scaling["scaling_same_head"] == scaling["scaling"]
    assert scaling["first_step_loss_rel_diff"] < 1e-3  # fp32 on CPU, fused vs unfused head


def test_fused_head_under_fsdp2_on_one_process(runs):
    check = runs["fused_head"]["fused_head_check"]
    assert runs["fused_head"]["meta"]["world_size"] == 1 and check["dtype"] == "float32"
    assert check["lm_head"] == {
        "unwrapped_fused": "fused",
        "unwrapped_model": "model",
        "fsdp2_fused": "fused",
    }
    comparisons = {c["comparison"]: c for c in check["comparisons"]}
    assert set(comparisons) == {
        "fsdp2_fused_vs_unwrapped_fused",
        "fsdp2_fused_vs_unwrapped_model",
        "unwrapped_fused_vs_unwrapped_model",
    }
    for c in comparisons.values():
        assert c["loss_rel_diff"] <= 1e-5 and c["grad_max_rel_norm_diff"] <= 1e-5, c["comparison"]
        assert c["params"] and all(p["ref_norm"] > 0 for p in c["params"]), "a parameter got no gradient"
    names = {p["name"] for p in comparisons["fsdp2_fused_vs_unwrapped_model"]["params"]}
    assert "model.embed_tokens.weight" in names  # tied to lm_head: both paths' gradients in one
    assert check["passed"] and runs["fused_head"]["errors"] == []
