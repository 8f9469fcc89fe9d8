"""Tree packing throughput: trained tokens/s of forward + backward + optimizer step, three layouts.

Measures the spec's figure of merit ``batch/trained_tokens_per_step / perf/fwd_bwd_s`` for random-init
Qwen3-shaped models (bf16 weights, gradient checkpointing on) on GRPO-like workloads whose packing
ratio is set by the group size G, the shared prompt length P and the mean completion length C:
``ratio = G (P + C) / (P + G C)``. Three layouts of the same kind of samples are compared:

* ``tree``: the trainer's path. Samples go through :class:`trainer.step.packing.TokenBudgetBatcher` (one
  row, ``token_budget`` unique tokens), :func:`trainer.step.packing.pack_row`, the ``tree`` attention
  backend (FlexAttention on CUDA) with ``logits_to_keep`` and :func:`trainer.step.loss.packed_row_loss`,
  exactly as ``AsyncGRPOTrainer.compute_loss`` runs them.
* ``padding_free``: the same code path with nothing shared. Each sample's first token (a prompt token,
  never trained: ``loss_mask[0] == 0``) is replaced by an id unique within the row, so the prefix
  trie has one root per sample and the row is a plain concatenation with block-diagonal causal
  attention. Lengths, trained tokens and targets are unchanged.
* ``padded``: the samples of the padding-free row as a right-padded (B, L_max) batch through the
  model's standard ``sdpa`` attention with an ``attention_mask``; the LM head runs on the union of the
  trained positions and the same loss reads each sample's rows.

A step is one row (or one padded batch) forward + backward, then one AdamW step. Each configuration
is warmed up (FlexAttention compiles once per length bucket; all rows here fall in one bucket) and
then timed over ``--steps`` steps with ``torch.cuda.synchronize``; the medians are reported.

Run from the repository root::

    python -m bench.packing --out bench/results/packing-h200.json            # H200, full shapes
    python -m bench.packing --tiny --device cpu --out /tmp/packing-tiny.json  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.reporting.perf import peak_flops, training_flops
from trainer.rollout.types import TrainingSequence
from trainer.step.attention import TREE_ATTENTION, padded_length, register_tree_attention, tree_forward_kwargs
from trainer.step.compiled_layers import compile_decoder_layers
from trainer.step.fused_head import fused_head_weight, lm_head_bypassed
from trainer.step.linear_attention import install_tree_linear_attention
from trainer.step.loss import LossConfig, LossOutput, packed_row_loss
from trainer.step.modeling import compile_pointwise_modules
from trainer.step.packing import PackedRow, TokenBudgetBatcher, pack_row

# Real Qwen3 shapes (tied embeddings); random init is enough for throughput.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
    ),
    # Qwen3.5-style hybrid at the 0.6B sizes: 3 of every 4 layers gated DeltaNet (tree-aware kernels
    # of trainer.step.linear_attention), the 4th full attention.
    "hybrid-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        linear_num_value_heads=16,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
    "tiny-hybrid": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=2048,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    # CPU smoke test only.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=2048,
    ),
}


@dataclass(frozen=True)
class Workload:
    """Groups of ``group_size`` completions sharing a ``prompt_len``-token prompt; completion lengths
    are uniform in [C/2, 3C/2] (``completion_len`` = C, tokens), so padded batches carry padding."""

    name: str
    group_size: int
    prompt_len: int
    completion_len: int

    @property
    def expected_ratio(self) -> float:
        g, p, c = self.group_size, self.prompt_len, self.completion_len
        return g * (p + c) / (p + g * c)

    def scaled(self, divisor: int) -> Workload:
        return replace(
            self,
            prompt_len=max(1, self.prompt_len // divisor),
            completion_len=max(2, self.completion_len // divisor),
        )


# Ratios ~1.0, 2 and 3.4 with G = 8 (the trainer's default num_generations).
WORKLOADS = {
    "1.0": Workload("1.0", group_size=8, prompt_len=16, completion_len=1024),
    "2.0": Workload("2.0", group_size=8, prompt_len=683, completion_len=512),
    "3.4": Workload("3.4", group_size=8, prompt_len=1067, completion_len=256),
}
MODES = ("tree", "padding_free", "padded")
NUM_TOP_LOGPROBS = 8
# Random prompt/completion ids start here; ids below are free for the padding-free first tokens.
_FIRST_RANDOM_ID = 1000
_PAD_ID = 0


# ------------------------------------------------------------------------------------------ data
def make_group(rng: random.Random, workload: Workload, vocab: int, group_id: int) -> list[TrainingSequence]:
    """One group: ``G`` samples sharing a random prompt, each with its own random completion.

    Sampler log-probabilities sit near ``-log(vocab)`` (what a random-init policy gives) so the
    importance ratios stay inside the mask range and score centering sees realistic top-8 entries.
    """
    low = min(_FIRST_RANDOM_ID, vocab // 2)
    prompt = [rng.randrange(low, vocab) for _ in range(workload.prompt_len)]
    base_lp = -torch.log(torch.tensor(float(vocab))).item()
    c = workload.completion_len
    samples = []
    for k in range(workload.group_size):
        length = rng.randint(max(1, c // 2), max(1, c + c // 2))
        completion = [rng.randrange(low, vocab) for _ in range(length)]
        ids = prompt + completion
        mask = [0] * len(prompt) + [1] * length
        logprobs = [0.0] * len(prompt) + [base_lp + rng.uniform(-0.05, 0.05) for _ in range(length)]
        tops: list[dict[int, float] | None] = [None] * len(prompt)
        for _ in range(length):
            ids_k = rng.sample(range(low, vocab), NUM_TOP_LOGPROBS)
            tops.append({t: base_lp + rng.uniform(-0.05, 0.05) for t in ids_k})
        samples.append(
            TrainingSequence(
                input_ids=ids,
                loss_mask=mask,
                sampler_logprobs=logprobs,
                sampler_top_logprobs=tops,
                advantage=rng.uniform(-1.0, 1.0),
                group_id=group_id,
                rollout_id=f"g{group_id}-{k}",
            )
        )
    return samples


def fill_row(rng: random.Random, workload: Workload, vocab: int, token_budget: int, share: bool) -> list:
    """The first full row the trainer's batcher closes from a stream of fresh groups.

    With ``share=False`` each sample enters unshared (its own group and a unique first token).
    """
    batcher = TokenBudgetBatcher(token_budget, num_rows=1)
    group_id = 0
    next_unique = 1
    while True:
        group = make_group(rng, workload, vocab, group_id)
        group_id += 1
        if not share:
            group = [
                replace(s, input_ids=[next_unique + j] + list(s.input_ids[1:]), group_id=next_unique + j)
                for j, s in enumerate(group)
            ]
            next_unique += len(group)
            if next_unique + workload.group_size >= _FIRST_RANDOM_ID:
                raise ValueError("too many samples for unique first tokens; raise _FIRST_RANDOM_ID")
        for sample in group:
            closed = batcher.add(sample)
            if closed:
                return closed[0][0]


# -------------------------------------------------------------------------------------- steps
@dataclass
class PaddedBatch:
    """A right-padded batch: ``input_ids``/``attention_mask`` (B, L_max), ``keep`` (R,) positions the
    LM head runs on, ``logit_rows`` (N,) flat row of (B*R) logits predicting each trained token (in
    :func:`pack_row`'s trained-token order), ``row`` the padding-free packed row for the loss."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keep: torch.Tensor
    logit_rows: torch.Tensor
    row: PackedRow


def make_padded(samples: list[TrainingSequence], row: PackedRow) -> PaddedBatch:
    """The padded layout of ``samples`` (``row`` = their padding-free pack, same sample order)."""
    longest = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), longest), _PAD_ID, dtype=torch.long)
    attn = torch.zeros((len(samples), longest), dtype=torch.long)
    positions = []  # (sample, logit position) per trained token, pack_row's order
    for b, s in enumerate(samples):
        ids[b, : len(s.input_ids)] = torch.tensor(s.input_ids)
        attn[b, : len(s.input_ids)] = 1
        positions.extend((b, i - 1) for i, m in enumerate(s.loss_mask) if m)
    sample_of, position = torch.tensor(positions, dtype=torch.long).T.contiguous()
    keep = torch.unique(position, sorted=True)
    logit_rows = sample_of * keep.numel() + torch.searchsorted(keep, position)
    if row.samples != samples:
        raise ValueError("row must pack exactly these samples in this order")
    return PaddedBatch(ids, attn, keep, logit_rows, row)


def _head(model, device: torch.device, fused: bool):
    """(context, weight): the trainer's choice of LM head (fused with the loss where the model allows)."""
    weight = fused_head_weight(model, device) if fused else None
    return (lm_head_bypassed(model) if weight is not None else nullcontext()), weight


def tree_step(
    model,
    row: PackedRow,
    device: torch.device,
    loss_config: LossConfig,
    backend: str,
    fused: bool = True,
    marks: Callable[[str], None] | None = None,
) -> LossOutput:
    """Forward + backward of one packed row, as ``AsyncGRPOTrainer.compute_loss`` does it; the loss
    output. ``marks(phase)`` is called after the forward (``forward``, the loss included) and once
    the head and loss's backward is done (``head_backward``)."""
    row = row.to(device)
    keep, logit_rows = row.logits_to_keep()
    head, weight = _head(model, device, fused)
    with head:
        outputs = model(**tree_forward_kwargs(row, device, backend=backend), logits_to_keep=keep)
    if marks is not None and outputs.logits.requires_grad:
        outputs.logits.register_hook(lambda grad: marks("head_backward"))
    with torch.profiler.record_function("bench/head+loss"):  # bench.packing_draws --breakdown
        out = packed_row_loss(
            outputs.logits,
            row,
            config=loss_config,
            num_trained_tokens=float(row.num_trained_tokens),
            logit_rows=logit_rows,
            lm_head_weight=weight,
        )
    if marks is not None:
        marks("forward")
    out.loss.backward()
    return out


def head_agreement(model, row: PackedRow, device: torch.device, loss_config: LossConfig) -> dict[str, float]:
    """Fused vs the model's own head on one row: relative difference of the loss and of all gradients.

    Run once per shape on the real device (the fused path's compiled kernels exist only on CUDA).
    """
    losses, grads = [], []
    for fused in (False, False, True):  # the model's head twice: the run-to-run noise floor
        model.zero_grad(set_to_none=True)
        out = tree_step(model, row, device, loss_config, "auto", fused=fused)
        losses.append(float(out.loss.detach()))
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]))
        del out
    model.zero_grad(set_to_none=True)
    fused_used = _head(model, device, True)[1] is not None
    norm = grads[0].norm().clamp_min(1e-30)
    return {
        "fused_head_used": fused_used,
        "loss_model_head": losses[0],
        "loss_fused_head": losses[2],
        "grad_rel_diff": float((grads[2] - grads[0]).norm() / norm),
        "grad_rel_diff_model_head_rerun": float((grads[1] - grads[0]).norm() / norm),
    }


def padded_step(
    model, batch: PaddedBatch, device: torch.device, loss_config: LossConfig, fused: bool = True
) -> None:
    """Forward + backward of one padded batch with standard attention and the same loss."""
    row = batch.row.to(device)
    head, weight = _head(model, device, fused)
    with head:
        outputs = model(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            use_cache=False,
            logits_to_keep=batch.keep.to(device),
        )
    logits = outputs.logits.reshape(-1, outputs.logits.shape[-1])
    out = packed_row_loss(
        logits,
        row,
        config=loss_config,
        num_trained_tokens=float(row.num_trained_tokens),
        logit_rows=batch.logit_rows.to(device),
        lm_head_weight=weight,
    )
    out.loss.backward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compile_count() -> int:
    """Frames Dynamo has compiled so far in this process (to spot recompiles inside timed steps)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)))


def time_steps(step, optimizer, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """Run ``warmup`` untimed then ``steps`` timed (fwd+bwd, optimizer) steps; seconds per step."""
    for _ in range(warmup):
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(device)
    compiled_before = _compile_count()
    fwd_bwd, opt = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        t2 = time.perf_counter()
        fwd_bwd.append(t1 - t0)
        opt.append(t2 - t1)
    return {
        "fwd_bwd_s": fwd_bwd,
        "optimizer_s": opt,
        "compiles_during_timing": _compile_count() - compiled_before,
    }


# -------------------------------------------------------------------------------------- driver
def matmul_ceiling(device: torch.device, size: int = 8192, reps: int = 10) -> float | None:
    """Measured bf16 matmul rate on random data (FLOP/s), the practical ceiling under the datasheet peak."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2.0 * size**3 * reps / (start.elapsed_time(end) / 1e3)


def build_model(
    shape: str,
    device: torch.device,
    checkpointing: bool = True,
    compile_pointwise: bool = False,
    layer_budget: float | None = None,
    *,
    profile_estimator: bool = False,
) -> Qwen3ForCausalLM:
    """Random-init Qwen3 (or Qwen3.5 hybrid) of ``shape`` in bf16 (gradient checkpointing unless
    told), in train mode; with ``layer_budget``, each decoder layer compiled whole under that
    activation memory budget (:mod:`trainer.step.compiled_layers`) instead; ``profile_estimator``
    has the partitioner time its ops to choose what to recompute (it counts FLOPs by default)."""
    torch.manual_seed(0)
    common = dict(
        tie_word_embeddings=True, max_position_embeddings=40960, attention_dropout=0.0, use_cache=False
    )
    if is_hybrid(shape):
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        layers = SHAPES[shape]["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        config = Qwen3_5TextConfig(**SHAPES[shape], layer_types=types, **common)
        with torch.device(device):
            model = Qwen3_5ForCausalLM(config)
        install_tree_linear_attention(model)
    else:
        config = Qwen3Config(**SHAPES[shape], **common)
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16)
    if layer_budget is not None:
        import torch._functorch.config as functorch_config

        torch._dynamo.reset()  # the layers' graphs of an earlier variant were partitioned under its budget
        functorch_config.activation_memory_budget_runtime_estimator = (
            "profile" if profile_estimator else "flops"
        )
        model.set_attn_implementation(TREE_ATTENTION)
        compile_decoder_layers(model, memory_budget=layer_budget)
    elif checkpointing:
        model.gradient_checkpointing_enable()
    if compile_pointwise and layer_budget is None:
        compile_pointwise_modules(model)
    model.train()
    return model


def is_hybrid(shape: str) -> bool:
    return "hybrid" in shape


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _gib(n: int) -> float:
    return n / 2**30


def run_config(
    model,
    mode: str,
    data: dict[str, Any],
    device: torch.device,
    args,
    loss_config: LossConfig,
    backend: str,
) -> dict[str, Any]:
    """Measure one (model, workload, layout) with tree backend ``backend``; returns its result record."""
    register_tree_attention()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    if mode == "padded":
        model.set_attn_implementation("sdpa")
        batch = data["padded"]
        row = batch.row
        forwarded = int(batch.input_ids.numel())
        real = int(batch.attention_mask.sum())
        pairs = float(sum(n * (n + 1) // 2 for n in row.stats.sample_tokens))
        bucket = None

        def step():
            padded_step(model, batch, device, loss_config, fused=args.head == "fused")

    else:
        model.set_attn_implementation(TREE_ATTENTION)
        row = data["tree"] if mode == "tree" else data["padding_free"]
        forwarded = real = row.num_tokens
        pairs = float(row.stats.attention_cost)
        bucket = padded_length(row.num_tokens)

        def step():
            tree_step(model, row, device, loss_config, backend, fused=args.head == "fused")

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    timing = time_steps(step, optimizer, device, args.warmup, args.steps)
    wall = time.perf_counter() - started
    fwd_bwd = _median(timing["fwd_bwd_s"])
    opt = _median(timing["optimizer_s"])
    trained = row.num_trained_tokens
    # the FLOPs model counts attention layers only: no MFU for a hybrid's linear-attention layers
    hybrid = "linear_attention" in (getattr(model.config, "layer_types", None) or [])
    flops = None if hybrid else training_flops(model.config, real, pairs)
    peak = peak_flops(device, "bf16")
    record = {
        "mode": mode,
        "tree_backend": None if mode == "padded" else backend,
        "samples": len(row.samples),
        "trained_tokens_per_step": trained,
        "forwarded_tokens": forwarded,
        "real_tokens": real,
        "pad_frac": 1.0 - real / forwarded if forwarded else 0.0,
        "packing_ratio": row.stats.raw_tokens / row.stats.forwarded_tokens if mode == "tree" else 1.0,
        "attention_pairs": pairs,
        "flex_bucket": bucket,
        "fwd_bwd_s": fwd_bwd,
        "optimizer_s": opt,
        "trained_tokens_per_s": trained / fwd_bwd,
        "trained_tokens_per_s_with_optimizer": trained / (fwd_bwd + opt),
        "fwd_bwd_mfu": flops / (fwd_bwd * peak) if flops and peak else None,
        "peak_memory_gib": _gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        "fwd_bwd_s_all": timing["fwd_bwd_s"],
        "optimizer_s_all": timing["optimizer_s"],
        "compiles_during_timing": timing["compiles_during_timing"],
        "config_wall_s": wall,
    }
    del optimizer
    model.zero_grad(set_to_none=True)
    return record


def measure(
    model, mode: str, data, device: torch.device, args, loss_config: LossConfig, report: dict[str, Any]
) -> dict[str, Any] | None:
    """:func:`run_config`, recording a failure in ``report["errors"]`` instead of ending the run.

    If the tree backend asked for fails, the packed layouts are measured again with the dense-mask
    SDPA backend (``--fallback-backend``), marked as such in the record.
    """
    backends = [args.backend]
    if mode != "padded" and args.fallback_backend and args.fallback_backend != args.backend:
        backends.append(args.fallback_backend)
    for backend in backends:
        try:
            return run_config(model, mode, data, device, args, loss_config, backend)
        except Exception as exc:  # a failed layout must not lose the others' numbers
            trace = traceback.format_exc()
            print(f"FAILED {mode} backend={backend}: {exc!r}\n{trace[-1200:]}", flush=True)
            report["errors"].append({"mode": mode, "backend": backend, "error": repr(exc), "trace": trace})
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return None


def prepare(workload: Workload, vocab: int, token_budget: int, seed: int) -> dict[str, Any]:
    """The three layouts' inputs for one workload (built on CPU, outside timing)."""
    tree = pack_row(
        fill_row(random.Random(seed), workload, vocab, token_budget, share=True), NUM_TOP_LOGPROBS
    )
    pf_samples = fill_row(random.Random(seed + 1), workload, vocab, token_budget, share=False)
    pf = pack_row(pf_samples, NUM_TOP_LOGPROBS)
    if pf.num_tokens != pf.stats.raw_tokens:
        raise AssertionError("padding-free row shares tokens")
    return {"tree": tree, "padding_free": pf, "padded": make_padded(pf_samples, pf)}


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (shape, workload): trained tokens/s of each layout and the two speedups."""
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        variant = (
            r.get("lm_head", "model"),
            r.get("gradient_checkpointing", True),
            r.get("compile_pointwise", False),
        )
        key = (r["shape"], r["workload"], *variant)
        entry = table.setdefault(
            key,
            {
                "shape": r["shape"],
                "workload": r["workload"],
                "lm_head": variant[0],
                "gradient_checkpointing": variant[1],
                "compile_pointwise": variant[2],
            },
        )
        entry[f"{r['mode']}_tokens_per_s"] = r["trained_tokens_per_s"]
        entry[f"{r['mode']}_mfu"] = r["fwd_bwd_mfu"]
        entry[f"{r['mode']}_peak_memory_gib"] = r["peak_memory_gib"]
        if r["mode"] == "tree":
            entry["packing_ratio"] = r["packing_ratio"]
        if r["mode"] != "padded":
            entry[f"{r['mode']}_backend"] = r["tree_backend"]
    for entry in table.values():
        tree, pf, padded = (entry.get(f"{m}_tokens_per_s") for m in MODES)
        entry["speedup_tree_vs_padding_free"] = tree / pf if tree and pf else None
        entry["speedup_padding_free_vs_padded"] = pf / padded if pf and padded else None
    return list(table.values())


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(summary: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (tokens/s in thousands)."""
    lines = [
        "| shape | head, GC, compiled | target ratio | measured ratio | tree ktok/s | padding-free ktok/s | padded ktok/s "
        "| tree / padding-free | padding-free / padded | MFU tree / pf / padded | peak GiB tree / pf / padded |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        tps = [e.get(f"{m}_tokens_per_s") for m in MODES]
        mfu = " / ".join(_fmt(e.get(f"{m}_mfu") and 100 * e[f"{m}_mfu"], ".1f") + "%" for m in MODES)
        mem = " / ".join(_fmt(e.get(f"{m}_peak_memory_gib"), ".1f") for m in MODES)
        lines.append(
            f"| {e['shape']} | {e.get('lm_head', 'model')}, {'on' if e.get('gradient_checkpointing', True) else 'off'}"
            f", {'yes' if e.get('compile_pointwise') else 'no'}"
            f" | {e['workload']} | {_fmt(e.get('packing_ratio'), '.2f')} | "
            + " | ".join(_fmt(t and t / 1e3, ".1f") for t in tps)
            + f" | {_fmt(e['speedup_tree_vs_padding_free'], '.2f')}x"
            f" | {_fmt(e['speedup_padding_free_vs_padded'], '.2f')}x | {mfu} | {mem} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results.")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and lengths / 16 (CPU smoke run)")
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b")
    parser.add_argument(
        "--plan",
        default="qwen3-0.6b:3.4,qwen3-0.6b:1.0,qwen3-0.6b:2.0,qwen3-1.7b:3.4,qwen3-1.7b:1.0,qwen3-1.7b:2.0",
        help="shape:workload pairs in run order (the most important first: a time budget cuts the tail)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="layouts to measure (hybrids: tree,padding_free)"
    )
    parser.add_argument("--token-budget", type=int, default=16384, help="unique tokens per packed row")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="auto", help="tree attention backend: auto, flex, sdpa")
    parser.add_argument(
        "--fallback-backend",
        default="sdpa",
        help="tree backend to retry a packed layout with if --backend fails ('' = none)",
    )
    parser.add_argument(
        "--time-budget", type=float, default=float("inf"), help="skip configs started after this many seconds"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--head",
        choices=("fused", "model"),
        default="fused",
        help="fused: the LM head fused with the loss, as the trainer runs it; model: the model's own head",
    )
    parser.add_argument("--gradient-checkpointing", choices=("on", "off"), default="on")
    parser.add_argument(
        "--compile-pointwise",
        action="store_true",
        help="torch.compile the norm and MLP blocks (trainer.step.modeling.compile_pointwise_modules)",
    )
    parser.add_argument(
        "--check-head",
        action="store_true",
        help="first compare the fused head's loss and gradients with the model's",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    plan = [tuple(item.split(":")) for item in args.plan.split(",")]
    if args.tiny:
        plan = list(dict.fromkeys(("tiny-hybrid" if is_hybrid(s) else "tiny", w) for s, w in plan))
        args.token_budget = min(args.token_budget, 1024)
    loss_config = LossConfig()
    report: dict[str, Any] = {
        "meta": {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dtype": "bfloat16 weights, AdamW (fused on CUDA)",
            "gradient_checkpointing": args.gradient_checkpointing == "on",
            "lm_head": args.head,
            "compile_pointwise": args.compile_pointwise,
            "token_budget": args.token_budget,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "tree_backend": args.backend,
            "workloads": {k: vars(w) | {"expected_ratio": w.expected_ratio} for k, w in WORKLOADS.items()},
            "peak_flops": peak_flops(device, "bf16"),
            "measured_bf16_matmul_flops": matmul_ceiling(device),
        },
        "results": [],
        "skipped": [],
        "errors": [],
        "head_agreement": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model, model_shape = None, None
    prepared: dict[tuple[str, int], dict[str, Any]] = {}
    for shape, workload_name in plan:
        workload = WORKLOADS[workload_name].scaled(16) if args.tiny else WORKLOADS[workload_name]
        if time.perf_counter() - started > args.time_budget:
            report["skipped"].append({"shape": shape, "workload": workload_name, "why": "time budget"})
            continue
        if shape != model_shape:
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model, model_shape = (
                build_model(shape, device, args.gradient_checkpointing == "on", args.compile_pointwise),
                shape,
            )
        t0 = time.perf_counter()
        key = (workload_name, SHAPES[shape]["vocab_size"])
        if key not in prepared:  # shapes with one vocabulary share the inputs
            prepared[key] = prepare(workload, SHAPES[shape]["vocab_size"], args.token_budget, args.seed)
        data = prepared[key]
        prep_s = time.perf_counter() - t0
        if args.check_head and shape not in report["head_agreement"]:
            report["head_agreement"][shape] = head_agreement(model, data["tree"], device, loss_config)
            print(f"{shape} fused vs model head: {report['head_agreement'][shape]}", flush=True)
        for mode in args.modes.split(","):
            record = measure(model, mode, data, device, args, loss_config, report)
            if record is None:
                continue
            record.update(
                shape=shape,
                workload=workload_name,
                prepare_s=prep_s,
                lm_head=args.head,
                gradient_checkpointing=args.gradient_checkpointing == "on",
                compile_pointwise=args.compile_pointwise,
            )
            report["results"].append(record)
            print(
                f"[{time.perf_counter() - started:6.1f}s] {shape} ratio~{workload_name} {mode:12s} "
                f"rows {record['forwarded_tokens']:6d} trained {record['trained_tokens_per_step']:6d} "
                f"fwd_bwd {record['fwd_bwd_s'] * 1e3:8.1f} ms opt {record['optimizer_s'] * 1e3:6.1f} ms "
                f"{record['trained_tokens_per_s'] / 1e3:8.1f} ktok/s mfu {_fmt(record['fwd_bwd_mfu'], '.3f')} "
                f"mem {_fmt(record['peak_memory_gib'], '.1f')} GiB compiles {record['compiles_during_timing']} "
                f"(config {record['config_wall_s']:.1f}s)",
                flush=True,
            )
            report["summary"] = summarize(report["results"])
            report["meta"]["elapsed_s"] = time.perf_counter() - started
            args.out.write_text(json.dumps(report, indent=1))
    report["summary"] = summarize(report["results"])
    report["meta"]["elapsed_s"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=1))
    print(markdown_table(report["summary"]))
    if report["skipped"]:
        print("skipped:", report["skipped"])
    return report


if __name__ == "__main__":
    main()
