"""The LM head fused with the loss's reads: log-probabilities straight from the last hidden state.

The unfused path materialises the (N, V) logits of the N trained positions, then makes several
vocabulary-wide passes over them (fp32 copy, log-sum-exp, entropy, the gathers' scatter-backward,
the log-sum-exp's recompute in the backward). At V = 151936 that is gigabytes of memory traffic per
row, and it is what keeps tree packing's speed-up below its packing ratio on a GPU (each trained
position costs about a third of a forwarded token; ``docs/benchmarks.md``).

Here the head runs in row chunks of about ``_CHUNK_BYTES`` of logits. The forward keeps, per row,
only the tempered log-sum-exp, the entropy and the few logits the loss reads ("picks": the trained
token, the sampler's top ids, top-k/top-p candidates); the backward recomputes the logits in
vocabulary chunks of about the same size (all rows, a slice of the vocabulary), turns each into the
logits' gradient in one fused pass (``torch.compile`` on CUDA), then runs the two GEMMs: the weight
gradient's slice for that chunk, written in place, and the hidden-state gradient, accumulated in
fp32. No (N, V) tensor outlives its chunk, and no (V, D) tensor besides the gradient itself.

The trainer reaches the hidden states by making the model's output embedding an identity for the
forward (:func:`lm_head_bypassed`). That is only right when the model does nothing to the logits
after its ``lm_head`` (no soft-capping, no logit scale), so :func:`fused_head_weight` checks it once
per model on a short input (the two forwards must agree) and otherwise leaves the unfused path on.

Under FSDP2 (:func:`fused_lm_head`) the head's weight is a shard outside the forward. The fused path
takes the unsharded parameter FSDP2 gathered for the forward, after the forward: no extra
collective and no extra copy. The probe is replaced by watching one ordinary forward, because a
probe forward is a collective that a rank with an empty row would not join.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CHUNK_SETTING = "GRPO_FUSED_HEAD_CHUNK_MIB"


def chunk_bytes_setting(environ=os.environ) -> int:
    """Bytes of logits (in the head's dtype) materialised at once, from ``GRPO_FUSED_HEAD_CHUNK_MIB``
    (MiB, default 1024). The backward holds a chunk's logits and their gradient at once: smaller
    chunks lower the step's peak memory, at more (smaller) GEMMs."""
    raw = environ.get(_CHUNK_SETTING, "1024")
    try:
        mib = int(raw)
    except ValueError:
        mib = 0
    if mib < 1:
        raise ValueError(f"{_CHUNK_SETTING}={raw!r}: expected a whole number of MiB >= 1 (default 1024)")
    return mib << 20


# Read once at import, like the other GRPO_* settings of a trainer process.
_CHUNK_BYTES = chunk_bytes_setting()
# GRPO_FUSED_LM_HEAD=0 turns the fused path off (the unfused one is the reference).
_ENV_SWITCH = "GRPO_FUSED_LM_HEAD"
# Cached on the model: the probe's verdict, and under FSDP2 the verdict of the watched forward.
_PROBED = "_grpo_fused_head_ok"
_WATCHED = "_grpo_fused_head_sharded_ok"


def _chunk_rows(vocab: int, itemsize: int) -> int:
    return max(1, _CHUNK_BYTES // (itemsize * vocab))


def _chunk_stats_eager(z: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, V) logits -> (c,) log-sum-exp and (c,) entropy of softmax(z / T), fp32."""
    zf = z.float() / temperature
    lse = torch.logsumexp(zf, dim=-1)
    entropy = lse - (torch.exp(zf - lse[:, None]) * zf).sum(-1)
    return lse, entropy


def _chunk_grad_eager(
    z: torch.Tensor, lse: torch.Tensor, g_lse: torch.Tensor, temperature: float
) -> torch.Tensor:
    """(c, V) gradient of sum(g_lse * lse) w.r.t. the logits z: g_lse * softmax(z / T) / T, in z's dtype."""
    zf = z.float() / temperature
    return (torch.exp(zf - lse[:, None]) * (g_lse / temperature)[:, None]).to(z.dtype)


_compiled: dict[str, Callable] = {}


def _kernel(name: str, eager: Callable, device: torch.device) -> Callable:
    """``eager`` compiled once per process on CUDA (one fused read of the chunk), eager elsewhere."""
    if device.type != "cuda":
        return eager
    if name not in _compiled:
        _compiled[name] = torch.compile(eager, dynamic=True, fullgraph=True)
    return _compiled[name]


class _FusedHead(torch.autograd.Function):
    """hidden (N, D), weight (V, D), picks (P,) rows and (P,) ids -> lse (N,), picked (P,), entropy (N,).

    ``lse`` is the log-sum-exp of ``hidden @ weight.T / T``, ``picked`` the tempered logits at the
    (row, id) picks, ``entropy`` (no gradient) that of the full tempered distribution; all fp32.
    ``pick_order``/``pick_bounds`` sort the picks by row and cut them per forward (row) chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, pick_row, pick_id, pick_order, pick_bounds, temperature, chunk):
        n = hidden.shape[0]
        h = hidden.to(weight.dtype)
        lse = torch.empty(n, device=h.device, dtype=torch.float32)
        entropy = torch.empty_like(lse)
        picked = torch.empty(pick_row.shape[0], device=h.device, dtype=torch.float32)
        stats = _kernel("stats", _chunk_stats_eager, h.device)
        for i, start in enumerate(range(0, n, chunk)):
            z = h[start : start + chunk] @ weight.T
            lse[start : start + chunk], entropy[start : start + chunk] = stats(z, temperature)
            sel = pick_order[pick_bounds[i] : pick_bounds[i + 1]]
            picked[sel] = z[pick_row[sel] - start, pick_id[sel]].float() / temperature
        ctx.save_for_backward(h, weight, lse, pick_row, pick_id)
        ctx.temperature = temperature
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(entropy)
        return lse, picked, entropy

    @staticmethod
    def backward(ctx, g_lse, g_picked, _g_entropy):
        # Chunked over the vocabulary, not the rows: each chunk's slice of the weight gradient is
        # one GEMM over all N rows, written in place (no fp32 (V, D) accumulator, no per-chunk
        # (V, D) partial: 1.7 GiB at V=151936, D=2048); only the small (N, D) hidden-state gradient
        # is accumulated across chunks, in fp32.
        h, weight, lse, pick_row, pick_id = ctx.saved_tensors
        temperature = ctx.temperature
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, vocab = h.shape[0], weight.shape[0]
        columns = _chunk_columns(n, weight.element_size())
        acc_dtype = torch.promote_types(h.dtype, torch.float32)
        grad_h = torch.zeros(h.shape, device=h.device, dtype=acc_dtype) if want_h else None
        grad_w = torch.empty(weight.shape, device=weight.device, dtype=weight.dtype) if want_w else None
        softmax_grad = _kernel("grad", _chunk_grad_eager, h.device)
        g_lse = g_lse if g_lse is not None else torch.zeros_like(lse)
        g_pick = g_picked / temperature if g_picked is not None else None
        for start in range(0, vocab, columns):
            w_c = weight[start : start + columns]
            g_z = softmax_grad(h @ w_c.T, lse, g_lse, temperature)
            if g_pick is not None:
                # Every pick, those outside this chunk adding zero: no host sync to select them.
                inside = (pick_id >= start) & (pick_id < start + w_c.shape[0])
                column = (pick_id - start).clamp_(0, w_c.shape[0] - 1)
                g_sel = torch.where(inside, g_pick, 0.0).to(g_z.dtype)
                g_z.index_put_((pick_row, column), g_sel, accumulate=True)
            if want_h:
                grad_h += g_z @ w_c
            if want_w:
                torch.mm(g_z.T, h, out=grad_w[start : start + columns])
        if grad_h is not None:
            grad_h = grad_h.to(ctx.hidden_dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_columns(rows: int, itemsize: int) -> int:
    """Vocabulary columns per backward chunk: about ``_CHUNK_BYTES`` of (rows, columns) logits."""
    return max(1, _CHUNK_BYTES // (itemsize * max(rows, 1)))


def fused_head_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    pick_row: torch.Tensor,
    pick_id: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse, picked, entropy)`` of the logits ``hidden @ weight.T`` without materialising them.

    Args:
        hidden: (N, D) the LM head's input at the N positions (any float dtype; cast to the weight's).
        weight: (V, D) the LM head's weight (no bias).
        pick_row, pick_id: (P,) the (row, vocabulary id) entries whose tempered logits are wanted.
        temperature: logits are divided by it.

    Returns fp32 (N,) log-sum-exp of the tempered logits, (P,) the picked tempered logits (both
    differentiable w.r.t. ``hidden`` and ``weight``) and (N,) the entropy of the tempered
    distribution (no gradient).
    """
    chunk = _chunk_rows(weight.shape[0], weight.element_size())
    n = hidden.shape[0]
    pick_order = torch.argsort(pick_row, stable=True)
    starts = torch.arange(0, n + chunk, chunk, device=pick_row.device).clamp_(max=n)
    pick_bounds = torch.searchsorted(pick_row[pick_order], starts).tolist()
    return _FusedHead.apply(hidden, weight, pick_row, pick_id, pick_order, pick_bounds, temperature, chunk)


# ----------------------------------------------------------------------------- the model side
class _Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@contextmanager
def lm_head_bypassed(model: torch.nn.Module) -> Iterator[None]:
    """Inside, the model's output embedding returns its input: ``outputs.logits`` are hidden states."""
    head = model.get_output_embeddings()
    original = head.forward
    head.forward = _Identity().forward
    try:
        yield
    finally:
        head.forward = original


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def _plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output embedding if it is a bias-free linear layer (its weight possibly an FSDP2 shard)
    and the fused path is switched on, else None."""
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or head.weight.dim() != 2:
        return None
    return head


def _fsdp2_managed(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    """True when FSDP2 shards the head's weight. Between a forward and its backward the weight is a
    plain tensor (the gathered one), so the module types are checked too: a probe forward on such a
    model is a collective."""
    if _is_dtensor(head.weight):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed support
        return False
    return isinstance(model, FSDPModule) or isinstance(head, FSDPModule)


def _plain_head_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """The output embedding's weight if it is a plain, unsharded, bias-free linear layer, else None."""
    head = _plain_head(model)
    if head is None or _fsdp2_managed(model, head):
        return None
    return head.weight


@torch.no_grad()
def _head_is_last(model: torch.nn.Module, forward_kwargs: dict) -> bool:
    """True when the model's logits are exactly ``lm_head(hidden)``: nothing applied after the head."""
    was_training = model.training
    model.eval()
    try:
        logits = model(**forward_kwargs).logits
        with lm_head_bypassed(model):
            hidden = model(**forward_kwargs).logits
        direct = model.get_output_embeddings()(hidden.to(logits.dtype))
    finally:
        model.train(was_training)
    if direct.shape != logits.shape:
        return False
    return bool(torch.allclose(direct.float(), logits.float(), rtol=1e-3, atol=1e-3))


def probe_forward_kwargs(device: torch.device, length: int = 8) -> dict:
    """Forward arguments of a short chain (one sample of ``length`` tokens) for the tree backend."""
    from trainer.step.attention import TreeMask

    idx = torch.arange(length, device=device)
    return {
        "input_ids": (idx % 7 + 1)[None],
        "position_ids": idx[None],
        "tree_mask": TreeMask(idx, torch.full_like(idx, length), backend="sdpa", positions=idx),
        "use_cache": False,
    }


def fused_head_weight(model: torch.nn.Module, device: torch.device) -> torch.Tensor | None:
    """The weight to fuse with the loss, or None when the model needs the unfused path.

    Checked once per model (cached on it): a plain linear head, unsharded, and logits that are the
    head's output unchanged (a short probe forward with and without the bypass must agree).
    """
    cached = getattr(model, _PROBED, None)
    weight = _plain_head_weight(model)
    if weight is None:
        return None
    if cached is None:
        try:
            cached = _head_is_last(model, probe_forward_kwargs(device))
        except Exception as exc:  # an exotic forward: the unfused path is always right
            logger.info("fused LM head off: probe forward failed (%s)", exc)
            cached = False
        if not cached:
            logger.info(
                "fused LM head off for %s: its logits are not the head's output", type(model).__name__
            )
        setattr(model, _PROBED, cached)
    return weight if cached else None


# ----------------------------------------------------------------------------- FSDP2 and the trainer
@dataclass
class HeadChoice:
    """The LM head one forward ran.

    Attributes:
        weight: (V, D) the head's weight to pass to the loss as ``lm_head_weight`` (the forward's
            ``outputs.logits`` are then hidden states), or None (they are the model's logits). Set
            when the forward has returned.
    """

    weight: torch.Tensor | None = None

    @property
    def name(self) -> str:
        """``fused`` or ``model`` (the model's own head)."""
        return "model" if self.weight is None else "fused"


def _version(tensor: Any) -> int | None:
    """The tensor's version counter (bumped by in-place writes); None if it has none."""
    try:
        return int(tensor._version)
    except (AttributeError, RuntimeError):  # not a tensor, or an inference-mode tensor
        return None


@contextmanager
def _watched_forward(model: torch.nn.Module, head: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """Inside, the model's forward (head not bypassed) records ``last``: whether ``outputs.logits``
    is the head's output tensor itself, not written to after the head (version counter unchanged)."""
    seen: dict[str, Any] = {"last": False}

    def after_head(_module, _args, output) -> None:
        seen["output"], seen["version"] = output, _version(output)

    def after_model(_module, _args, output) -> None:
        head_output = seen.pop("output", None)  # no reference to the logits outlives the forward
        logits = getattr(output, "logits", None)
        version = seen.get("version")
        seen["last"] = logits is head_output and version is not None and _version(logits) == version

    handles = [head.register_forward_hook(after_head), model.register_forward_hook(after_model)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _fsdp2_head(model: torch.nn.Module, head: torch.nn.Linear, choice: HeadChoice) -> Iterator[None]:
    """:func:`fused_lm_head` for a head whose weight FSDP2 shards."""
    if getattr(model, _PROBED, None) is False:  # probed before wrapping: something follows the head
        yield
        return
    if getattr(model, _WATCHED, None) is None:
        # The first forward runs the model's head and is watched, in place of the probe's two extra
        # forwards: those gather every layer's shards, and a rank whose row is empty (it runs a
        # one-token forward instead) would leave the others waiting in the all-gather.
        with _watched_forward(model, head) as seen:
            yield
        # The weight is only usable after the forward if FSDP2 keeps it gathered until the backward
        # (accelerate's embedding/norm/head group does: reshard_after_forward=False).
        ok = bool(seen["last"]) and not _is_dtensor(head.weight)
        setattr(model, _WATCHED, ok)
        logger.info("fused LM head under FSDP2: %s", "on" if ok else "off (head resharded or not last)")
        return
    if not getattr(model, _WATCHED):
        yield
        return
    with lm_head_bypassed(model):
        yield
    weight = head.weight
    if _is_dtensor(weight):
        raise RuntimeError(
            "the FSDP2 head weight was resharded after the forward (it was not on the watched one); "
            f"keep its group's reshard_after_forward=False or set {_ENV_SWITCH}=0"
        )
    # FSDP2's unsharded parameter, gathered in the group's pre-forward and registered on the head
    # (and, tied, on the input embedding) until the group's post-backward. The fused backward
    # accumulates into its .grad, as the head's own matmul would, and the post-backward
    # reduce-scatters that sum into the shard once. An explicit ``full_tensor()`` would instead hold
    # a second (V, D) copy until the backward, add an all-gather and a reduce-scatter that ranks on
    # the unfused path (an empty row) never join, and by default (Replicate gradient layout) slice
    # the gradient without summing it over ranks.
    choice.weight = weight


@contextmanager
def fused_lm_head(model: torch.nn.Module, device: torch.device) -> Iterator[HeadChoice]:
    """Run the model's forward inside: with its LM head bypassed where it can be fused with the loss.

    Yields a :class:`HeadChoice` whose ``weight`` is set on exit: the weight to pass to the loss, or
    None when ``outputs.logits`` are the model's logits. Plain models: as :func:`fused_head_weight`.
    Under FSDP2 the weight is the one gathered for this forward, usable until its backward; the
    first forward of a model runs the model's own head and is watched (see :func:`_fsdp2_head`).
    Every FSDP2 path runs the same collectives, so ranks may differ in the path they take.
    """
    choice = HeadChoice()
    head = _plain_head(model)
    if head is not None and _fsdp2_managed(model, head):
        with _fsdp2_head(model, head, choice):
            yield choice
        return
    weight = fused_head_weight(model, device) if head is not None else None
    with lm_head_bypassed(model) if weight is not None else nullcontext():
        yield choice
    choice.weight = weight


def prime_fused_head(model: torch.nn.Module, device: torch.device) -> None:
    """Settle the fused head's choice with one no-gradient forward of a short input.

    Under FSDP2 a collective: every rank calls it at the same point, after wrapping. Without it the
    first training forward is the watched one (model's head); with it the first step is fused too.
    """
    with torch.no_grad(), fused_lm_head(model, device):
        model(**probe_forward_kwargs(device))
