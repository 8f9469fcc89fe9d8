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
"""

from __future__ import annotations

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
        tin, tout: (L,) or (B, L) integer tensors from :class:`trainer.packing.PackedRow`.
        backend: ``"auto"`` (FlexAttention on CUDA, SDPA elsewhere), ``"flex"`` or ``"sdpa"``.

    Masks built from it are cached on the object, so all layers of a forward (and the recomputation
    of gradient checkpointing) build them once.
    """

    tin: torch.Tensor
    tout: torch.Tensor
    backend: str = "auto"
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.tin.shape != self.tout.shape or self.tin.dim() not in (1, 2):
            raise ValueError(
                f"tin {tuple(self.tin.shape)} and tout {tuple(self.tout.shape)}: need equal (L,) or (B, L)"
            )
        if self.backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"backend={self.backend!r}: expected 'auto', 'flex' or 'sdpa'")

    def _batched(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tin, tout = self.tin, self.tout
        if tin.dim() == 1:
            tin, tout = tin[None], tout[None]
        return tin.to(device), tout.to(device)

    def dense(self, device: torch.device) -> torch.Tensor:
        """(B, 1, L, L) boolean mask, True where query (dim 2) may attend to key (dim 3)."""
        key = ("dense", device)
        if key not in self._cache:
            tin, tout = self._batched(device)
            q = tin[:, :, None]
            self._cache[key] = ((tin[:, None, :] <= q) & (q < tout[:, None, :]))[:, None]
        return self._cache[key]

    def block_mask(self, padded_len: int, device: torch.device):
        """FlexAttention ``BlockMask`` over ``padded_len`` positions (padding sees only itself)."""
        key = ("block", padded_len, device)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            tin, tout = _pad_tree(*self._batched(device), padded_len)
            self._cache[key] = create_block_mask(
                tree_mask_mod(tin, tout),
                tin.shape[0],
                None,
                padded_len,
                padded_len,
                device=device,
                _compile=True,
            )
        return self._cache[key]


def _pad_tree(tin: torch.Tensor, tout: torch.Tensor, padded_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) tin/tout extended to (B, padded_len): each padding position is its own one-token subtree,
    outside every real subtree (real intervals lie within [0, L])."""
    batch, length = tin.shape
    extra = torch.arange(length, padded_len, device=tin.device, dtype=tin.dtype).expand(batch, -1)
    return torch.cat([tin, extra], dim=1), torch.cat([tout, extra + 1], dim=1)


def tree_mask_mod(tin: torch.Tensor, tout: torch.Tensor):
    """FlexAttention ``mask_mod`` over (B, L) tin/tout: key visible iff ancestor-or-self of the query."""

    def mask_mod(b, h, q_idx, kv_idx):
        t_q = tin[b, q_idx]
        return (tin[b, kv_idx] <= t_q) & (t_q < tout[b, kv_idx])

    return mask_mod


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


def _flex_attention():
    """``flex_attention`` compiled once per process (shape buckets keep recompiles bounded)."""
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        # Each length bucket is one more compiled graph of flex_attention and of create_block_mask;
        # the default limit (8) would silently fall back to the unfused, (L x L)-materialising path.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), _FLEX_RECOMPILE_LIMIT))
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


def _sdpa_tree(query, key, value, tree_mask: TreeMask, scaling: float | None, dropout: float) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    mask = tree_mask.dense(query.device)
    if mask.shape[-1] != key.shape[2] or mask.shape[-2] != query.shape[2]:
        raise ValueError(f"tree mask covers {mask.shape[-1]} tokens, the forward has {query.shape[2]}")
    return F.scaled_dot_product_attention(
        query,
        _repeat_kv(key, groups),
        _repeat_kv(value, groups),
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
    )


def _flex_tree(query, key, value, tree_mask: TreeMask, scaling: float | None, dropout: float) -> torch.Tensor:
    if dropout:
        raise ValueError(
            "tree attention's FlexAttention path has no attention dropout; set attention_dropout=0"
        )
    length = query.shape[2]
    padded = padded_length(length)
    if padded != length:
        pad = (0, 0, 0, padded - length)
        query, key, value = F.pad(query, pad), F.pad(key, pad), F.pad(value, pad)
    flex = _flex_attention()  # first: it raises the recompile limit the block-mask builder also needs
    block_mask = tree_mask.block_mask(padded, query.device)
    out = flex(
        query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
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
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (B, H, L, D) query, (B, Hkv, L, D) key/value -> (B, L, H, D).

    ``tree_mask`` is required; ``attention_mask`` must be None (no cache, no padding mask).
    """
    if tree_mask is None:
        raise ValueError(
            "attn_implementation='tree' needs the forward keyword argument tree_mask=TreeMask(tin, tout) "
            "(see trainer.attention.tree_forward_kwargs)"
        )
    if attention_mask is not None:
        raise ValueError("tree attention takes no attention_mask: visibility comes from tree_mask")
    if sliding_window is not None:
        raise ValueError(
            "sliding-window attention layers are not supported by tree packing; use a model whose layers all "
            "attend fully"
        )
    if s_aux is not None:
        raise ValueError("models with attention sinks are not supported (see the spec's constraints)")
    use_flex = tree_mask.backend == "flex" or (tree_mask.backend == "auto" and query.is_cuda)
    attend = _flex_tree if use_flex else _sdpa_tree
    out = attend(query, key, value, tree_mask, scaling, dropout)
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
    """Forward arguments of one packed row (a :class:`trainer.packing.PackedRow`) as a batch of one.

    Returns ``input_ids`` (1, L), ``position_ids`` (1, L), ``tree_mask`` and ``use_cache=False``.
    """
    device = device if device is not None else row.input_ids.device
    return {
        "input_ids": row.input_ids.to(device)[None],
        "position_ids": row.position_ids.to(device)[None],
        "tree_mask": TreeMask(row.tin.to(device), row.tout.to(device), backend=backend),
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
        "tree_mask": TreeMask(positions, torch.full_like(positions, n), backend=backend),
        "use_cache": False,
    }


register_tree_attention()
