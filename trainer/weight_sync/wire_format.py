"""The weight-transfer wire format shared by the trainer senders and the CPU receiver.

vLLM 0.32's dense ``nccl`` engine (``NCCLWeightTransferEngine``) receives one round as:

- an ``/update_weights`` body ``{"update_info": {"names": [...], "dtype_names": [...], "shapes": [...]}}``
  with HF checkpoint names (``model.layers.0.self_attn.q_proj.weight``), torch dtype names without the
  ``torch.`` prefix (``"bfloat16"``) and full shapes, in the order the bytes follow;
- when the init handshake said ``packed=True``: a sequence of ``uint8`` broadcasts from rank 0, each the
  concatenation of the raw bytes of consecutive tensors. A bucket closes right after the tensor that makes
  its byte count *exceed* ``packed_buffer_size_bytes`` (so a bucket can be larger than the buffer size, and
  a single oversize tensor is a bucket of its own). Sender and receiver cut the stream from the same
  metadata, so they must agree on this rule to the byte.

The CPU (gloo) backend in :mod:`trainer.weight_sync.cpu_engine` uses the same metadata and bucketing, so
one client drives both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorMeta:
    """One parameter on the wire: HF name, dtype and full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's raw bytes."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """The dtype as vLLM's ``getattr(torch, name)`` expects it, e.g. ``"bfloat16"``."""
        return str(self.dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :attr:`TensorMeta.dtype_name`; raises ``ValueError`` for a non-dtype name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def update_info(metas: Sequence[TensorMeta]) -> dict[str, list]:
    """The ``update_info`` payload of ``POST /update_weights`` for one round."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype_name for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def metas_from_update_info(info: dict) -> list[TensorMeta]:
    """Parse an ``update_info`` payload back into metadata; raises ``ValueError`` on ragged lists."""
    names, dtype_names, shapes = info["names"], info["dtype_names"], info["shapes"]
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(
            f"update_info lists differ in length: {len(names)} names, {len(dtype_names)} dtypes, "
            f"{len(shapes)} shapes"
        )
    return [
        TensorMeta(name, dtype_from_name(d), tuple(int(s) for s in shape))
        for name, d, shape in zip(names, dtype_names, shapes, strict=True)
    ]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Split tensor indices into buckets by vLLM's packed rule.

    Args:
        sizes: byte size of each tensor, in wire order.
        bucket_bytes: the agreed ``packed_buffer_size_bytes``.

    Returns:
        Consecutive index ranges covering ``range(len(sizes))``; a bucket ends after the tensor that
        takes its total strictly above ``bucket_bytes``.
    """
    buckets: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > bucket_bytes:
            buckets.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's bytes (copying only if it is not contiguous)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the raw bytes of ``tensors`` into one flat ``uint8`` tensor on their device."""
    if len(tensors) == 1:
        return as_bytes(tensors[0])
    return torch.cat([as_bytes(t) for t in tensors])


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Split a received ``uint8`` bucket back into named tensors (views of ``buffer`` where aligned).

    A slice whose byte offset is not a multiple of its dtype's size cannot be viewed as that dtype, so
    it is copied first; that only happens when one bucket mixes dtypes of different widths.
    """
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for meta in metas:
        chunk = buffer[offset : offset + meta.nbytes]
        if offset % meta.dtype.itemsize:
            chunk = chunk.clone()
        out.append((meta.name, chunk.view(meta.dtype).view(meta.shape)))
        offset += meta.nbytes
    if offset != buffer.numel():
        raise ValueError(f"bucket holds {buffer.numel()} bytes but its metadata describes {offset}")
    return out


def iter_bucket_tensors(
    pairs: Sequence[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta], bucket_bytes: int
) -> Iterator[tuple[range, torch.Tensor]]:
    """Yield ``(index range, packed uint8 bucket)`` in wire order, packing lazily one bucket at a time."""
    for bucket in plan_buckets([m.nbytes for m in metas], bucket_bytes):
        yield bucket, pack([pairs[i][1] for i in bucket])
