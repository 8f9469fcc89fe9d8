"""Trainer-side sender for vLLM 0.32's built-in dense ``nccl`` weight-transfer engine.

The trainer machine need not have vLLM installed, so this talks to NCCL directly through ``ctypes``
(the ``libnccl.so.2`` that torch's CUDA build already loads) and speaks the engine's documented
"foreign peer" rendezvous:

- the trainer mints an ``ncclUniqueId`` and ships it, standard base64, as ``nccl_unique_id_b64`` in the
  ``/init_weight_transfer_engine`` body (with ``rank_offset=1``, ``world_size`` = 1 + server workers and
  the packed wire params);
- every rank enters ``ncclCommInitRank`` concurrently (no store barrier), the trainer as rank 0;
- right after init each rank issues a one-element float32 SUM ``all_reduce`` (vLLM's warm-up handshake);
  a peer that skips it deadlocks everyone;
- each round the weights are broadcast from rank 0 as packed ``uint8`` buckets cut by
  :func:`trainer.weight_sync.wire_format.plan_buckets` while ``/update_weights`` runs on the server.

Every wait polls a CUDA event against a deadline; on timeout the communicator is aborted so neither the
trainer nor its GPU stream stays wedged, and ``TimeoutError`` is raised.
This module imports on a CPU-only machine; the library is loaded only when a sender connects.
"""

from __future__ import annotations

import base64
import ctypes
import glob
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from trainer.weight_sync.deadline import call_with_deadline

NCCL_UNIQUE_ID_BYTES = 128
_NCCL_UINT8 = 1
_NCCL_FLOAT32 = 7
_NCCL_SUM = 0
# vLLM's consumer double-buffers; the sender keeps as many buckets in flight.
PACKED_NUM_BUFFERS = 2
# Each side holds up to PACKED_NUM_BUFFERS buckets of GPU memory; vLLM's own default is 1 GiB.
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def _library_candidates() -> list[str]:
    """Paths to try for libnccl, most specific first."""
    out = [os.environ[k] for k in ("NCCL_LIBRARY_PATH", "VLLM_NCCL_SO_PATH") if os.environ.get(k)]
    out.append("libnccl.so.2")  # resolves to the copy torch already loaded, if any
    for root in sys.path:
        out.extend(sorted(glob.glob(os.path.join(root, "nvidia", "nccl", "lib", "libnccl.so*"))))
    return out


class NcclLibrary:
    """The handful of NCCL C functions the sender needs, bound with explicit signatures."""

    def __init__(self, path: str | None = None) -> None:
        errors = []
        for candidate in [path] if path else _library_candidates():
            try:
                self.lib = ctypes.CDLL(candidate)
                self.path = candidate
                break
            except OSError as exc:
                errors.append(f"{candidate}: {exc}")
        else:
            raise RuntimeError("cannot load the NCCL library; tried " + "; ".join(errors))
        lib = self.lib
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [i]
        signatures = {
            "ncclGetVersion": [ctypes.POINTER(i)],
            "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(vp), i, _UniqueId, i],
            "ncclAllReduce": [vp, vp, sz, i, i, vp, vp],
            "ncclBroadcast": [vp, vp, sz, i, i, vp, vp],
            "ncclCommAbort": [vp],
            "ncclCommDestroy": [vp],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: {self.lib.ncclGetErrorString(rc).decode()} (ncclResult {rc})")

    def version(self) -> int:
        v = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES))

    def comm_init_rank(self, world_size: int, unique_id: bytes, rank: int) -> ctypes.c_void_p:
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, NCCL_UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self._check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        return comm

    def all_reduce_sum_f32(
        self, comm: ctypes.c_void_p, tensor: torch.Tensor, stream: torch.cuda.Stream
    ) -> None:
        ptr = ctypes.c_void_p(tensor.data_ptr())
        rc = self.lib.ncclAllReduce(
            ptr, ptr, tensor.numel(), _NCCL_FLOAT32, _NCCL_SUM, comm, ctypes.c_void_p(stream.cuda_stream)
        )
        self._check(rc, "ncclAllReduce")

    def broadcast_uint8(self, comm: ctypes.c_void_p, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        ptr = ctypes.c_void_p(tensor.data_ptr())
        rc = self.lib.ncclBroadcast(
            ptr, ptr, tensor.numel(), _NCCL_UINT8, 0, comm, ctypes.c_void_p(stream.cuda_stream)
        )
        self._check(rc, "ncclBroadcast")

    def comm_abort(self, comm: ctypes.c_void_p) -> None:
        self.lib.ncclCommAbort(comm)

    def comm_destroy(self, comm: ctypes.c_void_p) -> None:
        self.lib.ncclCommDestroy(comm)


def worker_init_payload(unique_id: bytes, world_size: int, bucket_bytes: int) -> dict:
    """The ``init_info`` of ``/init_weight_transfer_engine`` for vLLM's dense ``nccl`` engine.

    Unique-id rendezvous (no ``master_address``/``master_port``: the two modes are exclusive), the
    trainer at rank 0 and the workers from ``rank_offset=1``, packed buckets of ``bucket_bytes``.
    """
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    return {
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
        "rank_offset": 1,
        "world_size": world_size,
        "packed": True,
        "packed_buffer_size_bytes": bucket_bytes,
        "packed_num_buffers": PACKED_NUM_BUFFERS,
    }


class NcclSender:
    """Rank 0 of a trainer→vLLM NCCL group: mints the id, joins, and broadcasts packed buckets."""

    backend = "nccl"

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | None = None) -> None:
        self.bucket_bytes = bucket_bytes
        self.device = device
        self._lib: NcclLibrary | None = None
        self._comm: ctypes.c_void_p | None = None
        self._stream: torch.cuda.Stream | None = None
        self._unique_id: bytes | None = None

    def prepare(self, world_size: int) -> dict:
        """Load NCCL, mint a unique id and return the server-side ``init_info`` for it."""
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl weight-sync backend needs a CUDA device in the trainer process")
        self.device = self.device or torch.device("cuda", torch.cuda.current_device())
        self._abort()  # a re-init must not leak the previous communicator
        self._lib = self._lib or NcclLibrary()
        self._unique_id = self._lib.unique_id()
        return worker_init_payload(self._unique_id, world_size, self.bucket_bytes)

    def connect(self, world_size: int, deadline: float, check: Callable[[], None] | None = None) -> None:
        """Join the group as rank 0 and run vLLM's one-element warm-up ``all_reduce``."""
        assert self._lib is not None and self._unique_id is not None, "prepare() first"
        lib, uid = self._lib, self._unique_id
        with torch.cuda.device(self.device):
            self._stream = torch.cuda.Stream(device=self.device)
            device = self.device

            def init_rank() -> ctypes.c_void_p:
                # call_with_deadline runs this on a new thread, whose current device starts at 0
                torch.cuda.set_device(device)
                return lib.comm_init_rank(world_size, uid, 0)

            self._comm = call_with_deadline(init_rank, deadline, "ncclCommInitRank", check)
            warmup = torch.zeros(1, dtype=torch.float32, device=self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            lib.all_reduce_sum_f32(self._comm, warmup, self._stream)
            self._wait_event(self._record(), deadline, "NCCL warm-up all_reduce", check)

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _wait_event(
        self, event: torch.cuda.Event, deadline: float, what: str, check: Callable[[], None] | None
    ) -> None:
        while not event.query():
            if check is not None:
                check()
            if time.monotonic() > deadline:
                self._abort()
                raise TimeoutError(f"{what} did not complete in time (communicator aborted)")
            time.sleep(0.0002)

    def send(
        self, buckets: Iterable[torch.Tensor], deadline: float, check: Callable[[], None] | None = None
    ) -> int:
        """Broadcast each ``uint8`` bucket from rank 0, at most ``PACKED_NUM_BUFFERS`` in flight.

        Returns the bytes sent. Buckets on another device are copied to the sender's GPU first.
        """
        if self._comm is None or self._lib is None or self._stream is None:
            raise RuntimeError("NCCL sender is not connected")
        in_flight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        sent = 0
        with torch.cuda.device(self.device):
            for i, bucket in enumerate(buckets):
                data = bucket.to(self.device, non_blocking=True)
                # Packing ran on the current stream; the broadcast stream must see its result.
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                self._lib.broadcast_uint8(self._comm, data, self._stream)
                in_flight.append((self._record(), data))
                sent += data.numel()
                if len(in_flight) > PACKED_NUM_BUFFERS:
                    self._wait_event(in_flight.popleft()[0], deadline, f"NCCL broadcast of bucket {i}", check)
            while in_flight:
                self._wait_event(in_flight.popleft()[0], deadline, "NCCL broadcast", check)
        return sent

    def _abort(self) -> None:
        """Abort the communicator (unblocks kernels waiting on a missing peer); never blocks > 5 s."""
        comm, lib = self._comm, self._lib
        self._comm = None
        if comm is None or lib is None:
            return
        thread = threading.Thread(target=lib.comm_abort, args=(comm,), daemon=True)
        thread.start()
        thread.join(5.0)

    def disconnect(self) -> None:
        """Abort the communicator after a failure; :meth:`prepare` + :meth:`connect` start a new one."""
        self._abort()

    def close(self) -> None:
        self._abort()
