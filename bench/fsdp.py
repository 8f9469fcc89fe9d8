"""FSDP2 through accelerate: the trainer's step on N processes against one device, and its throughput scaling.

What is measured, with the trainer's own pieces (:class:`trainer.step.packing.TokenBudgetBatcher` with
``num_rows = world size``, :func:`trainer.step.packing.pack_row`, tree attention, and a loss that mirrors
``AsyncGRPOTrainer.compute_loss``: each process's row loss divided by the trained tokens of the whole
micro-batch, multiplied by the number of processes because FSDP averages gradients while the spec sums):

1. **Correctness** (fp32, so that a tolerance means something). Every rank builds the same random-init
   model and the same micro-batches. Every rank first runs the *single-device* step on its own device:
   all rows of the micro-batch one after the other with gradient accumulation (no process group, no
   sharding), keeping the loss and fp32 copies of the full gradients. Then the model is wrapped with
   FSDP2 by ``accelerator.prepare`` (``fully_shard`` per ``_no_split_modules`` layer, accelerate's
   embedding/head group, the root), each rank forwards and backpropagates its own row only, and every
   gradient is gathered (``DTensor.full_tensor()``) and compared with the single-device one: max
   absolute difference and ``||g_fsdp - g_ref|| / ||g_ref||`` per parameter, and the loss summed
   over ranks against the single-device loss. The single device runs the model's own LM head (the
   reference), FSDP2 the trainer's choice (``--head fused``: fused with the loss, on FSDP2's gathered
   head weight); both the SDPA tree backend (exact; an fp32 FlexAttention compile would cost
   minutes). ``lm_head`` records the head of each side (FSDP2: per rank, None for an empty row).
   Two cases: a full micro-batch from the sample stream (rows of
   ``--check-token-budget``), and a starved flush that leaves a rank with an empty row (that rank
   runs a dummy one-token forward: FSDP2 gathers each layer's shards inside the layer's forward, so
   a rank that skips the forward leaves the others waiting in the all-gather).
2. **Throughput** (bf16 weights, gradient checkpointing, fused AdamW, the shapes of :mod:`bench.packing`;
   fp32 weights on CPU, where bf16 matmuls are emulated and the run only smoke-tests the code).
   Trained tokens/s of forward + backward (+ optimizer step) on the same micro-batches: one device
   (every rank measures it alone on its own GPU at the same time, with no communication; rank 0's
   numbers are the baseline) against N devices with FSDP2 (each rank its row; a step's time is the
   slowest rank's). ``--steps`` distinct micro-batches are run once untimed (compilation of every
   FlexAttention length bucket) and once timed; medians over the timed steps. ``scaling`` =
   tokens/s on N devices / tokens/s on one. With ``--head fused`` (the trainer's choice) both sides
   fuse the LM head with the loss where :func:`trainer.step.fused_head.fused_lm_head` allows (``lm_head``
   of each record); should FSDP2 end up on the model's head, a second single-device run with that
   head gives the scaling of identical computation (``scaling_same_head``).
3. ``batch/row_imbalance`` (max / mean attention cost of a micro-batch's rows, the trainer's
   :func:`trainer.step.packing.batch_metrics`, reduced by the trainer's :class:`trainer.reporting.metrics.MetricWindow`)
   and the other ``batch/*`` values of every step are logged.

``--check-fused-head`` (one process) runs only :func:`fused_head_check`: the FSDP2-wrapped model's
step with the fused head against the same model unwrapped, fused and with the model's own head
(losses and every gradient, ``fused_head_check`` in the JSON)::

    python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m bench.fsdp \
        --check-fused-head --check-shape qwen3-0.6b --out bench/results/fsdp-fused-head-h200.json

Launch (the same command on CPU/gloo and CUDA/NCCL; run from the repository root with the
interpreter that holds torch, ``python3`` on the GPU machines)::

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m bench.fsdp \\
        --out bench/results/fsdp-h200x2.json                                   # 2 x H200, real shapes
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m bench.fsdp \\
        --device cpu --tiny --out /tmp/fsdp-tiny.json                          # CPU smoke run (gloo)

On CUDA, accelerate selects FSDP from the plugin passed to ``Accelerator``. On CPU accelerate picks
``MULTI_CPU`` (its state only turns FSDP on for accelerator devices, so ``prepare`` would wrap in
DDP); ``fully_shard`` itself runs on a CPU device mesh over gloo, so the CPU mode sets the state's
``distributed_type`` to FSDP and ``prepare`` then takes the same ``fsdp2_prepare_model`` path.

Every collective runs under the process group's ``--pg-timeout``; a failure ends the run with a
nonzero exit (1: an error, 2: the gradients or losses out of tolerance) after writing what it has.
The JSON is rewritten after every phase. On a cold machine the first FlexAttention compile takes
minutes (both ranks compile at once, in the single-device phase); ``--time-budget`` stops starting
new shapes after that many seconds, and ``--skip-check --shapes qwen3-1.7b`` runs a skipped shape
later (the inductor cache is warm then). FlexAttention has no backward on CPU: there ``auto`` is SDPA.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import hashlib
import itertools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import accelerate
import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

from bench.packing import NUM_TOP_LOGPROBS, SHAPES, WORKLOADS, Workload, build_model, make_group, time_steps
from trainer.reporting.metrics import MetricWindow
from trainer.reporting.perf import peak_flops, training_flops
from trainer.step.attention import tree_forward_kwargs, use_tree_attention
from trainer.step.fused_head import HeadChoice, fused_lm_head, prime_fused_head
from trainer.step.loss import LossConfig, packed_row_loss
from trainer.step.modeling import empty_row_loss
from trainer.step.packing import MicroBatch, PackedRow, TokenBudgetBatcher, batch_metrics, pack_row, row_stats

DEFAULT_OUT = Path("bench/results/fsdp-h200x2.json")


# ------------------------------------------------------------------------------------ data
@dataclass
class StepData:
    """One optimizer step of the trainer with ``gradient_accumulation_steps = 1``: one micro-batch.

    Attributes:
        samples: the micro-batch as the batcher closed it, one list of samples per process (row).
        rows: per process its packed row, None for an empty row.
        global_trained_tokens: trained tokens of all rows (the loss's denominator, tokens).
        logged: the ``batch/*`` metrics the trainer logs for this step (window-reduced).
    """

    samples: MicroBatch
    rows: list[PackedRow | None]
    global_trained_tokens: int
    logged: dict[str, float]

    @property
    def forwarded_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows if r is not None)


def stream_micro_batches(
    workload: Workload, vocab: int, token_budget: int, num_rows: int, count: int, seed: int
) -> list[MicroBatch]:
    """The first ``count`` micro-batches the trainer's batcher closes from a stream of fresh groups."""
    rng = random.Random(seed)
    batcher = TokenBudgetBatcher(token_budget, num_rows=num_rows)
    closed: list[MicroBatch] = []
    for group_id in itertools.count():
        for sample in make_group(rng, workload, vocab, group_id):
            closed.extend(batcher.add(sample))
        if len(closed) >= count:
            return closed[:count]
    raise AssertionError("unreachable")


def starved_micro_batch(
    workload: Workload, vocab: int, token_budget: int, num_rows: int, seed: int
) -> MicroBatch:
    """One group flushed alone, as the feed does when the rollout queue starves: rows after the
    first stay empty (the group's home row holds it while it fits)."""
    batcher = TokenBudgetBatcher(token_budget, num_rows=num_rows)
    for sample in make_group(random.Random(seed), workload, vocab, group_id=0):
        if batcher.add(sample):
            raise ValueError("one group does not fit one row; raise the token budget")
    (batch,) = batcher.flush()
    if all(batch):
        raise ValueError("the flushed micro-batch has no empty row")
    return batch


def step_data(batch: MicroBatch, token_budget: int) -> StepData:
    """Pack every row of ``batch`` and compute the step's logged ``batch/*`` metrics as the trainer does
    (``RolloutFeed.finish_step``: :func:`batch_metrics` recorded into a window, reduced at the log)."""
    rows = [pack_row(samples, NUM_TOP_LOGPROBS) if samples else None for samples in batch]
    metrics = batch_metrics([[row_stats(samples) for samples in batch]], token_budget)
    window = MetricWindow()
    metrics.record(window)
    global_trained = sum(s.num_trained_tokens for samples in batch for s in samples)
    return StepData(samples=batch, rows=rows, global_trained_tokens=global_trained, logged=window.reduce())


def fingerprint(steps: list[StepData]) -> str:
    """A digest of every row's token ids, to check that all ranks built the same micro-batches."""
    digest = hashlib.sha256()
    for step in steps:
        for row in step.rows:
            digest.update(b"-" if row is None else row.input_ids.numpy().tobytes())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------ the loss
def row_loss(
    model: torch.nn.Module,
    row: PackedRow,
    *,
    global_trained_tokens: int,
    num_processes: int,
    device: torch.device,
    loss_config: LossConfig,
    backend: str,
    head: str,
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """One process's row, as ``AsyncGRPOTrainer.compute_loss`` computes it.

    Args:
        model: the (possibly FSDP2-wrapped) policy in tree attention.
        row: this process's packed row (L unique tokens, N trained tokens).
        global_trained_tokens: trained tokens of the micro-batch over all processes.
        num_processes: the loss multiplier (DP averages gradients over processes; the spec sums).
        head: ``fused`` (the trainer's choice: fused with the loss where the model allows) or ``model``.

    Returns ``(loss to backpropagate, the row's unscaled loss (detached), "fused" | "model")``.
    """
    row = row.to(device)
    keep, logit_rows = row.logits_to_keep()
    with fused_lm_head(model, device) if head == "fused" else nullcontext(HeadChoice()) as used:
        outputs = model(**tree_forward_kwargs(row, device, backend=backend), logits_to_keep=keep)
    out = packed_row_loss(
        outputs.logits,
        row,
        config=loss_config,
        num_trained_tokens=max(float(global_trained_tokens), 1.0),
        logit_rows=logit_rows,
        lm_head_weight=used.weight,
    )
    return out.loss * num_processes, out.loss.detach(), used.name


def head_summary(heads: list[str | None]) -> str:
    """One label for the heads several rows ran (None: an empty row, no head): ``fused``, ``model``,
    ``mixed`` or ``none``."""
    ran = {h for h in heads if h is not None}
    return ran.pop() if len(ran) == 1 else ("mixed" if ran else "none")


def single_device_step(
    model: torch.nn.Module,
    step: StepData,
    device: torch.device,
    loss_config: LossConfig,
    backend: str,
    head: str,
) -> tuple[torch.Tensor, str]:
    """Forward + backward of every row of ``step`` on one device, gradients accumulated.

    Each row's loss is divided by the micro-batch's trained tokens, so the accumulated gradient is
    the spec's sum over the whole step. Returns the summed loss (detached) and the head used
    (:func:`head_summary` of the rows').
    """
    total = torch.zeros((), device=device)
    heads: list[str | None] = []
    for row in step.rows:
        if row is None:
            continue
        loss, value, used = row_loss(
            model,
            row,
            global_trained_tokens=step.global_trained_tokens,
            num_processes=1,
            device=device,
            loss_config=loss_config,
            backend=backend,
            head=head,
        )
        loss.backward()
        total = total + value
        heads.append(used)
    return total, head_summary(heads)


def fsdp_step(
    accelerator: Accelerator,
    model: torch.nn.Module,
    step: StepData,
    loss_config: LossConfig,
    backend: str,
    head: str,
) -> tuple[torch.Tensor, str | None]:
    """This rank's row of ``step`` forward + backward through the FSDP2 model (a dummy forward when the
    row is empty). Returns this rank's unscaled loss (detached) and the head used (None: empty row)."""
    device = compute_device(accelerator)
    row = step.rows[accelerator.process_index]
    if row is None:
        accelerator.backward(empty_row_loss(model, device))
        return torch.zeros((), device=device), None
    loss, value, used = row_loss(
        model,
        row,
        global_trained_tokens=step.global_trained_tokens,
        num_processes=accelerator.num_processes,
        device=device,
        loss_config=loss_config,
        backend=backend,
        head=head,
    )
    accelerator.backward(loss)
    return value, used


# ------------------------------------------------------------------------------ distribution
def make_accelerator(device_type: str, pg_timeout_s: float, allow_one_process: bool = False) -> Accelerator:
    """An accelerate ``Accelerator`` with FSDP2 (one shard group per decoder layer, accelerate's
    embedding/head group and the root), the process group created with a ``pg_timeout_s`` timeout."""
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",  # classes from the model's _no_split_modules
        reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
        state_dict_type="SHARDED_STATE_DICT",
        activation_checkpointing=False,  # the model's own gradient checkpointing, as the trainer does
    )
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if device_type == "cpu":
        pg = InitProcessGroupKwargs(backend="gloo", timeout=timeout)
        accelerator = Accelerator(cpu=True, mixed_precision="no", fsdp_plugin=plugin, kwargs_handlers=[pg])
        # accelerate only selects FSDP for accelerator devices (MULTI_CPU would wrap in DDP);
        # fully_shard runs on a CPU mesh over gloo, so take accelerate's FSDP2 path explicitly.
        # Both singletons, as accelerate does itself on GPUs: every AcceleratorState() built later
        # (prepare builds some) copies PartialState's distributed_type over its own.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    else:
        pg = InitProcessGroupKwargs(backend="nccl", timeout=timeout)
        accelerator = Accelerator(mixed_precision="no", fsdp_plugin=plugin, kwargs_handlers=[pg])
    if accelerator.num_processes < 2 and not allow_one_process:
        raise SystemExit(
            "bench.fsdp needs >= 2 processes: python3 -m torch.distributed.run --nproc_per_node 2 ..."
        )
    if not accelerator.is_fsdp2:
        raise RuntimeError(
            f"accelerate did not select FSDP2 (distributed_type={accelerator.distributed_type})"
        )
    return accelerator


def same_on_all_ranks(steps: list[StepData]) -> None:
    """Raise unless every rank built the same micro-batches (the trainer broadcasts rank 0's; here
    every rank draws them from the same seed)."""
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, fingerprint(steps))
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks built different micro-batches: {digests}")


@torch.no_grad()
def same_weights_on_all_ranks(model: torch.nn.Module, device: torch.device) -> None:
    """Raise unless every rank initialised the same weights (FSDP2 keeps each rank's own shard of
    its own copy, so different seeds would silently mix two models). Compares float64 sums and
    sums of squares of every parameter."""
    sums = [float(p.double().sum()) for p in model.parameters()]
    squares = [float(p.double().square().sum()) for p in model.parameters()]
    ranks = gather_floats(sums + squares, device)
    if any(r != ranks[0] for r in ranks[1:]):
        raise RuntimeError("ranks built different initial weights")


def compute_device(accelerator: Accelerator) -> torch.device:
    """The device this rank computes on (accelerate names the CPU ``cpu:<n>``; tensors use ``cpu``)."""
    device = accelerator.device
    return torch.device("cpu") if device.type == "cpu" else device


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (same length on all ranks), indexed by rank."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return [p.tolist() for p in parts]


def all_ranks(flag: bool, device: torch.device) -> bool:
    """True iff ``flag`` holds on every rank (a collective: every rank must call it)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() > 0)


def release(accelerator: Accelerator, device: torch.device) -> None:
    """Drop accelerate's references to prepared models/optimizers and free the device cache."""
    accelerator.free_memory()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- correctness
def gradient_copies(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of every parameter's gradient (full tensors), by parameter name."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            raise RuntimeError(f"{name}: no gradient after the single-device step")
        grads[name] = param.grad.detach().float().clone()
    return grads


def gradient_diff(name: str, grad: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """``{"name", "numel", "ref_norm", "max_abs_diff", "rel_norm_diff"}`` of one parameter's gradient
    against its reference (``rel_norm_diff`` = ``||grad - ref|| / ||ref||``, fp32)."""
    diff = grad.detach().float() - ref
    ref_norm = float(ref.norm())
    return {
        "name": name,
        "numel": ref.numel(),
        "ref_norm": ref_norm,
        "max_abs_diff": float(diff.abs().max()),
        "rel_norm_diff": float(diff.norm()) / max(ref_norm, 1e-30),
    }


def compare_gradients(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per parameter: the FSDP2 gradient, gathered, against the single-device one (:func:`gradient_diff`).

    ``full_tensor()`` is a collective; every rank walks the parameters in the same order.
    """
    out = []
    for name, param in model.named_parameters():
        if param.grad is None:
            raise RuntimeError(f"{name}: no gradient after the FSDP2 step")
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        out.append(gradient_diff(name, grad, reference[name]))
    return out


def gathered_heads(head: str | None) -> list[str | None]:
    """Every rank's head (None: an empty row), indexed by rank (a collective)."""
    heads: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(heads, head)
    return heads


def check_case(
    accelerator: Accelerator, name: str, step: StepData, args: argparse.Namespace, loss_config: LossConfig
) -> dict[str, Any]:
    """One correctness case: the single-device step vs the FSDP2 step, fp32, same weights and rows."""
    device = compute_device(accelerator)
    started = time.perf_counter()
    model = build_model(args.check_shape, device).float()  # same seed on every rank: same weights
    use_tree_attention(model)
    same_weights_on_all_ranks(model, device)
    reference_model = copy.deepcopy(model)
    # Single device: the whole micro-batch on this rank's device, no process group involved, with
    # the model's own head: the reference for the trainer's FSDP2 step, sharded and (``--head fused``)
    # with the head fused with the loss.
    ref_loss, ref_head = single_device_step(
        reference_model, step, device, loss_config, args.check_backend, "model"
    )
    reference = gradient_copies(reference_model)
    del reference_model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # accelerate's FSDP2 prepare wants one
    model, optimizer = accelerator.prepare(model, optimizer)
    prime_fused_head(model, device)  # every rank: the step's forward may then fuse the head
    local_loss, head = fsdp_step(accelerator, model, step, loss_config, args.check_backend, args.head)
    heads = gathered_heads(head)
    total = local_loss.detach().clone()
    dist.all_reduce(total)
    params = compare_gradients(model, reference)
    del model, optimizer, reference
    release(accelerator, device)
    fsdp_loss, ref = float(total), float(ref_loss)
    worst = max(params, key=lambda p: p["rel_norm_diff"])
    loss_rel = abs(fsdp_loss - ref) / max(abs(ref), 1e-30)
    grad_ok = all(p["rel_norm_diff"] <= args.grad_rtol for p in params)
    loss_ok = loss_rel <= args.loss_rtol or abs(fsdp_loss - ref) <= 1e-9
    return {
        "case": name,
        "shape": args.check_shape,
        "dtype": "float32",
        "tree_backend": args.check_backend,
        "rows": [
            None if r is None else {"tokens": r.num_tokens, "trained_tokens": r.num_trained_tokens}
            for r in step.rows
        ],
        "global_trained_tokens": step.global_trained_tokens,
        "batch/row_imbalance": step.logged.get("batch/row_imbalance"),
        "lm_head": {"single_device": ref_head, "fsdp2": heads},  # fsdp2: per rank, None = empty row
        "loss_fsdp_sum_over_ranks": fsdp_loss,
        "loss_single_device": ref,
        "loss_abs_diff": abs(fsdp_loss - ref),
        "loss_rel_diff": loss_rel,
        "grad_max_abs_diff": max(p["max_abs_diff"] for p in params),
        "grad_max_rel_norm_diff": worst["rel_norm_diff"],
        "grad_worst_param": worst["name"],
        "grad_rtol": args.grad_rtol,
        "loss_rtol": args.loss_rtol,
        "passed": grad_ok and loss_ok,
        "wall_s": time.perf_counter() - started,
        "params": params,
    }


def comparison(
    name: str, loss: float, ref_loss: float, params: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """A loss and its per-parameter gradient diffs (:func:`gradient_diff`) against a reference,
    judged with ``--loss-rtol`` / ``--grad-rtol``."""
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    worst = max(params, key=lambda p: p["rel_norm_diff"])
    passed = loss_rel <= args.loss_rtol and all(p["rel_norm_diff"] <= args.grad_rtol for p in params)
    return {
        "comparison": name,
        "loss": loss,
        "loss_reference": ref_loss,
        "loss_rel_diff": loss_rel,
        "grad_max_rel_norm_diff": worst["rel_norm_diff"],
        "grad_worst_param": worst["name"],
        "grad_max_abs_diff": max(p["max_abs_diff"] for p in params),
        "passed": passed,
        "params": params,
    }


def fused_head_check(
    accelerator: Accelerator, args: argparse.Namespace, loss_config: LossConfig, workload: Workload
) -> dict[str, Any]:
    """One process: the FSDP2-wrapped model's step with the fused head against the same model
    unwrapped, with the fused head and with the model's own head.

    Same weights (``--check-shape`` in ``--check-dtype``) and one row of ``--check-token-budget``.
    Compares the losses and every parameter's gradient (tied embedding included): ``fsdp2_fused``
    vs ``unwrapped_fused`` (the same arithmetic: only FSDP2's gather and reduce-scatter differ),
    ``fsdp2_fused`` vs ``unwrapped_model`` (the reference), and ``unwrapped_fused`` vs
    ``unwrapped_model`` (the fused head alone).
    """
    if accelerator.num_processes != 1:
        raise SystemExit("--check-fused-head runs on one process: --nproc_per_node 1")
    device = compute_device(accelerator)
    started = time.perf_counter()
    budget = args.check_token_budget
    vocab = SHAPES[args.check_shape]["vocab_size"]
    step = step_data(stream_micro_batches(workload, vocab, budget, 1, 1, args.seed)[0], budget)
    model = build_model(args.check_shape, device).to(getattr(torch, args.check_dtype))
    use_tree_attention(model)
    unwrapped = copy.deepcopy(model)
    losses: dict[str, float] = {}
    heads: dict[str, str | None] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for head in ("fused", "model"):
        loss, heads[f"unwrapped_{head}"] = single_device_step(
            unwrapped, step, device, loss_config, args.check_backend, head
        )
        losses[f"unwrapped_{head}"] = float(loss)
        grads[head] = gradient_copies(unwrapped)
        unwrapped.zero_grad(set_to_none=True)
    del unwrapped
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # accelerate's FSDP2 prepare wants one
    model, optimizer = accelerator.prepare(model, optimizer)
    prime_fused_head(model, device)
    loss, heads["fsdp2_fused"] = fsdp_step(accelerator, model, step, loss_config, args.check_backend, "fused")
    losses["fsdp2_fused"] = float(loss)
    comparisons = [
        comparison(
            f"fsdp2_fused_vs_unwrapped_{head}",
            losses["fsdp2_fused"],
            losses[f"unwrapped_{head}"],
            compare_gradients(model, grads[head]),
            args,
        )
        for head in ("fused", "model")
    ]
    fused_alone = [gradient_diff(name, g, grads["model"][name]) for name, g in grads["fused"].items()]
    comparisons.append(
        comparison(
            "unwrapped_fused_vs_unwrapped_model",
            losses["unwrapped_fused"],
            losses["unwrapped_model"],
            fused_alone,
            args,
        )
    )
    del model, optimizer, grads
    release(accelerator, device)
    row = step.rows[0]
    return {
        "shape": args.check_shape,
        "dtype": args.check_dtype,
        "tree_backend": args.check_backend,
        "world_size": accelerator.num_processes,
        "row": {"tokens": row.num_tokens, "trained_tokens": row.num_trained_tokens},
        "lm_head": heads,
        "loss": losses,
        "grad_rtol": args.grad_rtol,
        "loss_rtol": args.loss_rtol,
        # the fused head really ran under FSDP2, and every comparison is within tolerance
        "passed": heads["fsdp2_fused"] == "fused"
        and heads["unwrapped_fused"] == "fused"
        and all(c["passed"] for c in comparisons),
        "comparisons": comparisons,
        "wall_s": time.perf_counter() - started,
    }


# ---------------------------------------------------------------------------------- throughput
def throughput_dtype(device: torch.device) -> torch.dtype:
    """bf16 weights on GPUs (as :mod:`bench.packing`); fp32 on CPU, where bf16 matmuls are emulated
    and the run is only a smoke test of the code path."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def step_flops(config, rows: list[PackedRow | None]) -> float | None:
    """Training FLOPs (fwd + bwd, trainer.reporting.perf's estimate) of ``rows``; None when not estimable."""
    total = 0.0
    for row in rows:
        if row is None:
            continue
        flops = training_flops(config, row.num_tokens, float(row.stats.attention_cost))
        if not flops:
            return None
        total += flops
    return total


def time_config(
    run_step: Callable[[StepData], tuple[torch.Tensor, str | None]],
    optimizer: torch.optim.Optimizer,
    steps: list[StepData],
    device: torch.device,
) -> tuple[dict[str, Any], list[float], str]:
    """Each of ``steps`` once untimed (compiles every length bucket) then once timed, with
    :func:`bench.packing.time_steps`. Returns its timings, every step's loss (untimed pass first)
    and the head the timed steps used (:func:`head_summary`)."""
    order = itertools.cycle(steps)
    losses: list[torch.Tensor] = []
    heads: list[str | None] = []

    def step() -> None:
        loss, head = run_step(next(order))
        losses.append(loss)
        heads.append(head)

    timing = time_steps(step, optimizer, device, warmup=len(steps), steps=len(steps))
    return timing, [float(v) for v in losses], head_summary(heads[len(steps) :])


def throughput_record(
    *,
    shape: str,
    gpus: int,
    mode: str,
    steps: list[StepData],
    fwd_bwd: list[float],
    opt: list[float],
    config,
    device: torch.device,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Per-step and median trained tokens/s of one (shape, device count) from per-step seconds."""
    trained = [s.global_trained_tokens for s in steps]
    tps = [t / f for t, f in zip(trained, fwd_bwd, strict=True)]
    tps_opt = [t / (f + o) for t, f, o in zip(trained, fwd_bwd, opt, strict=True)]
    peak = peak_flops(device, "bf16")
    flops = [step_flops(config, s.rows) for s in steps]
    mfu = [f / (t * peak * gpus) if f and peak else None for f, t in zip(flops, fwd_bwd, strict=True)]
    return {
        "shape": shape,
        "gpus": gpus,
        "mode": mode,
        "dtype": str(throughput_dtype(device)).removeprefix("torch."),
        "trained_tokens_per_step": trained,
        "forwarded_tokens_per_step": [s.forwarded_tokens for s in steps],
        "fwd_bwd_s": fwd_bwd,
        "optimizer_s": opt,
        "trained_tokens_per_s": _median(tps),
        "trained_tokens_per_s_with_optimizer": _median(tps_opt),
        "trained_tokens_per_s_all": tps,
        "fwd_bwd_mfu": _median(mfu) if all(m is not None for m in mfu) else None,
        **extra,
    }


def _time_single_device(
    shape: str, steps: list[StepData], device: torch.device, loss_config: LossConfig, backend: str, head: str
) -> tuple[dict[str, Any], list[float], str, float | None, Any]:
    """Build the bf16 model on ``device`` alone and time ``steps`` on it (every row per step).
    Returns ``(timing, losses, head used, peak memory GiB or None, model config)``."""
    model = build_model(shape, device).to(throughput_dtype(device))
    use_tree_attention(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # the trainer's adamw_torch_fused
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = functools.partial(
        single_device_step, model, device=device, loss_config=loss_config, backend=backend, head=head
    )
    timing, losses, used = time_config(run, optimizer, steps, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return timing, losses, used, peak, model.config


def single_device_throughput(
    accelerator: Accelerator,
    shape: str,
    steps: list[StepData],
    loss_config: LossConfig,
    backend: str,
    head: str,
) -> dict[str, Any]:
    """The one-device baseline, run by every rank on its own device at once (no collective inside);
    rank 0's numbers are the record, the others' kept (``rank_fwd_bwd_s``) for comparison.
    Raises ``RuntimeError`` on every rank if it failed on any."""
    device = compute_device(accelerator)
    started = time.perf_counter()
    error = None
    try:
        timing, losses, used, peak_gib, config = _time_single_device(
            shape, steps, device, loss_config, backend, head
        )
    except Exception as exc:  # no collective inside: agree below and let the caller fall back
        error = f"{exc!r}\n{traceback.format_exc()[-1500:]}"
        print(
            f"[rank {accelerator.process_index}] single-device {shape} {backend}/{head} FAILED: {error}",
            flush=True,
        )
    release(accelerator, device)
    if not all_ranks(error is None, device):
        raise RuntimeError(error or "failed on another rank")
    fwd = gather_floats(timing["fwd_bwd_s"], device)
    opt = gather_floats(timing["optimizer_s"], device)
    first_loss = gather_floats(losses[:1], device)
    return throughput_record(
        shape=shape,
        gpus=1,
        mode="single_device",
        steps=steps,
        fwd_bwd=fwd[0],
        opt=opt[0],
        config=config,
        device=device,
        extra={
            "tree_backend": backend,
            "lm_head": used,
            "rank_fwd_bwd_s": fwd,
            "first_step_loss": first_loss[0][0],
            "peak_memory_gib": peak_gib,
            "compiles_during_timing": timing["compiles_during_timing"],
            "config_wall_s": time.perf_counter() - started,
        },
    )


def fsdp_throughput(
    accelerator: Accelerator,
    shape: str,
    steps: list[StepData],
    loss_config: LossConfig,
    backend: str,
    head: str,
) -> dict[str, Any]:
    """FSDP2 over all ranks: each rank its row per step; a step's time is the slowest rank's."""
    device = compute_device(accelerator)
    started = time.perf_counter()
    model = build_model(shape, device).to(throughput_dtype(device))
    use_tree_attention(model)
    same_weights_on_all_ranks(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # the trainer's adamw_torch_fused
    model, optimizer = accelerator.prepare(model, optimizer)
    prime_fused_head(model, device)  # the trainer's first step runs the model's head instead
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = functools.partial(
        fsdp_step, accelerator, model, loss_config=loss_config, backend=backend, head=head
    )
    timing, losses, used = time_config(run, optimizer, steps, device)
    used = head_summary(gathered_heads(used))  # the same label on every rank
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else -1.0
    config = model.config
    del model, optimizer, run
    release(accelerator, device)
    fwd = gather_floats(timing["fwd_bwd_s"], device)
    opt = gather_floats(timing["optimizer_s"], device)
    first_loss = gather_floats(losses[:1], device)
    peaks = gather_floats([peak], device)
    n = accelerator.num_processes
    return throughput_record(
        shape=shape,
        gpus=n,
        mode="fsdp2",
        steps=steps,
        fwd_bwd=[max(r[i] for r in fwd) for i in range(len(steps))],
        opt=[max(r[i] for r in opt) for i in range(len(steps))],
        config=config,
        device=device,
        extra={
            "tree_backend": backend,
            "lm_head": used,
            "rank_fwd_bwd_s": fwd,
            "first_step_loss": sum(r[0] for r in first_loss),  # the rows' losses summed over ranks
            "peak_memory_gib": [p[0] if p[0] >= 0 else None for p in peaks],
            "compiles_during_timing": timing["compiles_during_timing"],
            "config_wall_s": time.perf_counter() - started,
        },
    )


def scaling_entry(shape: str, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``tokens/s on N devices / tokens/s on one`` for ``shape`` (medians), if both were measured."""
    mine = [r for r in results if r["shape"] == shape]
    multi = next((r for r in mine if r["mode"] == "fsdp2"), None)
    singles = [r for r in mine if r["mode"] == "single_device"]
    if multi is None or not singles:
        return None
    base = singles[0]
    same = next((r for r in singles if r["lm_head"] == multi["lm_head"]), None)
    entry = {
        "shape": shape,
        "gpus": multi["gpus"],
        "single_device_tokens_per_s": base["trained_tokens_per_s"],
        "single_device_lm_head": base["lm_head"],
        "fsdp2_tokens_per_s": multi["trained_tokens_per_s"],
        "fsdp2_lm_head": multi["lm_head"],
        "scaling": multi["trained_tokens_per_s"] / base["trained_tokens_per_s"],
        "scaling_with_optimizer": multi["trained_tokens_per_s_with_optimizer"]
        / base["trained_tokens_per_s_with_optimizer"],
        "scaling_same_head": multi["trained_tokens_per_s"] / same["trained_tokens_per_s"] if same else None,
        "first_step_loss_single_device": base["first_step_loss"],
        "first_step_loss_fsdp2": multi["first_step_loss"],
        # bf16 and (on CUDA) FlexAttention on both sides: a sanity check, not the fp32 tolerance test
        "first_step_loss_rel_diff": abs(multi["first_step_loss"] - base["first_step_loss"])
        / max(abs(base["first_step_loss"]), 1e-30),
    }
    entry["efficiency"] = entry["scaling"] / multi["gpus"]
    return entry


# -------------------------------------------------------------------------------------- report
def environment(accelerator: Accelerator, args: argparse.Namespace) -> dict[str, Any]:
    """Versions, devices and the launch, for the JSON's ``meta``."""
    device = compute_device(accelerator)
    cuda = device.type == "cuda"
    n = accelerator.num_processes
    meta = {
        "command": " ".join(
            [
                "python3 -m torch.distributed.run --standalone",
                f"--nproc_per_node {n}",
                "-m bench.fsdp",
                *sys.argv[1:],
            ]
        ),
        "world_size": n,
        "process_group_backend": dist.get_backend(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "peer_access_0_1": torch.cuda.can_device_access_peer(0, 1)
        if cuda and torch.cuda.device_count() > 1
        else None,
        "fsdp": "FSDP2 via accelerate.prepare: fully_shard per _no_split_modules layer (Qwen3DecoderLayer), "
        "accelerate's embedding/norm/head group, root; reshard_after_forward=True; mixed_precision='no'",
        "distributed_type_forced": device.type == "cpu",
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    meta["args"] = {k: _json_safe(v) for k, v in vars(args).items()}
    return meta


def _json_safe(value: Any) -> Any:
    """Paths as strings, infinities as None (strict JSON has no Infinity)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def fused_head_table(check: dict[str, Any]) -> str:
    """The one-process fused-head check (:func:`fused_head_check`) as a short Markdown table."""
    lines = [f"fused head under FSDP2, {check['shape']} {check['dtype']}, heads {check['lm_head']}:", ""]
    lines.append("| comparison | loss rel diff | max grad rel-norm diff | max abs diff | ok |")
    lines.append("|---|---|---|---|---|")
    for c in check["comparisons"]:
        lines.append(
            f"| {c['comparison']} | {c['loss_rel_diff']:.2e} | {c['grad_max_rel_norm_diff']:.2e} "
            f"({c['grad_worst_param']}) | {c['grad_max_abs_diff']:.2e} | {'yes' if c['passed'] else 'NO'} |"
        )
    return "\n".join(lines)


def summary_table(report: dict[str, Any]) -> str:
    """Correctness, row imbalance and throughput as short Markdown tables."""
    if "fused_head_check" in report:
        return fused_head_table(report["fused_head_check"])
    lines = ["| check | rows (tokens) | loss FSDP2 / 1 device | max grad rel-norm diff | max abs diff | ok |"]
    lines.append("|---|---|---|---|---|---|")
    for c in report["correctness"]:
        rows = " / ".join("empty" if r is None else str(r["tokens"]) for r in c["rows"])
        lines.append(
            f"| {c['case']} | {rows} | {c['loss_fsdp_sum_over_ranks']:.6g} / {c['loss_single_device']:.6g} "
            f"| {c['grad_max_rel_norm_diff']:.2e} ({c['grad_worst_param']}) | {c['grad_max_abs_diff']:.2e} "
            f"| {'yes' if c['passed'] else 'NO'} |"
        )
    imbalance = [s.get("batch/row_imbalance") for s in report["steps"]]
    lines.append("")
    lines.append("batch/row_imbalance per step: " + ", ".join(_fmt(v, ".3f") for v in imbalance))
    lines.append("")
    lines.append("| shape | GPUs | mode | head | backend | ktok/s | ktok/s +opt | step s | MFU | peak GiB |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["throughput"]:
        peak = r["peak_memory_gib"]
        peak = max((p for p in peak if p is not None), default=None) if isinstance(peak, list) else peak
        lines.append(
            f"| {r['shape']} | {r['gpus']} | {r['mode']} | {r['lm_head']} | {r['tree_backend']} "
            f"| {r['trained_tokens_per_s'] / 1e3:.2f} | {r['trained_tokens_per_s_with_optimizer'] / 1e3:.2f} "
            f"| {_median(r['fwd_bwd_s']):.3f} | {_fmt(r['fwd_bwd_mfu'], '.3f')} | {_fmt(peak, '.1f')} |"
        )
    for s in report["scaling"]:
        lines.append(
            f"\n{s['shape']}: scaling x{s['scaling']:.2f} on {s['gpus']} GPUs (efficiency {s['efficiency']:.0%}; "
            f"with optimizer x{s['scaling_with_optimizer']:.2f}; same head x{_fmt(s['scaling_same_head'], '.2f')})"
        )
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path, is_main: bool) -> None:
    if is_main:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))


# -------------------------------------------------------------------------------------- driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file for the results")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model, lengths / 16, budget 1024 (CPU smoke)"
    )
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b", help="throughput shapes (bench.packing)")
    parser.add_argument("--workload", default="3.4", choices=sorted(WORKLOADS), help="bench.packing workload")
    parser.add_argument("--token-budget", type=int, default=16384, help="unique tokens per row")
    parser.add_argument(
        "--steps", type=int, default=4, help="distinct micro-batches: one untimed pass, one timed"
    )
    parser.add_argument(
        "--backend", default="auto", help="tree attention backend for throughput: auto, flex, sdpa"
    )
    parser.add_argument("--fallback-backend", default="sdpa", help="retried if --backend fails ('' = none)")
    parser.add_argument(
        "--head",
        choices=("fused", "model"),
        default="fused",
        help="fused: the trainer's choice (fused with the loss where allowed); model: the model's own head",
    )
    parser.add_argument("--check-shape", default="qwen3-0.6b", help="shape of the fp32 correctness check")
    parser.add_argument("--check-token-budget", type=int, default=4096, help="row budget of the check")
    parser.add_argument(
        "--check-backend",
        default="sdpa",
        help="tree attention backend of the check (sdpa: exact, no fp32 FlexAttention compile)",
    )
    parser.add_argument(
        "--grad-rtol", type=float, default=1e-4, help="max ||g_fsdp - g_1|| / ||g_1|| per param"
    )
    parser.add_argument("--loss-rtol", type=float, default=1e-5)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument(
        "--check-fused-head",
        action="store_true",
        help="only this check, on one process: the FSDP2 step with the fused head against the unwrapped "
        "model (fused and model head); --check-shape, --check-dtype, tolerances --loss-rtol/--grad-rtol",
    )
    parser.add_argument("--check-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--allow-one-process",
        action="store_true",
        help="smoke-run the CUDA path on one GPU (FSDP2 over one rank; the scaling is then meaningless)",
    )
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--pg-timeout", type=float, default=300.0, help="process-group timeout, seconds")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=float("inf"),
        help="start no throughput config after this many seconds",
    )
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shapes = "tiny"
        args.check_shape = "tiny"
        args.token_budget = min(args.token_budget, 1024)
        args.check_token_budget = min(args.check_token_budget, 1024)
    return args


def run(args: argparse.Namespace, accelerator: Accelerator, report: dict[str, Any]) -> int:
    """All phases; returns the exit status (0, or 2 when a check is out of tolerance)."""
    started = time.perf_counter()
    device = compute_device(accelerator)
    is_main = accelerator.is_main_process
    n = accelerator.num_processes
    loss_config = LossConfig()
    workload = WORKLOADS[args.workload].scaled(16) if args.tiny else WORKLOADS[args.workload]

    def say(text: str) -> None:
        if is_main:
            print(f"[{time.perf_counter() - started:6.1f}s] {text}", flush=True)

    if args.check_fused_head:
        result = fused_head_check(accelerator, args, loss_config, workload)
        report["fused_head_check"] = result
        write(report, args.out, is_main)
        for c in result["comparisons"]:
            say(
                f"{c['comparison']}: loss rel {c['loss_rel_diff']:.1e}, grad max rel-norm diff "
                f"{c['grad_max_rel_norm_diff']:.2e} ({c['grad_worst_param']}) -> {'ok' if c['passed'] else 'OUT'}"
            )
        say(f"heads {result['lm_head']}: {'passed' if result['passed'] else 'FAILED'}")
        return 0 if result["passed"] else 2

    # ---- correctness (fp32)
    status = 0
    if not args.skip_check:
        vocab = SHAPES[args.check_shape]["vocab_size"]
        budget = args.check_token_budget
        full = stream_micro_batches(workload, vocab, budget, n, 1, args.seed)[0]
        cases = {
            "full": step_data(full, budget),
            # the throughput budget: one whole group must fit one row
        }
        if n > 1:  # one process never gets an empty row
            cases["empty_row"] = step_data(
                starved_micro_batch(workload, vocab, args.token_budget, n, args.seed + 7), args.token_budget
            )
        same_on_all_ranks(list(cases.values()))
        for name, step in cases.items():
            result = check_case(accelerator, name, step, args, loss_config)
            report["correctness"].append(result)
            write(report, args.out, is_main)
            say(
                f"check {name}: loss {result['loss_fsdp_sum_over_ranks']:.6g} vs {result['loss_single_device']:.6g} "
                f"(rel {result['loss_rel_diff']:.1e}), grad max rel-norm diff {result['grad_max_rel_norm_diff']:.2e} "
                f"({result['grad_worst_param']}), max abs {result['grad_max_abs_diff']:.2e} "
                f"-> {'ok' if result['passed'] else 'OUT OF TOLERANCE'}"
            )
            if not result["passed"]:
                status = 2

    # ---- throughput (bf16): the same micro-batches for every shape of one vocabulary
    if args.skip_throughput:
        return status
    shapes = [s for s in args.shapes.split(",") if s]
    prepared: dict[int, list[StepData]] = {}
    backends = [args.backend] + (
        [args.fallback_backend] if args.fallback_backend not in ("", args.backend) else []
    )
    for shape in shapes:
        vocab = SHAPES[shape]["vocab_size"]
        if vocab not in prepared:
            batches = stream_micro_batches(workload, vocab, args.token_budget, n, args.steps, args.seed)
            steps = [step_data(b, args.token_budget) for b in batches]
            same_on_all_ranks(steps)
            prepared[vocab] = steps
            if not report["steps"]:
                for i, s in enumerate(steps):
                    report["steps"].append(
                        {
                            "step": i,
                            **s.logged,
                            "rows": [None if r is None else vars(r.stats) for r in s.rows],
                        }
                    )
                    say(
                        f"step {i}: batch/row_imbalance {s.logged.get('batch/row_imbalance', float('nan')):.3f} "
                        f"rows {[0 if r is None else r.num_tokens for r in s.rows]} tokens, "
                        f"packing ratio {s.logged['batch/packing_ratio']:.2f}"
                    )
        steps = prepared[vocab]
        over = time.perf_counter() - started > args.time_budget
        if not all_ranks(not over, device):  # every rank takes the same decision
            report["skipped"].append({"shape": shape, "why": "time budget"})
            say(f"{shape}: skipped (time budget)")
            continue
        backend = None
        for candidate in backends:
            try:
                record = single_device_throughput(
                    accelerator, shape, steps, loss_config, candidate, args.head
                )
            except RuntimeError as exc:
                report["errors"].append(
                    {"shape": shape, "mode": "single_device", "backend": candidate, "error": str(exc)}
                )
                write(report, args.out, is_main)
                continue
            backend = candidate
            report["throughput"].append(record)
            say(
                f"{shape} 1 device ({record['lm_head']} head, {candidate}): {record['trained_tokens_per_s']:.0f} tok/s"
            )
            break
        if backend is None:
            say(f"{shape}: single-device baseline failed with every backend; FSDP2 run skipped")
            continue
        single_head = report["throughput"][-1]["lm_head"]
        write(report, args.out, is_main)
        try:
            record = fsdp_throughput(accelerator, shape, steps, loss_config, backend, args.head)
        except Exception as exc:
            report["errors"].append({"shape": shape, "mode": "fsdp2", "backend": backend, "error": repr(exc)})
            write(report, args.out, is_main)
            raise
        report["throughput"].append(record)
        fsdp_head = record["lm_head"]  # the same on every rank (gathered)
        if fsdp_head != single_head and fsdp_head in ("fused", "model"):  # the same work on one device
            try:
                same = single_device_throughput(accelerator, shape, steps, loss_config, backend, fsdp_head)
            except RuntimeError as exc:
                report["errors"].append(
                    {"shape": shape, "mode": "single_device", "lm_head": fsdp_head, "error": str(exc)}
                )
            else:
                report["throughput"].append(same)
                say(
                    f"{shape} 1 device ({fsdp_head} head, {backend}): {same['trained_tokens_per_s']:.0f} tok/s"
                )
        entry = scaling_entry(shape, report["throughput"])
        if entry:
            report["scaling"].append(entry)
        say(
            f"{shape} {n} devices FSDP2 ({record['lm_head']} head): {record['trained_tokens_per_s']:.0f} tok/s"
            + (f", scaling x{entry['scaling']:.2f}" if entry else "")
        )
        report["meta"]["elapsed_s"] = time.perf_counter() - started
        write(report, args.out, is_main)
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu for the smoke run)")
    accelerator = make_accelerator(
        args.device, args.pg_timeout, args.allow_one_process or args.check_fused_head
    )
    if args.device == "cuda":  # the fp32 check: true fp32 matmuls on both sides (bf16 is unaffected)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    report: dict[str, Any] = {
        "meta": environment(accelerator, args),
        "correctness": [],
        "steps": [],
        "throughput": [],
        "scaling": [],
        "skipped": [],
        "errors": [],
    }
    started = time.perf_counter()
    try:
        status = run(args, accelerator, report)
    except BaseException as exc:
        report["errors"].append(
            {"rank": accelerator.process_index, "error": repr(exc), "trace": traceback.format_exc()}
        )
        report["meta"]["elapsed_s"] = time.perf_counter() - started
        write(report, args.out, accelerator.is_main_process)
        print(
            f"[rank {accelerator.process_index}] FAILED: {exc!r}\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)  # no destroy_process_group: a peer may be stuck in a collective
    report["meta"]["elapsed_s"] = time.perf_counter() - started
    write(report, args.out, accelerator.is_main_process)
    if accelerator.is_main_process:
        print(summary_table(report), flush=True)
    all_ranks(True, compute_device(accelerator))  # a barrier: nobody tears the group down early
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The JSON is written and the process group destroyed: skip the interpreter's slow teardown of
    # torch/transformers (seconds per process on a busy CPU).
    os._exit(code)
