"""Tree vs padding-free over many draws of the same samples, with a step-time breakdown.

:mod:`bench.packing` times one row per layout from one seed, and its two layouts draw different
samples. Here each *draw* (one seed) is the samples of the first row the trainer's batcher closes
from a stream of fresh groups, and both layouts train exactly those samples:

* ``tree``: the one packed row (prefixes shared), as ``AsyncGRPOTrainer.compute_loss`` runs it;
* ``padding_free``: the same samples with nothing shared, packed into as many rows as the token
  budget needs (a ratio-3.4 draw is about 3.4 rows).

A draw's tokens/s per layout is its trained tokens over the summed fwd+bwd seconds of its rows
(median of ``--steps`` timed steps per row, 3 by default, so one slow step does not move it; each timed
step is kept with the compilations and allocator events inside it, and ``slow_steps`` lists those
over 1.25x their row's fastest); the ratio is tree / padding-free of the same draw. The
report gives the mean, the standard deviation, min and max over draws of tokens/s, of the ratio
and of the packing ratio, the MFU by :func:`trainer.reporting.perf.training_flops` (the LM head charged only
on the positions it runs on) and peak memory.

``--breakdown`` profiles one tree step (fwd+bwd, then the optimizer) per configuration and splits
device time into attention, matmuls, element-wise work, head plus loss and optimizer; recompute is
the gap between a configuration with gradient checkpointing and the same one without (when both are
in ``--variants``). The matmul roofline is the step's matmul FLOPs at the measured bf16 rate.

Variants (``--variants``, comma-separated): ``default`` = the trainer's CUDA defaults (gradient
checkpointing on, norm and MLP blocks compiled), ``eager`` = checkpointing on, nothing compiled (the
defaults before), ``fast`` = checkpointing off, blocks compiled.

    python -m bench.packing_draws --out bench/results/packing-draws-h200.json --breakdown
    python -m bench.packing_draws --tiny --device cpu --draws 2 --out /tmp/draws.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers

from bench.packing import (
    _FIRST_RANDOM_ID,
    NUM_TOP_LOGPROBS,
    SHAPES,
    WORKLOADS,
    _gib,
    _sync,
    build_model,
    make_group,
    matmul_ceiling,
    tree_step,
)
from trainer.config.async_grpo_config import CUDA_MIN_SHARED_TOKENS
from trainer.reporting.perf import head_params, matmul_params_per_token, peak_flops, training_flops
from trainer.rollout.types import TrainingSequence
from trainer.step.attention import TREE_ATTENTION, padded_length, register_tree_attention
from trainer.step.loss import LossConfig
from trainer.step.packing import PackedRow, TokenBudgetBatcher, pack_row

VARIANTS = {  # name -> (gradient checkpointing, compiled norm/MLP blocks)
    "default": (True, True),
    "eager": (True, False),
    "fast": (False, True),
}
# ``layer<budget>`` (e.g. ``layer0.3``): each decoder layer compiled whole, no HF checkpointing, the
# compiler's partitioner recomputing under that activation memory budget (trainer.step.compiled_layers).
LAYER_PREFIX = "layer"
# Options after a variant's name, each ``-<option>``: ``-h<MiB>`` the fused head's chunk of logits,
# ``-prof`` the partitioner's runtime estimate by timing its ops instead of counting FLOPs (whole
# layers only).
OPTION_SEPARATOR = "-"


def variant_options(name: str) -> dict[str, Any]:
    """The options after a variant's name: ``head_chunk_mib`` (None = the trainer's) and
    ``profile_estimator``."""
    options: dict[str, Any] = {"head_chunk_mib": None, "profile_estimator": False}
    for option in name.split(OPTION_SEPARATOR)[1:]:
        if option.startswith("h") and option[1:].isdigit():
            options["head_chunk_mib"] = int(option[1:])
        elif option == "prof":
            options["profile_estimator"] = True
        else:
            raise SystemExit(f"--variants: {name!r}: option {option!r} is none of h<MiB>, prof")
    return options


def variant_settings(name: str) -> tuple[bool, bool, float | None]:
    """(HF gradient checkpointing, compiled norm/MLP blocks, whole-layer budget or None) of a variant."""
    name = name.split(OPTION_SEPARATOR)[0]
    if name.startswith(LAYER_PREFIX):
        return False, True, float(name[len(LAYER_PREFIX) :])
    if name not in VARIANTS:
        raise SystemExit(f"--variants: {name!r} is none of {sorted(VARIANTS)} or {LAYER_PREFIX}<budget>")
    return (*VARIANTS[name], None)


LAYOUTS = ("tree", "padding_free")


# ------------------------------------------------------------------------------------------ data
@contextmanager
def head_chunk(mib: int | None) -> Iterator[None]:
    """The fused head's chunk of logits set to ``mib`` MiB inside (None: left as it is)."""
    from trainer.step import fused_head

    before = fused_head._CHUNK_BYTES
    if mib is not None:
        fused_head._CHUNK_BYTES = mib << 20
    try:
        yield
    finally:
        fused_head._CHUNK_BYTES = before


def draw_samples(
    seed: int, workload, vocab: int, token_budget: int, min_shared_tokens: int = 0
) -> list[TrainingSequence]:
    """The samples of the first row the trainer's batcher closes from a stream of groups (seed ``seed``)."""
    rng = random.Random(seed)
    batcher = TokenBudgetBatcher(token_budget, num_rows=1, min_shared_tokens=min_shared_tokens)
    group_id = 0
    while True:
        for sample in make_group(rng, workload, vocab, group_id):
            closed = batcher.add(sample)
            if closed:
                return list(closed[0][0])
        group_id += 1


def unshared(samples: list[TrainingSequence]) -> list[TrainingSequence]:
    """The same samples with nothing to share: each one's first token (an untrained prompt token)
    replaced by an id unique among them, and its own group. Lengths and trained tokens unchanged."""
    if len(samples) + 1 >= _FIRST_RANDOM_ID:
        raise ValueError("too many samples for unique first tokens")
    return [
        replace(s, input_ids=[1 + i] + list(s.input_ids[1:]), group_id=1 + i) for i, s in enumerate(samples)
    ]


def padding_free_rows(samples: list[TrainingSequence], token_budget: int) -> list[PackedRow]:
    """``samples`` unshared, packed into rows of at most ``token_budget`` tokens, batcher order."""
    batcher = TokenBudgetBatcher(token_budget, num_rows=1)
    rows = []
    for sample in unshared(samples):
        rows += [mb[0] for mb in batcher.add(sample)]
    rows += [mb[0] for mb in batcher.flush()]
    return [pack_row(r, NUM_TOP_LOGPROBS) for r in rows if r]


def row_flops(config, row: PackedRow) -> float | None:
    return training_flops(config, row.num_tokens, float(row.stats.attention_cost), row.stats.head_positions)


# ------------------------------------------------------------------------------------- timing
# A timed step slower than SLOW_STEP x its row's fastest is reported with what happened inside it.
SLOW_STEP = 1.25


def step_events(device: torch.device) -> dict[str, int]:
    """Running counts whose change inside a timed step explains a slow one: graphs compiled
    (``torch.compile``: a recompilation), and on CUDA the caching allocator's new device segments
    (``cudaMalloc``) and its retries (it freed its cache to fit an allocation)."""
    from torch._dynamo.utils import counters

    events = {"compiles": int(counters["stats"]["unique_graphs"])}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        events["device_mallocs"] = int(stats.get("num_device_alloc", 0))
        events["alloc_retries"] = int(stats.get("num_alloc_retries", 0))
    return events


def time_row(
    model, row: PackedRow, optimizer, device, loss_config, warmup: int, steps: int, warm: set[int]
) -> tuple[float, list[dict[str, Any]]]:
    """Median fwd+bwd seconds of ``row`` over ``steps`` timed steps (an optimizer step after each),
    and each timed step: ``{"s": seconds, **events}`` (:func:`step_events`' changes in that step).

    A row in a FlexAttention length bucket not in ``warm`` gets at least one untimed step first:
    a new bucket compiles (tens of seconds), which is start-up cost, not the step's."""
    bucket = padded_length(row.num_tokens)
    if bucket not in warm:
        warmup = max(warmup, 1)
        warm.add(bucket)
    timed = []
    for i in range(warmup + steps):
        _sync(device)
        before = step_events(device)
        t0 = time.perf_counter()
        tree_step(model, row, device, loss_config, "auto")
        _sync(device)
        seconds = time.perf_counter() - t0
        if i >= warmup:
            after = step_events(device)
            timed.append({"s": seconds, **{k: after[k] - before[k] for k in after}})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(statistics.median(t["s"] for t in timed)), timed


def graph_breaks() -> int:
    """Graph breaks torch.compile took so far in this process (a compiled layer that breaks runs
    in pieces, partitioned apart)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def slow_steps(draws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed steps over :data:`SLOW_STEP` x their row's fastest, with where they were and their
    events (a compile or allocator event names the cause; none: the device or the host stalled)."""
    slow = []
    for record in draws:
        for layout in LAYOUTS:
            for row, timed in enumerate(record[layout]["steps"]):
                fastest = min(t["s"] for t in timed)
                slow += [
                    {"seed": record["seed"], "layout": layout, "row": row, "x_fastest": t["s"] / fastest, **t}
                    for t in timed
                    if t["s"] > SLOW_STEP * fastest
                ]
    return slow


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": float(statistics.fmean(values)),
        "std": float(statistics.stdev(values)) if len(values) > 1 else 0.0,
        "min": float(min(values)),
        "max": float(max(values)),
        "n": len(values),
    }


# ---------------------------------------------------------------------------------- breakdown
# Kernel (CUDA) or operator (CPU) name fragments, lower case. Inductor's template kernels
# (``triton_tem_``) here are FlexAttention's: the matmuls are not autotuned into templates.
_ATTENTION_NAMES = ("flex", "flash", "fmha", "attention", "triton_tem_")
_MATMUL_NAMES = (
    "gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm100_", "matmul", "splitk",
    "aten::mm", "aten::addmm", "aten::bmm",
)  # fmt: skip
_HEAD_RANGES = ("bench/head+loss", "_FusedHead")


def _category(kernel_name: str, ranges: list[str]) -> str:
    """Which part of the step a device kernel belongs to, from its name and enclosing CPU ranges."""
    if any(r.startswith("bench/optimizer") or "Optimizer.step" in r for r in ranges):
        return "optimizer"
    if any(any(h in r for h in _HEAD_RANGES) for r in ranges):
        return "head_and_loss"
    name = kernel_name.lower()
    if any(k in name for k in _ATTENTION_NAMES):
        return "attention"
    if any(k in name for k in _MATMUL_NAMES):
        return "matmul"
    return "elementwise"


def breakdown(model, row: PackedRow, optimizer, device, loss_config) -> dict[str, float]:
    """Device seconds of one tree step (fwd+bwd+optimizer) per category, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        tree_step(model, row, device, loss_config, "auto")
        _sync(device)
        with record_function("bench/optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
    totals: dict[str, float] = dict.fromkeys(
        ("attention", "matmul", "elementwise", "head_and_loss", "optimizer"), 0.0
    )
    for event in prof.events():
        ranges, parent = [], event
        while parent is not None:
            ranges.append(parent.name)
            parent = parent.cpu_parent
        if device.type == "cuda":
            for kernel in getattr(event, "kernels", None) or []:
                totals[_category(kernel.name, ranges)] += kernel.duration / 1e6
        elif not event.name.startswith(("bench/", "ProfilerStep")):  # CPU: each operator's own time
            totals[_category(event.name, ranges)] += event.self_cpu_time_total / 1e6
    totals["device_total"] = sum(totals.values())
    return totals


def memory_phases(model, row: PackedRow, optimizer, device, loss_config) -> dict[str, float]:
    """GiB of device memory through one tree step: ``static`` (weights, optimizer state) before it,
    then the peak of each phase: the forward (loss included), the head and loss's backward, the
    layers' backward and the optimizer step (``<phase>_peak``)."""
    if device.type != "cuda":
        return {}
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[f"{name}_peak"] = _gib(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)

    _sync(device)
    marks["static"] = _gib(torch.cuda.memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    tree_step(model, row, device, loss_config, "auto", marks=mark)
    _sync(device)
    mark("layers_backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    mark("optimizer")
    return marks


# -------------------------------------------------------------------------------------- driver
def measure_config(model, shape: str, workload_name: str, variant: str, args, device, report) -> dict:
    """All draws of one (shape, workload, variant); the per-draw records and their spread."""
    workload = WORKLOADS[workload_name].scaled(16) if args.tiny else WORKLOADS[workload_name]
    vocab = SHAPES[shape]["vocab_size"]
    loss_config = LossConfig()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    peak = peak_flops(device, "bf16")
    draws = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    warm: set[int] = set()
    share = args.min_shared_tokens
    for d in range(args.draws):
        samples = draw_samples(args.seed + d, workload, vocab, args.token_budget, share)
        layouts = {
            "tree": [pack_row(samples, NUM_TOP_LOGPROBS, share)],
            "padding_free": padding_free_rows(samples, args.token_budget),
        }
        trained = sum(s.num_trained_tokens for s in samples)
        record: dict[str, Any] = {"seed": args.seed + d, "samples": len(samples), "trained_tokens": trained}
        warmup = args.warmup if d == 0 else args.warmup_later
        for layout, rows in layouts.items():
            timings = [
                time_row(model, r, optimizer, device, loss_config, warmup, args.steps, warm) for r in rows
            ]
            seconds = sum(median for median, _ in timings)
            flops = [row_flops(model.config, r) for r in rows]
            record[layout] = {
                "rows": len(rows),
                "forwarded_tokens": sum(r.num_tokens for r in rows),
                "head_positions": sum(r.stats.head_positions for r in rows),
                "fwd_bwd_s": seconds,
                "trained_tokens_per_s": trained / seconds,
                "mfu": sum(flops) / (seconds * peak) if peak and all(flops) else None,
                "steps": [timed for _, timed in timings],  # per row, each timed step
            }
        record["packing_ratio"] = (
            record["padding_free"]["forwarded_tokens"] / record["tree"]["forwarded_tokens"]
        )
        record["tree_vs_padding_free"] = (
            record["tree"]["trained_tokens_per_s"] / record["padding_free"]["trained_tokens_per_s"]
        )
        draws.append(record)
        print(
            f"  draw {d}: ratio {record['packing_ratio']:.2f} tree {record['tree']['trained_tokens_per_s'] / 1e3:.1f} "
            f"pf {record['padding_free']['trained_tokens_per_s'] / 1e3:.1f} ktok/s -> {record['tree_vs_padding_free']:.3f}x",
            flush=True,
        )
    checkpointing, compiled, layer_budget = variant_settings(variant)
    summary: dict[str, Any] = {
        "shape": shape,
        "workload": workload_name,
        "variant": variant,
        "gradient_checkpointing": checkpointing,
        "compile_pointwise": compiled,
        "layer_memory_budget": layer_budget,
        "draws": len(draws),
        "packing_ratio": _spread([r["packing_ratio"] for r in draws]),
        "tree_vs_padding_free": _spread([r["tree_vs_padding_free"] for r in draws]),
        "min_shared_tokens": share,
        "slow_steps": slow_steps(draws),
        "graph_breaks": graph_breaks(),
        "peak_memory_gib": _gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
    }
    for layout in LAYOUTS:
        summary[f"{layout}_tokens_per_s"] = _spread([r[layout]["trained_tokens_per_s"] for r in draws])
        mfus = [r[layout]["mfu"] for r in draws]
        summary[f"{layout}_mfu"] = _spread(mfus) if all(m is not None for m in mfus) else None
    if args.breakdown:
        samples = draw_samples(args.seed, workload, vocab, args.token_budget, share)
        row = pack_row(samples, NUM_TOP_LOGPROBS, share)
        parts = breakdown(model, row, optimizer, device, loss_config)
        flops_matmul = 6.0 * (
            matmul_params_per_token(model.config) * row.num_tokens
            + head_params(model.config) * row.stats.head_positions
        )
        rate = report["meta"]["measured_bf16_matmul_flops"]
        parts["matmul_roofline_s"] = flops_matmul / rate if rate else None
        summary["breakdown_tree_step_s"] = parts
        summary["memory_phases_gib"] = memory_phases(model, row, optimizer, device, loss_config)
    del optimizer
    model.zero_grad(set_to_none=True)
    return {"summary": summary, "draws": draws}


def add_recompute(summaries: list[dict[str, Any]]) -> None:
    """Recompute seconds of a checkpointed configuration: its tree step minus the uncheckpointed
    one's (same shape, workload and compilation), from the breakdowns' device totals."""
    for s in summaries:
        if not s["gradient_checkpointing"] or "breakdown_tree_step_s" not in s:
            continue
        for other in summaries:
            same = all(other[k] == s[k] for k in ("shape", "workload", "compile_pointwise"))
            plain = not other["gradient_checkpointing"] and other.get("layer_memory_budget") is None
            if same and plain and "breakdown_tree_step_s" in other:
                mine, theirs = s["breakdown_tree_step_s"], other["breakdown_tree_step_s"]
                mine["recompute_estimate_s"] = mine["device_total"] - theirs["device_total"]


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    """Mean ± std over draws; MFU by the corrected formula."""
    lines = [
        "| shape | variant (GC, compiled) | ratio mean ± std | tree ktok/s | padding-free ktok/s | tree / pf mean ± std (min–max) | MFU tree / pf | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        t, p, r, q = (
            s["tree_tokens_per_s"],
            s["padding_free_tokens_per_s"],
            s["tree_vs_padding_free"],
            s["packing_ratio"],
        )
        mfu = " / ".join(
            "-" if s[f"{x}_mfu"] is None else f"{100 * s[f'{x}_mfu']['mean']:.1f}%" for x in LAYOUTS
        )
        mem = "-" if s["peak_memory_gib"] is None else f"{s['peak_memory_gib']:.1f}"
        lines.append(
            f"| {s['shape']} | {s['variant']} ({'on' if s['gradient_checkpointing'] else 'off'}, "
            f"{'yes' if s['compile_pointwise'] else 'no'}) | {q['mean']:.2f} ± {q['std']:.2f} "
            f"| {t['mean'] / 1e3:.1f} ± {t['std'] / 1e3:.1f} | {p['mean'] / 1e3:.1f} ± {p['std'] / 1e3:.1f} "
            f"| {r['mean']:.3f} ± {r['std']:.3f} ({r['min']:.2f}–{r['max']:.2f}) | {mfu} | {mem} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model, lengths / 16 (CPU smoke run)")
    parser.add_argument("--plan", default="qwen3-1.7b:3.4,qwen3-1.7b:1.0", help="shape:workload pairs")
    parser.add_argument(
        "--variants", default="default,fast", help=f"of {sorted(VARIANTS)} or {LAYER_PREFIX}<budget>"
    )
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row, first draw")
    parser.add_argument("--warmup-later", type=int, default=0, help="untimed steps per row, later draws")
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per row (3: the median outvotes one slow step)"
    )
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument(
        "--min-shared-tokens",
        type=int,
        default=None,
        help=f"the trainer's tree_min_shared_tokens (default: {CUDA_MIN_SHARED_TOKENS} on CUDA, 0 on CPU)",
    )
    parser.add_argument(
        "--time-budget", type=float, default=float("inf"), help="skip configs after this many s"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    plan = [tuple(item.split(":")) for item in args.plan.split(",")]
    if args.tiny:
        plan = list(dict.fromkeys(("tiny", w) for _, w in plan))
        args.token_budget = min(args.token_budget, 1024)
    if args.min_shared_tokens is None:
        args.min_shared_tokens = CUDA_MIN_SHARED_TOKENS if device.type == "cuda" else 0
    register_tree_attention()
    report: dict[str, Any] = {
        "meta": {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "token_budget": args.token_budget,
            "min_shared_tokens": args.min_shared_tokens,
            "draws": args.draws,
            "timed_steps_per_row": args.steps,
            "peak_flops": peak_flops(device, "bf16"),
            "measured_bf16_matmul_flops": matmul_ceiling(device),
            "mfu_formula": "trainer.reporting.perf.training_flops: 6 x body params x forwarded tokens + 6 x head params x "
            "head positions + 3 x attention pair FLOPs",
        },
        "summary": [],
        "draws": [],
        "skipped": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        checkpointing, compiled, layer_budget = variant_settings(variant)
        for shape, workload_name in plan:
            if time.perf_counter() - started > args.time_budget:
                report["skipped"].append({"shape": shape, "workload": workload_name, "variant": variant})
                continue
            print(
                f"[{time.perf_counter() - started:6.1f}s] {shape} ratio~{workload_name} {variant}", flush=True
            )
            options = variant_options(variant)
            model = build_model(
                shape, device, checkpointing, compiled, layer_budget,
                profile_estimator=options["profile_estimator"],
            )  # fmt: skip
            model.set_attn_implementation(TREE_ATTENTION)
            with head_chunk(options["head_chunk_mib"]):
                result = measure_config(model, shape, workload_name, variant, args, device, report)
            result["summary"]["options"] = options
            del model
            report["summary"].append(result["summary"])
            report["draws"].append(
                {"shape": shape, "workload": workload_name, "variant": variant, "draws": result["draws"]}
            )
            add_recompute(report["summary"])
            report["meta"]["elapsed_s"] = time.perf_counter() - started
            args.out.write_text(json.dumps(report, indent=1))
    report["meta"]["elapsed_s"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=1))  # the configs skipped by --time-budget too
    print(markdown_table(report["summary"]))
    return report


if __name__ == "__main__":
    main()
