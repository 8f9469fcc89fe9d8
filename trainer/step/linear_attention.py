"""Tree packing for gated DeltaNet layers (the Qwen3-Next / Qwen3.5 hybrids).

A packed row lays a trie out depth-first (``tin == arange(L)``): a token's predecessors are its
ancestors in the trie, not the tokens before it in the row. Attention layers follow the paths
through the tree mask; a gated DeltaNet layer has two sequential parts that must follow them too:

* the causal depthwise convolution (kernel ``K``, 4 in the released models) reads the ``K - 1``
  previous tokens of each token's *path* (:func:`tree_causal_conv1d` gathers them through parent
  pointers, so a completion's first tokens read the end of its prompt, never a sibling);
* the chunked gated delta rule carries a recurrent state along the sequence: the row is cut into
  segments (runs where each token continues the previous one, cut after every token that other
  tokens branch from) and each segment starts from the final state of its parent token
  (:func:`tree_chunk_gated_delta_rule`).

:func:`install_tree_linear_attention` wraps the two kernel functions of the model's modeling module
(``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``): called with a ``tree_mask`` keyword
(transformers passes the forward's keyword arguments down to them) they run the tree version,
otherwise the original (generation with a cache is untouched).

Cost: the convolution is K gathers; the delta rule runs once per depth of the segment tree (all
prompts, then all completions: 2 batched calls per layer for single-turn groups).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

CONV_FUNCTION = "causal_conv1d_fn"
DELTA_RULE_FUNCTION = "torch_chunk_gated_delta_rule"
_LINEAR_ATTENTION_SUFFIX = "GatedDeltaNet"


@dataclass(frozen=True)
class TreePaths:
    """The path structure of one packed row.

    Attributes:
        parent: (L,) long, the previous token on each token's path; -1 for a root.
        segments: ``(start, end, parent_token)``: tokens ``start .. end - 1`` continue each other;
            the segment's state starts from ``parent_token``'s final state (-1: the zero state).
        waves: segment indices grouped by depth in the segment tree: every segment of a wave
            starts from a state the earlier waves computed, so a wave runs as one batch.
    """

    parent: torch.Tensor
    segments: list[tuple[int, int, int]]
    waves: list[list[int]]


def tree_paths(tin: torch.Tensor, tout: torch.Tensor) -> TreePaths:
    """Parent pointers and delta-rule segments of one row from its (L,) ``tin`` / ``tout``."""
    tin, tout = tin.detach().cpu().long(), tout.detach().cpu().long()
    length = tin.numel()
    positions = torch.arange(length)
    if not torch.equal(tin, positions):
        raise ValueError("gated DeltaNet tree packing needs a depth-first row layout (tin == arange(L))")
    parent = torch.full((length,), -1, dtype=torch.long)
    # token i continues token i-1 iff it lies inside i-1's subtree
    continues = tout[:-1] > positions[1:]
    parent[1:][continues] = positions[:-1][continues]
    starts = [0] + (torch.nonzero(~continues)[:, 0] + 1).tolist()
    for start in starts[1:]:
        ancestors = torch.nonzero(tout[:start] > start)[:, 0]
        parent[start] = int(ancestors.max()) if ancestors.numel() else -1
    branched_from = {int(parent[s]) for s in starts if parent[s] >= 0}
    cuts = sorted(set(starts) | {p + 1 for p in branched_from if p + 1 < length})
    ends = cuts[1:] + [length]
    segments = [(a, b, int(parent[a])) for a, b in zip(cuts, ends, strict=True)]
    segment_ending_at = {b - 1: i for i, (_, b, _) in enumerate(segments)}
    depth: list[int] = []
    for _, _, p in segments:  # parents come first in a depth-first layout
        depth.append(0 if p < 0 else depth[segment_ending_at[p]] + 1)
    waves = [[i for i, d in enumerate(depth) if d == level] for level in range(max(depth) + 1)]
    return TreePaths(parent=parent, segments=segments, waves=waves)


def _row_paths(tree_mask, batch: int) -> list[TreePaths]:
    """One :class:`TreePaths` per batch row, cached on the mask (shared by every layer)."""
    cached = tree_mask._cache.get("paths")
    if cached is None:
        tin, tout = tree_mask.tin, tree_mask.tout
        if tin.dim() == 1:
            tin, tout = tin[None], tout[None]
        cached = [tree_paths(tin[b], tout[b]) for b in range(tin.shape[0])]
        tree_mask._cache["paths"] = cached
    if len(cached) != batch:
        raise ValueError(f"tree mask has {len(cached)} rows, the forward has {batch}")
    return cached


def _row_ancestors(tree_mask, batch: int, taps: int, device: torch.device) -> list[torch.Tensor]:
    """Per batch row, (taps - 1, L) long on ``device``: each token's 1st .. (taps-1)th predecessor on
    its path (-1: none). Cached on the mask, so every layer of a forward shares one copy."""
    key = ("ancestors", taps, device)
    if key not in tree_mask._cache:
        rows = []
        for paths in _row_paths(tree_mask, batch):
            parent = paths.parent.to(device)
            ancestor = torch.arange(parent.numel(), device=device)
            lags = []
            for _ in range(1, taps):
                ancestor = torch.where(ancestor >= 0, parent[ancestor.clamp(min=0)], ancestor)
                lags.append(ancestor)
            rows.append(torch.stack(lags) if lags else parent.new_empty((0, parent.numel())))
        tree_mask._cache[key] = rows
    return tree_mask._cache[key]


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, tree_mask
) -> torch.Tensor:
    """Depthwise causal convolution along each token's path.

    Args:
        x: (B, C, L) channels-first activations. weight: (C, K) per-channel taps, the last tap
            multiplying the token itself (as ``F.conv1d`` with ``K - 1`` left padding). bias: (C,).
    Returns (B, C, L) in ``x``'s dtype: ``act(bias + sum_k weight[:, K-1-k] * x[path ancestor k])``,
    a missing ancestor (the path is shorter than K) reading zero.
    """
    batch, _, length = x.shape
    taps = weight.shape[-1]
    xw = x.to(weight.dtype)
    out = xw * weight[:, taps - 1, None]
    rows = []
    for b, ancestors in enumerate(_row_ancestors(tree_mask, batch, taps, x.device)):
        if ancestors.shape[-1] != length:
            raise ValueError(f"tree mask covers {ancestors.shape[-1]} tokens, the convolution has {length}")
        row = out[b]
        for lag in range(1, taps):
            ancestor = ancestors[lag - 1]
            present = (ancestor >= 0).to(xw.dtype)
            row = row + xw[b][:, ancestor.clamp(min=0)] * present * weight[:, taps - 1 - lag, None]
        rows.append(row)
    out = torch.stack(rows)
    if bias is not None:
        out = out + bias[:, None]
    return _activate(out, activation).to(x.dtype)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    from transformers.activations import ACT2FN

    return ACT2FN[activation](x)


def tree_chunk_gated_delta_rule(
    delta_rule: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    tree_mask,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``delta_rule`` along the trie: each segment starts from its parent token's final state.

    Shapes as transformers' ``torch_chunk_gated_delta_rule``: query/key (B, L, H, Dk), value
    (B, L, H, Dv), g and beta (B, L, H). Returns ((B, L, H, Dv), None): training keeps no state.
    The segments of one wave (same depth) run as one batch, right-padded with zeros: a padded
    token has ``beta = 0`` (writes nothing) and ``g = 0`` (decays nothing), so each segment's
    outputs and final state are exactly its own (the kernel pads its chunks the same way).
    """
    if kwargs.pop("initial_state", None) is not None:
        raise ValueError("gated DeltaNet tree packing runs without a cache (initial_state must be None)")
    kwargs.pop("output_final_state", None)
    heads, key_dim, value_dim = value.shape[-2], key.shape[-1], value.shape[-1]
    outputs = []
    for b, paths in enumerate(_row_paths(tree_mask, query.shape[0])):
        finals: dict[int, torch.Tensor] = {}  # segment end token -> (H, Dk, Dv) state
        pieces: dict[int, torch.Tensor] = {}  # segment start -> (T, H, Dv) output
        zero_state = query.new_zeros((heads, key_dim, value_dim), dtype=torch.float32)
        for wave in paths.waves:
            segments = [paths.segments[i] for i in wave]

            def batch(x: torch.Tensor) -> torch.Tensor:
                return pad_sequence([x[b, s:e] for s, e, _ in segments], batch_first=True)  # noqa: B023

            initial = None
            if any(p >= 0 for _, _, p in segments):
                initial = torch.stack([finals[p] if p >= 0 else zero_state for _, _, p in segments])
            out, state = delta_rule(
                batch(query),
                batch(key),
                batch(value),
                g=batch(g),
                beta=batch(beta),
                initial_state=initial,
                output_final_state=True,
                **kwargs,
            )
            for j, (start, end, _) in enumerate(segments):
                pieces[start] = out[j, : end - start]
                finals[end - 1] = state[j]
        outputs.append(torch.cat([pieces[s] for s, _, _ in paths.segments], dim=0))
    return torch.stack(outputs), None


def _wrap_conv(original: Callable) -> Callable:
    @functools.wraps(original)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        tree_mask = kwargs.pop("tree_mask", None)
        if tree_mask is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return tree_causal_conv1d(hidden_states, weight, bias, activation, tree_mask)

    conv.tree_original = original
    return conv


def _wrap_delta_rule(original: Callable) -> Callable:
    @functools.wraps(original)
    def delta_rule(query, key, value, g, beta, *args, **kwargs):
        tree_mask = kwargs.pop("tree_mask", None)
        if tree_mask is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if args:
            raise TypeError("tree packing calls the delta rule with keyword arguments only")
        return tree_chunk_gated_delta_rule(original, query, key, value, g, beta, tree_mask, **kwargs)

    delta_rule.tree_original = original
    return delta_rule


def linear_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The gated DeltaNet layers of ``model``."""
    return [m for m in model.modules() if type(m).__name__.endswith(_LINEAR_ATTENTION_SUFFIX)]


def supports_tree_linear_attention(model: torch.nn.Module) -> bool:
    """True when every gated DeltaNet layer's modeling module has the two kernels this wraps."""
    layers = linear_attention_modules(model)
    return bool(layers) and all(
        callable(getattr(sys.modules[type(m).__module__], name, None))
        for m in layers
        for name in (CONV_FUNCTION, DELTA_RULE_FUNCTION)
    )


def install_tree_linear_attention(model: torch.nn.Module) -> int:
    """Make ``model``'s gated DeltaNet layers follow tree paths under a ``tree_mask``; returns how
    many layers. Idempotent (a modeling module is wrapped once, for every model using it)."""
    layers = linear_attention_modules(model)
    for module_name in {type(m).__module__ for m in layers}:
        modeling = sys.modules[module_name]
        conv = getattr(modeling, CONV_FUNCTION)
        if not hasattr(conv, "tree_original"):
            setattr(modeling, CONV_FUNCTION, _wrap_conv(conv))
        rule = getattr(modeling, DELTA_RULE_FUNCTION)
        if not hasattr(rule, "tree_original"):
            setattr(modeling, DELTA_RULE_FUNCTION, _wrap_delta_rule(rule))
    return len(layers)
