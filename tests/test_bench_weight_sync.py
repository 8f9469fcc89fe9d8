"""The weight-sync benchmark (``bench/weight_sync.py``) in its CPU mode: gloo sender, spawned receiver.

The run goes through the same round loop, bucket cut, load and bit-exact check as the 2-GPU NCCL run;
a receiver that corrupts one bit must fail it, and the comparison must see single-bit differences.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.weight_sync import compare_parameters, load_weights, mismatch, tie_groups
from bench.weight_sync import main as bench_main

REPO = Path(__file__).resolve().parent.parent


def run_bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "bench.weight_sync", "--device", "cpu", "--backend", "gloo", "--tiny"]
    return subprocess.run(
        [*argv, "--out", str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_cpu_run_is_bit_exact_and_timed(tmp_path):
    out = tmp_path / "ws.json"
    proc = run_bench(out, "--reps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and not report["errors"] and not report["skipped"]
    assert report["meta"]["backend"] == "gloo" and report["meta"]["receiver"]["pid"] > 0
    results = report["results"]
    assert [r["bucket_mb"] for r in results] == [0.0625, 1.0]
    assert results[0]["bucket_count"] > 1 and results[1]["bucket_count"] == 1
    for r in results:
        assert r["exact_match"] is True and r["mismatches"] == []
        # Every parameter is checked, the tied lm_head alias included (it is not sent in a round).
        assert r["verified_tensors"] == r["tensor_count"] + 1
        assert r["payload_bytes"] > 0 and r["params"] * 2 == r["payload_bytes"]
        assert r["raw_s"] > 0 and r["sync_s"] > 0 and r["ratio"] > 0 and r["sync_gbps"] > 0
        assert len(r["sync_samples_s"]) == 2 and all(s > 0 for s in r["sync_samples_s"])
        # The receiver finished before the sender read its "done" message (one clock for both).
        assert r["sync_s"] <= r["phases"]["sync_acked_s"]
        assert all(v > 0 for v in r["phases"].values()), r["phases"]
    assert report["best"]["tiny"]["bucket_mb"] in (0.0625, 1.0)


@pytest.mark.slow
def test_corrupted_receiver_fails_the_run(tmp_path, capsys):
    """In this process (saves an interpreter start): the receiver flips one bit before the check."""
    out = tmp_path / "ws.json"
    threads = torch.get_num_threads()
    try:
        status = bench_main(
            ["--device", "cpu", "--backend", "gloo", "--tiny", "--reps", "1", "--warmup", "0"]
            + ["--bucket-mb", "1", "--corrupt-receiver", "--out", str(out)]
        )
    finally:
        torch.set_num_threads(threads)  # the CPU mode runs single-threaded
    assert status == 1, capsys.readouterr()
    report = json.loads(out.read_text())
    assert not report["ok"] and "differ from the sender's" in report["errors"][0]["error"]
    (result,) = report["results"]
    assert result["exact_match"] is False
    (problem,) = result["mismatches"]
    assert problem.endswith("1 of 64 elements differ"), problem  # the final norm, 64 wide


def test_a_failure_exits_nonzero_and_stops_the_receiver(tmp_path, capsys):
    out = tmp_path / "ws.json"
    threads = torch.get_num_threads()
    try:
        status = bench_main(["--device", "cpu", "--shapes", "no-such-model", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert status == 1
    report = json.loads(out.read_text())
    assert not report["ok"] and "unknown shapes ['no-such-model']" in report["errors"][0]["error"]
    assert multiprocessing.active_children() == []  # the spawned receiver was stopped and reaped


def test_comparison_sees_single_bits_names_and_shapes():
    base = {"a": torch.randn(4, 3).to(torch.bfloat16), "b": torch.arange(6, dtype=torch.float32)}
    same = {k: v.clone() for k, v in base.items()}
    assert compare_parameters(base.items(), same) == []

    flipped = {k: v.clone() for k, v in base.items()}
    flipped["a"].view(torch.int16).view(-1)[5] ^= 1  # lowest mantissa bit of one element
    assert compare_parameters(base.items(), flipped) == ["a: 1 of 12 elements differ"]

    # Bits, not values: -0.0 == 0.0 as numbers, but the receiver does not hold the sender's bytes.
    zero = torch.zeros(2)
    assert mismatch("z", zero, -zero) == "z: 2 of 2 elements differ"
    nan = torch.full((3,), float("nan"))
    assert mismatch("n", nan, nan.clone()) is None

    assert compare_parameters(base.items(), {"a": same["a"]}) == ["b: missing on the receiver"]
    extra = {**same, "c": torch.zeros(1)}
    assert compare_parameters(base.items(), extra) == ["c: only on the receiver"]
    assert "shape" in mismatch("b", base["b"], base["b"].view(2, 3))
    assert "dtype" in mismatch("b", base["b"], base["b"].double())


def test_load_weights_rejects_what_copy_would_silently_accept():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight  # tied, as Qwen3's lm_head and embed_tokens
    targets = dict(model.named_parameters(remove_duplicate=False))
    assert tie_groups(model) == [["0.weight", "1.weight"]]
    new = torch.randn(8, 4)
    assert load_weights(targets, [("0.weight", new)]) == 1
    assert torch.equal(model[1].weight, new) and tie_groups(model) == [["0.weight", "1.weight"]]
    with pytest.raises(ValueError, match="received"):
        load_weights(targets, [("0.weight", torch.randn(1, 4))])  # copy_ would broadcast it
    with pytest.raises(ValueError, match="received"):
        load_weights(targets, [("0.weight", new.double())])  # copy_ would convert it
    with pytest.raises(KeyError, match="2.weight"):
        load_weights(targets, [("2.weight", new)])
