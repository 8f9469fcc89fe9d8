"""Whole-layer compilation under an activation memory budget, against HF checkpointing: one tree
row, every variant on the same samples; step time, peak memory, compile time, and agreement with
the uncompiled model (loss and gradients).

Variants: ``default`` (HF checkpointing + compiled norm/MLP blocks, the CUDA default before),
``fast`` (no checkpointing, compiled blocks), ``layer<budget>`` (each decoder layer compiled whole,
:mod:`trainer.step.compiled_layers`, the partitioner recomputing under ``activation_memory_budget``).

    python -m bench.compiled_layers --out bench/results/compiled-layers-h200.json \\
        --variants default,fast,layer1.0,layer0.5,layer0.2
    python -m bench.compiled_layers --tiny --device cpu --variants fast,layer0.5 --out /tmp/cl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.packing import NUM_TOP_LOGPROBS, SHAPES, WORKLOADS, _gib, _sync, build_model, tree_step
from bench.packing_draws import draw_samples, head_chunk, variant_options, variant_settings
from trainer.reporting.perf import peak_flops, training_flops
from trainer.step.attention import TREE_ATTENTION
from trainer.step.loss import LossConfig
from trainer.step.packing import pack_row


def gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, fp32 on the CPU (then cleared)."""
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all gradients together."""
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / den) ** 0.5 if den else 0.0


def measure(variant: str, row, args, device, reference) -> dict:
    """Compile time, median step seconds, peak memory and agreement of one variant on ``row``."""
    checkpointing, compiled, budget = variant_settings(variant)
    model = build_model(
        args.shape, device, checkpointing, compiled, budget,
        profile_estimator=variant_options(variant)["profile_estimator"],
    )  # fmt: skip
    model.set_attn_implementation(TREE_ATTENTION)
    loss_config = LossConfig()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    out = tree_step(model, row, device, loss_config, "auto")
    _sync(device)
    first_s = time.perf_counter() - t0
    loss = float(out.loss.detach())
    grads = gradients(model)
    if reference is None:
        reference = {"loss": loss, "grads": grads}
    agreement = {
        "loss_rel_diff": abs(loss - reference["loss"]) / max(abs(reference["loss"]), 1e-12),
        "grad_rel_diff": relative_difference(grads, reference["grads"]),
    }
    del grads
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        tree_step(model, row, device, loss_config, "auto")
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = statistics.median(times)
    flops = training_flops(
        model.config, row.num_tokens, float(row.stats.attention_cost), row.stats.head_positions
    )
    peak = peak_flops(device, "bf16")
    record = {
        "variant": variant,
        "gradient_checkpointing": checkpointing,
        "layer_memory_budget": budget,
        "first_step_s": first_s,
        "step_s": seconds,
        "step_s_all": times,
        "trained_tokens_per_s": row.num_trained_tokens / seconds,
        "mfu": flops / (seconds * peak) if flops and peak else None,
        "peak_memory_gib": _gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        **agreement,
    }
    del optimizer, model
    return record, reference


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shape, lengths / 16 (CPU smoke run)")
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--workload", default="3.4")
    parser.add_argument("--variants", default="fast,default,layer1.0,layer0.5,layer0.2")
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    workload = WORKLOADS[args.workload]
    if args.tiny:
        args.shape, workload, args.token_budget = "tiny", workload.scaled(16), min(args.token_budget, 1024)
    samples = draw_samples(args.seed, workload, SHAPES[args.shape]["vocab_size"], args.token_budget)
    row = pack_row(samples, NUM_TOP_LOGPROBS)
    report = {"command": " ".join(sys.argv), "torch": torch.__version__, "row_tokens": row.num_tokens,
              "trained_tokens": row.num_trained_tokens, "results": []}  # fmt: skip
    reference = None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        with head_chunk(variant_options(variant)["head_chunk_mib"]):
            record, reference = measure(variant, row, args, device, reference)
        report["results"].append(record)
        print(
            f"{variant:10s} step {record['step_s'] * 1e3:7.1f} ms  {record['trained_tokens_per_s'] / 1e3:6.1f} ktok/s "
            f"mfu {100 * (record['mfu'] or 0):5.1f}%  peak {record['peak_memory_gib'] or 0:6.2f} GiB  "
            f"first {record['first_step_s']:6.1f} s  loss diff {record['loss_rel_diff']:.2e} "
            f"grad diff {record['grad_rel_diff']:.2e}",
            flush=True,
        )
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
