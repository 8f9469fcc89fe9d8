"""Attention alone: forward + backward of one layer's attention on the packing benchmark's rows.

Complements ``bench/packing.py`` (the full training step) with the attention kernel by itself, on the
same rows (``bench.packing.prepare``) and Qwen3-1.7B's attention shape (16 query heads, 8 KV heads,
head dim 128, bf16):

* ``tree``: the trainer's tree attention (:func:`trainer.step.attention.tree_attention_forward`,
  FlexAttention with the trie's block mask on CUDA) on the tree row;
* ``padding_free``: the same function on the padding-free row (block-diagonal causal mask);
* ``varlen``: the padding-free row through PyTorch's variable-length flash kernel
  (``torch.nn.attention.varlen.varlen_attn``) where this torch has it;
* ``padded``: the padding-free row's samples right-padded to (B, L_max), causal flash SDPA.

Reported per layout: median milliseconds of forward + backward, the (query, key) pairs attended
(useful pairs: padding and masked-out pairs excluded) and the useful attention TFLOP/s
(4 · pairs · head_dim · heads for the forward, 2.5× that for the backward).

    python -m bench.attention --out bench/results/attention-h200.json
    python -m bench.attention --tiny --device cpu --out /tmp/attention-tiny.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.packing import WORKLOADS, prepare
from trainer.step.attention import TreeMask, tree_attention_forward

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _qkv(batch: int, length: int, device: torch.device, heads: int, kv_heads: int, dim: int):
    """Random (B, H, L, D) query and (B, Hkv, L, D) key/value leaves in bf16 (fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(batch, heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim)]
    return [torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes]


def _time(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Seconds per call of ``fn`` (forward + backward) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def tree_fn(row, device: torch.device, dims) -> tuple[Any, float]:
    """Forward + backward of tree attention over ``row``; returns (callable, useful pairs)."""
    q, k, v = _qkv(1, row.num_tokens, device, *dims)
    mask = TreeMask(row.tin.to(device), row.tout.to(device), positions=row.position_ids.to(device))
    module = torch.nn.Module()

    def run():
        out, _ = tree_attention_forward(module, q, k, v, None, tree_mask=mask)
        out.sum().backward()

    return run, float(row.stats.attention_cost)


def varlen_fn(row, device: torch.device, dims) -> tuple[Any, float] | None:
    """The padding-free row through the varlen flash kernel, or None where torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if device.type != "cuda":
        return None
    heads, kv_heads, dim = dims
    lengths = torch.tensor(row.stats.sample_tokens, dtype=torch.int32, device=device)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lengths, 0)
    total, longest = int(cu[-1]), int(lengths.max())
    dtype = torch.bfloat16
    q = torch.randn(total, heads, dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, device=device, dtype=dtype, requires_grad=True)
    groups = heads // kv_heads
    # the keyword for causal masking changed between torch releases
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}

    def run():
        # the varlen kernel wants as many K/V heads as query heads
        kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = varlen_attn(q, kk, vv, cu, cu, longest, longest, **causal)
        out.sum().backward()

    pairs = float(sum(n * (n + 1) // 2 for n in row.stats.sample_tokens))
    return run, pairs


def padded_fn(row, device: torch.device, dims) -> tuple[Any, float]:
    """The row's samples right-padded to (B, L_max), causal SDPA (flash on CUDA)."""
    lengths = row.stats.sample_tokens
    heads, kv_heads, dim = dims
    q, k, v = _qkv(len(lengths), max(lengths), device, heads, kv_heads, dim)

    def run():
        # Right padding under a causal mask never reaches a real query: no padding mask needed.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()

    return run, float(sum(n * (n + 1) // 2 for n in lengths))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small heads and lengths / 16 (CPU smoke run)")
    parser.add_argument("--workloads", default="3.4,1.0,2.0")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dims = (4, 2, 16) if args.tiny else (HEADS, KV_HEADS, HEAD_DIM)
    budget = min(args.token_budget, 1024) if args.tiny else args.token_budget
    report: dict[str, Any] = {
        "meta": {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "heads": dims[0],
            "kv_heads": dims[1],
            "head_dim": dims[2],
            "token_budget": budget,
        },
        "results": [],
    }
    for name in args.workloads.split(","):
        workload = WORKLOADS[name].scaled(16) if args.tiny else WORKLOADS[name]
        data = prepare(workload, 151936, budget, args.seed)
        layouts = {
            "tree": tree_fn(data["tree"], device, dims),
            "padding_free": tree_fn(data["padding_free"], device, dims),
            "varlen": varlen_fn(data["padding_free"], device, dims),
            "padded": padded_fn(data["padding_free"], device, dims),
        }
        for layout, made in layouts.items():
            if made is None:
                continue
            run, pairs = made
            try:
                times = _time(run, device, args.warmup, args.reps)
            except Exception as exc:  # one kernel's failure must not lose the other layouts
                print(f"ratio~{name} {layout}: FAILED {exc!r}", flush=True)
                report.setdefault("errors", []).append(
                    {"workload": name, "layout": layout, "error": repr(exc)}
                )
                continue
            ms = 1e3 * statistics.median(times)
            flops = 3.5 * 4 * pairs * dims[2] * dims[0]
            record = {
                "workload": name,
                "layout": layout,
                "tokens": data["tree" if layout == "tree" else "padding_free"].num_tokens,
                "trained_tokens": data["tree" if layout == "tree" else "padding_free"].num_trained_tokens,
                "pairs": pairs,
                "fwd_bwd_ms": ms,
                "fwd_bwd_ms_all": [1e3 * t for t in times],
                "useful_tflops": flops / (ms / 1e3) / 1e12,
            }
            report["results"].append(record)
            print(
                f"ratio~{name} {layout:12s} tokens {record['tokens']:6d} pairs {pairs / 1e6:8.2f}M "
                f"{ms:8.3f} ms {record['useful_tflops']:7.1f} TFLOP/s",
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
