"""Tree attention: each token of a packed row attends only along its path in the row's prefix trie.

The backend is registered with transformers' ``AttentionInterface`` under :data:`TREE_ATTENTION`
(``"tree"``); ``model.set_attn_implementation("tree")`` (or :func:`use_tree_attention`) switches a
Llama/Qwen-style model to it. transformers has no mask builder for an unknown implementation name, so
the model hands the attention function ``attention_mask=None``; the tree itself travels as the model
forward's keyword argument ``tree_mask`` (a :class:`TreeMask`), which transformers 5 passes unchanged
through the decoder layers to the attention function (also through gradient checkpointing, which
binds the keyword arguments of each layer call). :func:`tree_forward_kwargs` builds the arguments of
one row's forward. RoPE positions come from the packing (``position_ids`` = depth in the trie).

Paths:

* CPU (and CUDA when asked): scaled-dot-product attention with a boolean (L, L) mask built once per
  forward from ``tin``/``tout``; exact, K/V heads repeated for grouped-query attention.
* CUDA: FlexAttention with a block mask whose ``mask_mod`` is
  ``(tin[k] <= tin[q]) & (tin[q] < tout[k])``. The row is padded to a length bucket
  (:func:`padded_length`) so the compiled kernel and block-mask builder are reused across steps
  instead of recompiling for every row length; padding positions see only themselves.

Layer variants the models pass to the attention function, followed on both paths:

* ``sliding_window=W`` (Gemma 2/3, Mistral, Phi-3, OLMo 3, ...): a key is visible only if it is also
  one of the query's last W positions along its path, ``position[q] - position[k] < W`` (positions =
  depth in the trie, the same as in the unpacked sequence), as transformers' own sliding mask.
* ``softcap=c`` (Gemma 2): scores become ``c * tanh(score / c)`` before masking; on the SDPA path this
  runs as explicit matmul + softmax (fp32), on FlexAttention as a ``score_mod``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

TREE_ATTENTION = "tree"
# Length buckets: multiples of 128 up to 1024, then 4 buckets per doubling (above 1024: <= 25% padding).
_MIN_BUCKET = 128
_BUCKETS_PER_OCTAVE = 4
# Distinct compiled shapes a run may meet: the length buckets times a few (dtype, grad) variants.
_FLEX_RECOMPILE_LIMIT = 128

_compiled_flex = None


@dataclass(eq=False)
class TreeMask:
    """The visibility structure of one forward: key k is visible to query q iff k is an
    ancestor-or-self of q, i.e. ``tin[k] <= tin[q] < tout[k]``.

    Attributes:
        tin, tout: (L,) or (B, L) integer tensors from :class:`trainer.step.packing.PackedRow`.
        backend: ``"auto"`` (FlexAttention on CUDA, SDPA elsewhere), ``"flex"`` or ``"sdpa"``.
        positions: (L,) or (B, L) position ids (depth along each path); needed by sliding-window layers.

    Masks built from it are cached on the object, so all layers of a forward (and the recomputation
    of gradient checkpointing) build them once.
    """

    tin: torch.Tensor
    tout: torch.Tensor
    backend: str = "auto"
    positions: torch.Tensor | None = None
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)
    # Set by prepare_flex (before compiled layers, which must not build masks inside their region):
    # the FlexAttention length bucket and its block mask per sliding window (None = full attention).
    padded_len: int | None = field(default=None, repr=False)
    flex_masks: dict[int | None, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tin.shape != self.tout.shape or self.tin.dim() not in (1, 2):
            raise ValueError(
                f"tin {tuple(self.tin.shape)} and tout {tuple(self.tout.shape)}: need equal (L,) or (B, L)"
            )
        if self.backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"backend={self.backend!r}: expected 'auto', 'flex' or 'sdpa'")
        if self.positions is not None and self.positions.shape != self.tin.shape:
            raise ValueError(
                f"positions {tuple(self.positions.shape)}: need the shape of tin {tuple(self.tin.shape)}"
            )

    def _batched(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tin, tout = self.tin, self.tout
        if tin.dim() == 1:
            tin, tout = tin[None], tout[None]
        return tin.to(device), tout.to(device)

    def _batched_positions(self, device: torch.device, window: int) -> torch.Tensor:
        if self.positions is None:
            raise ValueError(
                f"a sliding-window layer (window {window}) needs the row's position ids: build the "
                "TreeMask with positions= (tree_forward_kwargs does)"
            )
        positions = self.positions if self.positions.dim() == 2 else self.positions[None]
        return positions.to(device)

    def dense(self, device: torch.device, window: int | None = None) -> torch.Tensor:
        """(B, 1, L, L) boolean mask, True where query (dim 2) may attend to key (dim 3); with
        ``window``, only keys among the query's last ``window`` positions on its path."""
        key = ("dense", device, window)
        if key not in self._cache:
            tin, tout = self._batched(device)
            q = tin[:, :, None]
            mask = (tin[:, None, :] <= q) & (q < tout[:, None, :])
            if window is not None:
                pos = self._batched_positions(device, window)
                mask = mask & (pos[:, :, None] - pos[:, None, :] < window)
            self._cache[key] = mask[:, None]
        return self._cache[key]

    def block_mask(self, padded_len: int, device: torch.device, window: int | None = None):
        """FlexAttention ``BlockMask`` over ``padded_len`` positions (padding sees only itself)."""
        key = ("block", padded_len, device, window)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            tin, tout = _pad_tree(*self._batched(device), padded_len)
            positions = None
            if window is not None:
                pos = self._batched_positions(device, window)
                positions = F.pad(pos, (0, padded_len - pos.shape[1]))  # padding: position 0, sees itself
            self._cache[key] = create_block_mask(
                tree_mask_mod(tin, tout, positions, window),
                tin.shape[0],
                None,
                padded_len,
                padded_len,
                device=device,
                _compile=True,
            )
        return self._cache[key]

    def prepare_flex(self, device: torch.device, windows: set[int | None]) -> None:
        """Build the FlexAttention block masks of every window in ``windows`` now, at the row's length
        bucket, so layers compiled whole only read them (:mod:`trainer.step.compiled_layers`)."""
        padded = padded_length(self.tin.shape[-1])
        self.flex_masks = {w: self.block_mask(padded, device, w) for w in windows}
        self.padded_len = padded


def _pad_tree(tin: torch.Tensor, tout: torch.Tensor, padded_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) tin/tout extended to (B, padded_len): each padding position is its own one-token subtree,
    outside every real subtree (real intervals lie within [0, L])."""
    batch, length = tin.shape
    extra = torch.arange(length, padded_len, device=tin.device, dtype=tin.dtype).expand(batch, -1)
    return torch.cat([tin, extra], dim=1), torch.cat([tout, extra + 1], dim=1)


def tree_mask_mod(
    tin: torch.Tensor, tout: torch.Tensor, positions: torch.Tensor | None = None, window: int | None = None
):
    """FlexAttention ``mask_mod`` over (B, L) tin/tout: key visible iff ancestor-or-self of the query
    (and, with ``window``, within the query's last ``window`` positions of (B, L) ``positions``)."""

    def mask_mod(b, h, q_idx, kv_idx):
        t_q = tin[b, q_idx]
        return (tin[b, kv_idx] <= t_q) & (t_q < tout[b, kv_idx])

    if window is None:
        return mask_mod

    def windowed_mask_mod(b, h, q_idx, kv_idx):
        near = positions[b, q_idx] - positions[b, kv_idx] < window
        return mask_mod(b, h, q_idx, kv_idx) & near

    return windowed_mask_mod


@functools.cache
def _softcap_score_mod(softcap: float):
    """FlexAttention ``score_mod``: ``softcap * tanh(score / softcap)`` (Gemma 2's attention softcap);
    one function per cap value, so every layer and step hands the compiled kernel the same object."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def padded_length(length: int) -> int:
    """The length bucket ``length`` is padded to on the FlexAttention path.

    Multiples of 128 up to 1024; above, ``_BUCKETS_PER_OCTAVE`` sizes per doubling. A run that sees
    rows up to 32k tokens compiles for at most ~28 buckets.
    """
    if length <= 0:
        return _MIN_BUCKET
    octave = 1 << max(0, math.ceil(math.log2(length)))
    granule = max(_MIN_BUCKET, octave // (2 * _BUCKETS_PER_OCTAVE))
    return -(-length // granule) * granule


def raise_recompile_limit(limit: int = _FLEX_RECOMPILE_LIMIT) -> None:
    """Let torch.compile keep at least ``limit`` graphs per compiled function (one per length bucket
    and variant) instead of falling back to eager past its default of 8."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


def _flex_attention():
    """``flex_attention`` compiled once per process (shape buckets keep recompiles bounded)."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        # Each length bucket is one more compiled graph of flex_attention and of create_block_mask;
        # the default limit (8) would silently fall back to the unfused, (L x L)-materialising path.
        raise_recompile_limit()
        # GRPO_FLEX_COMPILE_MODE=max-autotune-no-cudagraphs searches kernel tilings (minutes per bucket).
        mode = os.environ.get("GRPO_FLEX_COMPILE_MODE") or None
        _compiled_flex = torch.compile(flex_attention, dynamic=False, mode=mode)
    return _compiled_flex


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, Hkv * groups, L, D), each K/V head repeated for its query heads."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def _sdpa_tree(
    query, key, value, tree_mask: TreeMask, scaling: float | None, dropout: float, window, softcap
) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    mask = tree_mask.dense(query.device, window)
    if mask.shape[-1] != key.shape[2] or mask.shape[-2] != query.shape[2]:
        raise ValueError(f"tree mask covers {mask.shape[-1]} tokens, the forward has {query.shape[2]}")
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
        )
    # SDPA has no score hook: the capped scores are formed explicitly, softmax in fp32 (as eager does).
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout:
        weights = F.dropout(weights, p=dropout, training=True)
    return torch.matmul(weights, value)


def _flex_tree(
    query, key, value, tree_mask: TreeMask, scaling: float | None, dropout: float, window, softcap
) -> torch.Tensor:
    if dropout:
        raise ValueError(
            "tree attention's FlexAttention path has no attention dropout; set attention_dropout=0"
        )
    length = query.shape[2]
    prepared = tree_mask.flex_masks is not None and window in tree_mask.flex_masks
    padded = tree_mask.padded_len if prepared else padded_length(length)
    if padded != length:
        pad = (0, 0, 0, padded - length)
        query, key, value = F.pad(query, pad), F.pad(key, pad), F.pad(value, pad)
    flex = _flex_attention()  # first: it raises the recompile limit the block-mask builder also needs
    block_mask = (
        tree_mask.flex_masks[window] if prepared else tree_mask.block_mask(padded, query.device, window)
    )
    out = flex(
        query,
        key,
        value,
        score_mod=None if softcap is None else _softcap_score_mod(softcap),
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out[:, :, :length]


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_mask: TreeMask | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (B, H, L, D) query, (B, Hkv, L, D) key/value -> (B, L, H, D).

    ``tree_mask`` is required; ``attention_mask`` must be None (no cache, no padding mask).
    ``sliding_window`` and ``softcap`` are the layer's, as the model passes them (module docstring).
    """
    if tree_mask is None:
        raise ValueError(
            "attn_implementation='tree' needs the forward keyword argument tree_mask=TreeMask(tin, tout) "
            "(see trainer.step.attention.tree_forward_kwargs)"
        )
    if attention_mask is not None:
        raise ValueError("tree attention takes no attention_mask: visibility comes from tree_mask")
    if s_aux is not None:
        raise ValueError("models with attention sinks are not supported (see the spec's constraints)")
    use_flex = tree_mask.backend == "flex" or (tree_mask.backend == "auto" and query.is_cuda)
    attend = _flex_tree if use_flex else _sdpa_tree
    out = attend(query, key, value, tree_mask, scaling, dropout, sliding_window, softcap)
    return out.transpose(1, 2).contiguous(), None


def register_tree_attention() -> str:
    """Register the backend with transformers (idempotent); returns its name."""
    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    return TREE_ATTENTION


def use_tree_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (a transformers ``PreTrainedModel``) to tree attention."""
    register_tree_attention()
    model.set_attn_implementation(TREE_ATTENTION)


def tree_forward_kwargs(
    row, device: torch.device | str | None = None, backend: str = "auto"
) -> dict[str, Any]:
    """Forward arguments of one packed row (a :class:`trainer.step.packing.PackedRow`) as a batch of one.

    Returns ``input_ids`` (1, L), ``position_ids`` (1, L), ``tree_mask`` and ``use_cache=False``.
    """
    device = device if device is not None else row.input_ids.device
    positions = row.position_ids.to(device)  # one copy serves RoPE and the sliding-window masks
    return {
        "input_ids": row.input_ids.to(device)[None],
        "position_ids": positions[None],
        "tree_mask": TreeMask(row.tin.to(device), row.tout.to(device), backend=backend, positions=positions),
        "use_cache": False,
    }


def sequence_forward_kwargs(
    input_ids: list[int] | torch.Tensor, device: torch.device | str | None = None, backend: str = "auto"
) -> dict[str, Any]:
    """Forward arguments of one unpacked sequence (a chain: every token sees all before it), for
    models switched to tree attention. Same keys as :func:`tree_forward_kwargs`."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(-1)
    n = ids.numel()
    positions = torch.arange(n, device=ids.device)
    return {
        "input_ids": ids[None],
        "position_ids": positions[None],
        "tree_mask": TreeMask(positions, torch.full_like(positions, n), backend=backend, positions=positions),
        "use_cache": False,
    }


register_tree_attention()
