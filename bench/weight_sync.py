"""Weight-sync benchmark: the trainer's packed-bucket sender into a second process that loads the weights.

What runs, per model shape (random-init Qwen3 in bf16 from :data:`bench.packing.SHAPES`, no download):

* the **sender** (this process, the trainer side, ``cuda:0``) uses the trainer's own code: the weights are
  gathered by :func:`trainer.step.modeling.named_weights_for_sync` and ``WeightSyncClient._prepare_tensors``,
  described by :class:`~trainer.weight_sync.wire_format.TensorMeta` / ``update_info``, cut and packed lazily
  by :func:`~trainer.weight_sync.wire_format.iter_bucket_tensors` and broadcast by the trainer's
  :class:`~trainer.weight_sync.nccl.NcclSender` (``ncclBroadcast`` of ``uint8`` buckets, at most
  ``PACKED_NUM_BUFFERS`` in flight);
* the **receiver** (a spawned process, ``cuda:1``) plays vLLM's dense ``nccl`` engine: it joins the
  communicator as rank 1 with the unique id from the sender's ``init_info``, runs the one-element float32
  ``all_reduce`` handshake, then for every round takes the ``update_info``, cuts the byte stream with the
  same :func:`~trainer.weight_sync.wire_format.plan_buckets` rule, receives each bucket into a fresh buffer on
  one of ``packed_num_buffers`` streams (double buffering: a slot's stream is waited for before it is
  reused), unpacks it and copies every tensor into its own model by HF name (``param.data.copy_``, as a
  ``load_weights`` would; tied ``lm_head``/``embed_tokens`` share one parameter, so loading the embedding
  updates both). The unique id travels over a multiprocessing pipe (on the real system: HTTP).

Measured per shape and bucket size (medians over ``--reps`` rounds, after ``--warmup`` rounds):

* ``raw_s``: one broadcast of a single preallocated ``uint8`` buffer of the payload's size through the
  same sender and communicator: from the sender starting it until the receiver saw it complete;
* ``sync_s``: a whole round, from the sender starting to gather until the receiver finished loading
  (its last stream drained). Both processes read ``time.monotonic`` (``CLOCK_MONOTONIC``, one clock for the
  whole host), so the receiver's finish time is compared with the sender's start directly; a pipe barrier
  (the receiver's ``ready``) precedes every round and a ``done`` message ends it (``sync_acked_s`` is the
  sender's own view including that message);
* phases: sender gather / update_info / pack (device time of the packing kernels) / send (wall time of
  ``send``, which packs lazily, so it includes packing); receiver parse / receive (device time from
  enqueuing a bucket's receive until the bytes landed, so it includes waiting for the sender) /
  unpack+load (device time of the copies);
* ``ratio`` = ``sync_s / raw_s`` (target: under 4) and GB/s = payload bytes / time / 1e9.

After the last round of every configuration the sender broadcasts each of its parameters once more,
unpacked and one by one, and the receiver compares its own parameters with them byte for byte (and checks
that its tied parameters are still tied); any difference fails the run.

The CPU mode runs the same code over gloo/TCP (the trainer's :class:`~trainer.weight_sync.gloo.GlooSender`
and a gloo receiver built like :mod:`trainer.weight_sync.cpu_engine`'s), on the tiny shape.

Every wait is bounded (``--timeout`` seconds; the senders have their own deadlines), the receiver is killed
when the sender fails, a watchdog ends a wedged run, and a failure exits nonzero with the error in the JSON.

Run from the repository root::

    python -m bench.weight_sync --out bench/results/weight-sync-h200.json          # 2 GPUs, NCCL
    python -m bench.weight_sync --device cpu --backend gloo --tiny --out /tmp/ws.json  # CPU smoke run
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import faulthandler
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.weight_sync import gloo
from trainer.weight_sync.client import WeightSyncClient
from trainer.weight_sync.deadline import call_with_deadline
from trainer.weight_sync.nccl import PACKED_NUM_BUFFERS, NcclLibrary, NcclSender
from trainer.weight_sync.wire_format import (
    TensorMeta,
    iter_bucket_tensors,
    metas_from_update_info,
    plan_buckets,
    unpack,
    update_info,
)

# transformers and the modules built on it (bench.packing, trainer.step.modeling) are imported where they are
# first needed, after the receiver is spawned: importing them takes seconds, and this way both processes
# import them at the same time instead of one after the other.

TARGET_RATIO = 4.0  # the goal: a whole sync under 4x the raw broadcast of its payload
WORLD_SIZE = 2  # the trainer (rank 0) and one receiving worker (rank 1)
MIB = 2**20
# Seeds of the receiver's initial weights and of the sender's per-round weights never coincide, so a
# receiver that loaded nothing (or a stale round) cannot match the sender.
_RECEIVER_SEED = 999_999
_SPIN_S = 0.05  # CUDA waits spin this long before sleeping between polls (a bucket takes ~ms)


# ------------------------------------------------------------------------------------ messages
class PeerError(RuntimeError):
    """The other process failed (its traceback is in the message), went away, or broke the protocol."""


class Channel:
    """One end of the pipe between the two processes: ``(kind, payload)`` messages, every wait bounded.

    ``alive`` says whether the other process still runs. Messages that arrive while this side waits on
    something else (the receiver's ``done`` while the sender still polls its last broadcast) are kept in
    order; an ``error`` message is raised as :class:`PeerError` as soon as it is read.
    """

    def __init__(self, conn: Connection, alive: Callable[[], bool], timeout_s: float) -> None:
        self.conn = conn
        self.alive = alive
        self.timeout_s = timeout_s
        self._inbox: deque[tuple[str, Any]] = deque()

    def send(self, kind: str, payload: Any = None) -> None:
        self.conn.send((kind, payload))

    def _pull(self, wait_s: float) -> bool:
        """Read one message into the inbox if one arrives within ``wait_s`` seconds."""
        if not self.conn.poll(wait_s):
            return False
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise PeerError("the other process closed the pipe (it exited or crashed)") from exc
        if kind == "error":
            raise PeerError(f"the other process failed:\n{payload}")
        self._inbox.append((kind, payload))
        return True

    def check(self) -> None:
        """Raise if the other process reported an error or died; the senders' ``check`` callback."""
        drained = True
        while drained:  # take every message already waiting, without blocking
            drained = self._pull(0)
        if not self.alive():
            raise PeerError("the other process is gone")

    def receive(self, timeout_s: float | None = None) -> tuple[str, Any]:
        """The next ``(kind, payload)`` message of any kind, waiting at most ``timeout_s`` seconds."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while not self._inbox:
            if self._pull(min(0.05, max(0.0, deadline - time.monotonic()))):
                break
            if not self.alive():
                raise PeerError("the other process is gone")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no message from the other process within {limit:.0f} s")
        return self._inbox.popleft()

    def expect(self, kind: str, timeout_s: float | None = None) -> Any:
        """The payload of the next message, which must be of ``kind``; bounded by ``timeout_s``."""
        try:
            got, payload = self.receive(timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"waiting for {kind!r}: {exc}") from None
        if got != kind:
            raise PeerError(f"protocol error: expected {kind!r}, got {got!r}")
        return payload


# --------------------------------------------------------------------------------------- clocks
class WallClock:
    """Host timing for the CPU path: a mark is ``time.perf_counter()`` seconds."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        """Nothing runs asynchronously on the CPU path."""


class CudaClock:
    """Device timing: a mark is a timing event recorded on the current stream.

    Read marks (:meth:`seconds`) only once the work they bracket has completed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        """Wait for the device; only called when no NCCL operation can be pending (it could hang)."""
        torch.cuda.synchronize(self.device)


Clock = WallClock | CudaClock


def wait_event(event: torch.cuda.Event, deadline: float, what: str, on_timeout: Callable[[], None]) -> None:
    """Poll a CUDA ``event`` until it completes or ``deadline`` (``time.monotonic()``) passes.

    Spins for the first :data:`_SPIN_S` seconds (a bucket completes within milliseconds, and a sleeping
    poll would add its wake-up latency to every measured finish time), then sleeps 0.2 ms between polls.
    On timeout calls ``on_timeout`` (abort the communicator, so no kernel stays wedged) and raises
    ``TimeoutError``.
    """
    spin_until = time.monotonic() + _SPIN_S
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            on_timeout()
            raise TimeoutError(f"{what} did not complete in time (communicator aborted)")
        if now > spin_until:
            time.sleep(0.0002)


# ------------------------------------------------------------------------------- wire: receiver
class Receiver(Protocol):
    """The receiving end of one transport, as the shared round loop (:func:`receive_round`) uses it."""

    num_slots: int
    clock: Clock

    def connect(self, init_info: dict, deadline: float) -> None: ...

    def slot(self, index: int, deadline: float) -> contextlib.AbstractContextManager[None]: ...

    def empty(self, nbytes: int) -> torch.Tensor: ...

    def start(self, buffer: torch.Tensor) -> Any: ...

    def finish(self, pending: Any, deadline: float) -> None: ...

    def drain(self, deadline: float) -> None: ...

    def close(self) -> None: ...


class NcclReceiver:
    """Rank 1 of the sender's NCCL group, as vLLM's dense ``nccl`` engine joins it.

    ``packed_num_buffers`` streams ("slots") take turns: a bucket's receive and its loads are queued on
    one slot's stream, and before a slot is reused the host waits for its previous bucket (an event
    fence), so at most that many buckets are in flight.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock = CudaClock(device)
        self.lib = NcclLibrary()
        self.comm: ctypes.c_void_p | None = None
        self.num_slots = PACKED_NUM_BUFFERS
        self._streams: list[torch.cuda.Stream] = []
        self._fences: list[torch.cuda.Event | None] = []

    def connect(self, init_info: dict, deadline: float) -> None:
        """``ncclCommInitRank`` with the sender's unique id, then vLLM's warm-up ``all_reduce``."""
        unique_id = base64.b64decode(init_info["nccl_unique_id_b64"])
        rank = int(init_info["rank_offset"])  # worker rank 0 of a one-worker server
        world_size = int(init_info["world_size"])
        self.num_slots = int(init_info.get("packed_num_buffers", PACKED_NUM_BUFFERS))
        self._streams = [torch.cuda.Stream(device=self.device) for _ in range(self.num_slots)]
        self._fences = [None] * self.num_slots

        def init() -> ctypes.c_void_p:
            # NCCL binds the communicator to the calling thread's current device, and this runs on a
            # fresh thread, whose current device is 0 until set.
            torch.cuda.set_device(self.device)
            return self.lib.comm_init_rank(world_size, unique_id, rank)

        self.comm = call_with_deadline(init, deadline, "receiver ncclCommInitRank")
        warmup = torch.zeros(1, dtype=torch.float32, device=self.device)
        with self.slot(0, deadline):
            self.lib.all_reduce_sum_f32(self.comm, warmup, torch.cuda.current_stream(self.device))
        self.drain(deadline)

    @contextlib.contextmanager
    def slot(self, index: int, deadline: float) -> Iterator[None]:
        """Run the body on slot ``index``'s stream, after that slot's previous work has completed."""
        fence = self._fences[index]
        if fence is not None:
            wait_event(fence, deadline, f"receive slot {index}", self.abort)
        stream = self._streams[index]
        # Inputs made on the default stream (allocations, the warm-up tensor) must be visible.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield
            fence = torch.cuda.Event()
            fence.record(stream)
            self._fences[index] = fence

    def empty(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` buffer on the receiving GPU, allocated on the current stream (the slot's)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def start(self, buffer: torch.Tensor) -> None:
        """Queue the receive of ``buffer`` (broadcast from rank 0) on the current stream."""
        assert self.comm is not None, "connect() first"
        self.lib.broadcast_uint8(self.comm, buffer, torch.cuda.current_stream(self.device))

    def finish(self, pending: None, deadline: float) -> None:
        """Nothing to wait for: work queued later on the same stream runs after the receive."""

    def drain(self, deadline: float) -> None:
        """Wait until every slot's queued work has completed."""
        for index, fence in enumerate(self._fences):
            if fence is not None:
                wait_event(fence, deadline, f"receive slot {index}", self.abort)

    def abort(self) -> None:
        """Abort the communicator (unblocks kernels waiting on a missing peer); never blocks > 5 s."""
        comm, self.comm = self.comm, None
        if comm is not None:
            thread = threading.Thread(target=self.lib.comm_abort, args=(comm,), daemon=True)
            thread.start()
            thread.join(5.0)

    def close(self) -> None:
        self.abort()


class GlooReceiver:
    """Rank 1 of the sender's gloo group, joined as :mod:`trainer.weight_sync.cpu_engine` joins it.

    gloo receives are synchronous, so one slot suffices and the slot/drain fences are no-ops.
    """

    num_slots = 1

    def __init__(self) -> None:
        self.clock = WallClock()
        self._store: Any = None
        self._group: Any = None

    def connect(self, init_info: dict, deadline: float) -> None:
        rank, world_size = int(init_info["rank_offset"]), int(init_info["world_size"])
        timeout_s = float(init_info["timeout_s"])

        def join() -> tuple[Any, Any]:
            store = gloo.open_store(
                master_address=init_info["master_address"],
                master_port=int(init_info["master_port"]),
                rank=rank,
                world_size=world_size,
                timeout_s=timeout_s,
            )
            group = gloo.build_group(
                store,
                group_name=init_info["group_name"],
                rank=rank,
                world_size=world_size,
                timeout_s=timeout_s,
                local_address=gloo.local_address_towards(init_info["master_address"]),
            )
            return store, group

        self._store, self._group = call_with_deadline(join, deadline, "receiver gloo rendezvous")

    def slot(self, index: int, deadline: float) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def start(self, buffer: torch.Tensor) -> Any:
        """Post the receive of ``buffer``; returns the gloo ``Work`` to :meth:`finish`."""
        return self._group.broadcast(buffer, 0)

    def finish(self, pending: Any, deadline: float) -> None:
        gloo.wait_work(pending, deadline, "gloo receive")

    def drain(self, deadline: float) -> None:
        """Receives already completed in :meth:`finish`."""

    def close(self) -> None:
        self._group = None
        self._store = None


def make_sender(backend: str, device: torch.device, timeout_s: float) -> NcclSender | gloo.GlooSender:
    """The trainer's sender for ``backend`` (its bucket size is set per configuration)."""
    if backend == "nccl":
        return NcclSender(device=device)
    return gloo.GlooSender(master_address="127.0.0.1", master_port=0, timeout_s=timeout_s)


# ------------------------------------------------------------------------------ weights, checks
def gather(model: torch.nn.Module, client: WeightSyncClient) -> list[tuple[str, torch.Tensor]]:
    """The round's ``(HF name, tensor)`` pairs exactly as the trainer makes them.

    ``AsyncGRPOTrainer._sync_weights`` lists :func:`named_weights_for_sync` (tied parameters once, DTensor
    shards gathered) and ``WeightSyncClient.sync`` passes them through ``_prepare_tensors`` (detach,
    ``wire_dtype``). That step is private; the client is never connected and makes no HTTP call here.
    """
    from trainer.step.modeling import merged_adapter, named_weights_for_sync  # late import, see top

    with torch.no_grad(), merged_adapter(model):
        named = list(named_weights_for_sync(model))
    return client._prepare_tensors(named)


def describe(pairs: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """Wire metadata of ``pairs``, built as ``WeightSyncClient.sync`` builds it."""
    return [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in pairs]


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter fresh N(0, 0.02) values from ``seed`` (a stand-in for an optimizer step), so
    every round moves new bits and a skipped or stale load cannot pass the final comparison."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for param in model.parameters():
        param.normal_(0.0, 0.02, generator=generator)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor``'s bytes (a copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def load_weights(targets: Mapping[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each received ``(HF name, tensor)`` into the receiver's parameter of that name.

    ``targets`` maps every parameter name, tied aliases included, to its parameter. Shape and dtype
    must match exactly (``copy_`` would silently broadcast or convert). Returns the tensors loaded.
    """
    count = 0
    for name, tensor in weights:
        param = targets.get(name)
        if param is None:
            raise KeyError(f"the receiver's model has no parameter {name!r}")
        if param.shape != tensor.shape or param.dtype != tensor.dtype:
            raise ValueError(
                f"{name}: received {tuple(tensor.shape)} {tensor.dtype}, the receiver holds "
                f"{tuple(param.shape)} {param.dtype}"
            )
        param.data.copy_(tensor)
        count += 1
    return count


def mismatch(name: str, expected: torch.Tensor, actual: torch.Tensor | None) -> str | None:
    """Why ``actual`` is not bit for bit ``expected`` (None when it is).

    Compares raw bytes, so ``-0.0`` vs ``0.0`` differ and identical NaNs match, unlike value equality.
    """
    if actual is None:
        return f"{name}: missing on the receiver"
    if actual.dtype != expected.dtype:
        return f"{name}: dtype {actual.dtype} on the receiver, {expected.dtype} on the sender"
    if actual.shape != expected.shape:
        return f"{name}: shape {tuple(actual.shape)} on the receiver, {tuple(expected.shape)} on the sender"
    got, want = raw_bytes(actual), raw_bytes(expected.to(actual.device))
    if torch.equal(got, want):
        return None
    width = max(actual.dtype.itemsize, 1)
    differing = int(got.view(-1, width).ne(want.view(-1, width)).any(dim=1).sum())
    return f"{name}: {differing} of {actual.numel()} elements differ"


def compare_parameters(
    expected: Iterable[tuple[str, torch.Tensor]], actual: Mapping[str, torch.Tensor]
) -> list[str]:
    """Every difference between the sender's ``expected`` parameters and the receiver's ``actual`` ones.

    ``expected`` is consumed completely (it may be a stream of received tensors); names only the
    receiver has are reported too. An empty list means bit-exact equality.
    """
    problems, seen = [], set()
    for name, tensor in expected:
        seen.add(name)
        problem = mismatch(name, tensor, actual.get(name))
        if problem:
            problems.append(problem)
    problems.extend(f"{name}: only on the receiver" for name in actual if name not in seen)
    return problems


def tie_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (tied embeddings), e.g. ``[["lm_head.weight", ...]]``."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


# ----------------------------------------------------------------------------- receiver process
@dataclass(frozen=True)
class ReceiverOptions:
    """How the spawned receiver runs: ``backend`` (nccl/gloo), ``device`` (``cuda:1``/``cpu``), the bound
    on each wait and on its whole life (seconds), CPU threads, and ``corrupt`` (testing only: flip one
    bit of one loaded parameter before each verification, which must then fail)."""

    backend: str
    device: str
    timeout_s: float
    hard_limit_s: float
    cpu_threads: int
    corrupt: bool = False


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no receiver outlives a killed run."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def receiver_main(conn: Connection, options: ReceiverOptions) -> None:
    """Entry point of the receiving process: serve the sender's commands until ``exit``.

    Any failure is sent to the sender as an ``error`` message with its traceback; the process then
    exits 1 at once (``os._exit``: NCCL teardown after an abort must not be able to hang it).
    """
    _die_with_parent()
    faulthandler.dump_traceback_later(options.hard_limit_s, exit=True)
    parent = os.getppid()
    channel = Channel(conn, alive=lambda: os.getppid() == parent, timeout_s=options.timeout_s)
    code = 0
    transport: Receiver | None = None
    try:
        import bench.packing  # noqa: F401  late import (see top), now, while the sender imports it too

        device = torch.device(options.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(options.cpu_threads)
        transport = NcclReceiver(device) if options.backend == "nccl" else GlooReceiver()
        ReceiverLoop(channel, transport, device, options).serve()
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if transport is not None:
            with contextlib.suppress(Exception):
                transport.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def receive_round(
    transport: Receiver, targets: Mapping[str, torch.Tensor], info: dict, bucket_bytes: int, deadline: float
) -> dict[str, float]:
    """Receive and load one round described by ``info`` (an ``update_info``); returns phase seconds.

    The shared loop of both transports: cut the metadata with :func:`plan_buckets`, then per bucket on
    slot ``k % num_slots``: allocate, receive, unpack, load; finally drain every slot.
    """
    clock = transport.clock
    t_parse = time.perf_counter()
    metas = metas_from_update_info(info)
    plan = plan_buckets([m.nbytes for m in metas], bucket_bytes)
    parse_s = time.perf_counter() - t_parse
    spans = []
    held: list[torch.Tensor | None] = [None] * transport.num_slots
    for k, indices in enumerate(plan):
        bucket_metas = [metas[i] for i in indices]
        slot = k % transport.num_slots
        with transport.slot(slot, deadline):
            start = clock.mark()
            buffer = transport.empty(sum(m.nbytes for m in bucket_metas))
            transport.finish(transport.start(buffer), deadline)
            received = clock.mark()
            load_weights(targets, unpack(buffer, bucket_metas))
            loaded = clock.mark()
        # Keep the buffer until its slot is reused: the slot's stream may still be reading it.
        held[slot] = buffer
        spans.append((start, received, loaded))
    transport.drain(deadline)
    done_ts = time.monotonic()
    return {
        "done_ts": done_ts,
        "parse_s": parse_s,
        "recv_s": sum(clock.seconds(a, b) for a, b, _ in spans),
        "load_s": sum(clock.seconds(b, c) for _, b, c in spans),
        "buckets": len(plan),
    }


class ReceiverLoop:
    """The receiver's command loop: ``connect``, ``model``, ``raw``, ``sync``, ``verify``, ``exit``."""

    def __init__(
        self, channel: Channel, transport: Receiver, device: torch.device, options: ReceiverOptions
    ) -> None:
        self.channel = channel
        self.transport = transport
        self.device = device
        self.options = options
        self.model: torch.nn.Module | None = None

    def deadline(self) -> float:
        return time.monotonic() + self.options.timeout_s

    def serve(self) -> None:
        handlers = {
            "connect": self.connect,
            "model": self.build,
            "raw": self.raw,
            "sync": self.sync,
            "verify": self.verify,
        }
        while True:
            # The sender may spend long between commands (building a 1.7B model); the pipe's EOF and
            # the parent check still end this wait at once if the sender goes away.
            kind, payload = self.channel.receive(self.options.hard_limit_s)
            if kind == "exit":
                return
            if kind not in handlers:
                raise PeerError(f"unknown command {kind!r}")
            handlers[kind](payload)

    def connect(self, init_info: dict) -> None:
        self.transport.connect(init_info, self.deadline())
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor()
        self.channel.send("connected", {"device": str(self.device), "device_name": name, "pid": os.getpid()})

    def build(self, shape: str) -> None:
        """Replace the model by a fresh one of ``shape``, with weights the sender never has."""
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        started = time.perf_counter()
        from bench.packing import build_model  # late import, see top

        self.model = build_model(shape, self.device)
        randomize(self.model, _RECEIVER_SEED)
        self.transport.clock.synchronize()
        self.channel.send("model_ready", {"build_s": time.perf_counter() - started})

    def raw(self, payload: dict) -> None:
        """Receive ``rounds`` broadcasts of one preallocated ``nbytes`` buffer (the raw baseline).

        The receive is queued (posted) before ``ready`` so the transfer starts as soon as the sender does.
        """
        clock = self.transport.clock
        buffer = self.transport.empty(int(payload["nbytes"]))
        clock.synchronize()
        for _ in range(int(payload["rounds"])):
            deadline = self.deadline()
            with self.transport.slot(0, deadline):
                start = clock.mark()
                pending = self.transport.start(buffer)
                self.channel.send("ready")
                self.transport.finish(pending, deadline)
                end = clock.mark()
            self.transport.drain(deadline)
            done_ts = time.monotonic()
            self.channel.send("done", {"done_ts": done_ts, "device_s": clock.seconds(start, end)})
        del buffer

    def sync(self, payload: dict) -> None:
        """Serve ``rounds`` sync rounds with buckets of ``bucket_bytes``."""
        assert self.model is not None, "model first"
        for _ in range(int(payload["rounds"])):
            self.channel.send("ready")
            # Like vLLM's /update_weights, the round starts when the metadata arrives.
            info = self.channel.expect("update_info", self.options.timeout_s)
            got_info_ts = time.monotonic()
            targets = dict(self.model.named_parameters(remove_duplicate=False))
            phases = receive_round(
                self.transport, targets, info, int(payload["bucket_bytes"]), self.deadline()
            )
            self.channel.send("done", {**phases, "got_info_ts": got_info_ts})

    def verify(self, payload: dict) -> None:
        """Receive the sender's parameters one by one and compare them with this model's, bit for bit."""
        assert self.model is not None, "model first"
        if self.options.corrupt:
            last = list(self.model.parameters())[-1]
            raw_bytes(last.data)[:1].bitwise_xor_(1)
        metas = metas_from_update_info(payload["info"])
        transport, deadline = self.transport, self.deadline()

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            for meta in metas:
                buffer = transport.empty(meta.nbytes)
                with transport.slot(0, deadline):
                    transport.finish(transport.start(buffer), deadline)
                transport.drain(deadline)
                yield meta.name, buffer.view(meta.dtype).view(meta.shape)

        problems = compare_parameters(received(), dict(self.model.named_parameters(remove_duplicate=False)))
        ties = tie_groups(self.model)
        if ties != payload["ties"]:
            problems.append(f"tied parameters differ: receiver {ties}, sender {payload['ties']}")
        self.channel.send(
            "verified",
            {"exact_match": not problems, "checked": len(metas), "mismatches": problems[:20]},
        )


# ------------------------------------------------------------------------------- sender process
@contextlib.contextmanager
def spawn_receiver(options: ReceiverOptions) -> Iterator[Channel]:
    """Start the receiver process and yield the channel to it; on exit stop it (killed after an error)."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    process = ctx.Process(
        target=receiver_main, args=(child_conn, options), name="weight-sync-receiver", daemon=True
    )
    process.start()
    child_conn.close()  # so that the receiver's death reads as EOF here
    channel = Channel(parent_conn, alive=process.is_alive, timeout_s=options.timeout_s)
    clean = False
    try:
        yield channel
        clean = True
    finally:
        if clean:
            with contextlib.suppress(OSError):
                channel.send("exit")
            process.join(30)
        if process.is_alive():
            process.terminate()
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)
        parent_conn.close()


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def timed_buckets(
    buckets: Iterator[tuple[range, torch.Tensor]], clock: Clock, spans: list[tuple[Any, Any]]
) -> Iterator[torch.Tensor]:
    """Yield each packed bucket of ``buckets``, appending clock marks around its packing to ``spans``."""
    while True:
        start = clock.mark()
        item = next(buckets, None)
        if item is None:
            return
        spans.append((start, clock.mark()))
        yield item[1]


@dataclass
class SenderSide:
    """What the sender's measurements need: the pipe, the trainer's sender and client, timing."""

    channel: Channel
    sender: NcclSender | gloo.GlooSender
    client: WeightSyncClient
    clock: Clock
    timeout_s: float

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def raw_round(self, payload: torch.Tensor) -> dict[str, float]:
        """One broadcast of the preallocated ``payload`` buffer; seconds until the receiver had it."""
        self.channel.expect("ready")
        t0 = time.monotonic()
        self.sender.send([payload], self.deadline(), self.channel.check)
        t_sent = time.monotonic()
        done = self.channel.expect("done")
        return {"raw_s": done["done_ts"] - t0, "sender_s": t_sent - t0, "receiver_device_s": done["device_s"]}

    def sync_round(self, model: torch.nn.Module) -> dict[str, float]:
        """One whole round (gather, update_info, pack + send) timed against the receiver's finish."""
        self.channel.expect("ready")
        t0 = time.monotonic()
        pairs = gather(model, self.client)
        metas = describe(pairs)
        t_gathered = time.monotonic()
        self.channel.send("update_info", update_info(metas))
        t_info = time.monotonic()
        spans: list[tuple[Any, Any]] = []
        buckets = timed_buckets(
            iter_bucket_tensors(pairs, metas, self.sender.bucket_bytes), self.clock, spans
        )
        self.sender.send(buckets, self.deadline(), self.channel.check)
        t_sent = time.monotonic()
        done = self.channel.expect("done")
        t_acked = time.monotonic()
        self.clock.synchronize()  # every broadcast completed, so the pack marks are readable
        return {
            "sync_s": done["done_ts"] - t0,
            "sync_acked_s": t_acked - t0,
            "sender_gather_s": t_gathered - t0,
            "sender_update_info_s": t_info - t_gathered,
            "sender_pack_s": sum(self.clock.seconds(a, b) for a, b in spans),
            "sender_send_s": t_sent - t_info,
            "receiver_start_lag_s": done["got_info_ts"] - t0,
            "receiver_parse_s": done["parse_s"],
            "receiver_recv_s": done["recv_s"],
            "receiver_load_s": done["load_s"],
            "receiver_host_s": done["done_ts"] - done["got_info_ts"],
            "buckets": done["buckets"],
        }

    def verify(self, model: torch.nn.Module) -> dict[str, Any]:
        """Send every parameter (tied aliases too) unpacked, one broadcast each; the receiver compares."""
        named = list(model.named_parameters(remove_duplicate=False))
        info = update_info(describe([(n, p.detach()) for n, p in named]))
        self.channel.send("verify", {"info": info, "ties": tie_groups(model)})
        self.sender.send((raw_bytes(p) for _, p in named), self.deadline(), self.channel.check)
        return self.channel.expect("verified")


def measure_raw(side: SenderSide, nbytes: int, device: torch.device, warmup: int, reps: int) -> dict:
    """Median seconds of a raw ``nbytes`` broadcast (preallocated buffer, same communicator)."""
    side.channel.send("raw", {"nbytes": nbytes, "rounds": warmup + reps})
    payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
    side.clock.synchronize()
    rounds = [side.raw_round(payload) for _ in range(warmup + reps)][warmup:]
    del payload
    samples = [r["raw_s"] for r in rounds]
    return {
        "raw_s": _median(samples),
        "raw_gbps": nbytes / _median(samples) / 1e9,
        "raw_sender_s": _median([r["sender_s"] for r in rounds]),
        "raw_receiver_device_s": _median([r["receiver_device_s"] for r in rounds]),
        "raw_samples_s": samples,
    }


def measure_sync(
    side: SenderSide, model: torch.nn.Module, bucket_bytes: int, warmup: int, reps: int, seed: int
) -> dict:
    """Medians over ``reps`` whole rounds with buckets of ``bucket_bytes`` (fresh weights each round)."""
    side.sender.bucket_bytes = bucket_bytes
    side.channel.send("sync", {"bucket_bytes": bucket_bytes, "rounds": warmup + reps})
    rounds = []
    for r in range(warmup + reps):
        randomize(model, seed + r)
        side.clock.synchronize()  # no NCCL work is pending between rounds
        rounds.append(side.sync_round(model))
    rounds = rounds[warmup:]
    samples = [r["sync_s"] for r in rounds]
    phases = {key: _median([r[key] for r in rounds]) for key in rounds[0] if key not in ("sync_s", "buckets")}
    return {"sync_s": _median(samples), "sync_samples_s": samples, "phases": phases}


# ----------------------------------------------------------------------------------- reporting
def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def table(results: list[dict]) -> str:
    """The results as a Markdown table (milliseconds, GB/s)."""
    lines = [
        "| shape | bucket MiB | buckets | payload GB | raw ms | sync ms | ratio | sync GB/s "
        "| gather / pack / send ms | recv / load ms | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["phases"]
        lines.append(
            f"| {r['shape']} | {r['bucket_mb']:g} | {r['bucket_count']} | {r['payload_bytes'] / 1e9:.3f} "
            f"| {r['raw_s'] * 1e3:.2f} | {r['sync_s'] * 1e3:.2f} | {r['ratio']:.2f} | {r['sync_gbps']:.1f} "
            f"| {p['sender_gather_s'] * 1e3:.2f} / {p['sender_pack_s'] * 1e3:.2f} / {p['sender_send_s'] * 1e3:.2f} "
            f"| {p['receiver_recv_s'] * 1e3:.2f} / {p['receiver_load_s'] * 1e3:.2f} "
            f"| {'yes' if r['exact_match'] else 'NO'} |"
        )
    return "\n".join(lines)


def best_per_shape(results: list[dict]) -> dict[str, dict]:
    """Per shape, the bucket size with the lowest median sync time."""
    best: dict[str, dict] = {}
    for r in results:
        if r["shape"] not in best or r["sync_s"] < best[r["shape"]]["sync_s"]:
            best[r["shape"]] = {k: r[k] for k in ("bucket_mb", "sync_s", "raw_s", "ratio", "sync_gbps")}
    for entry in best.values():
        entry["within_target"] = entry["ratio"] < TARGET_RATIO
    return best


def nccl_library() -> dict[str, str]:
    """Which NCCL library the trainer's sender loads and its version, e.g. ``"2.27.3"``."""
    lib = NcclLibrary()
    major, rest = divmod(lib.version(), 10000)
    minor, patch = divmod(rest, 100)
    return {"path": lib.path, "version": f"{major}.{minor}.{patch}"}


def environment(args: argparse.Namespace, sender_device: torch.device) -> dict[str, Any]:
    """Versions, devices and settings of this run, for the JSON's ``meta``."""
    import transformers  # late import, see top

    cuda = sender_device.type == "cuda"
    return {
        "command": " ".join(["python -m bench.weight_sync", *args.argv]),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "backend": args.backend,
        "sender_device": str(sender_device),
        "sender_device_name": torch.cuda.get_device_name(sender_device) if cuda else platform.processor(),
        "nccl": nccl_library() if args.backend == "nccl" else None,
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "peer_access": (
            torch.cuda.can_device_access_peer(args.gpu_indices[0], args.gpu_indices[1]) if cuda else None
        ),
        "dtype": "bfloat16",
        "packed_num_buffers": PACKED_NUM_BUFFERS,
        "warmup_rounds": args.warmup,
        "timed_rounds": args.reps,
        "timeout_s": args.timeout,
        "time_budget_s": args.time_budget,
        "hard_limit_s": args.hard_limit_s,
        "clock": "time.monotonic (CLOCK_MONOTONIC, shared by both processes on one host)",
        "target_ratio": TARGET_RATIO,
    }


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--backend", default=None, choices=("nccl", "gloo"), help="default: nccl on cuda")
    parser.add_argument("--gpus", default="0,1", help="sender,receiver CUDA indices (the sender must be 0)")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape only (CPU smoke run)")
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b")
    parser.add_argument(
        "--bucket-mb",
        default=None,
        help="bucket sizes in MiB, comma-separated (default 64,256,1024; tiny 0.0625,1)",
    )
    parser.add_argument("--reps", type=int, default=20, help="timed rounds per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound on each wait, seconds")
    parser.add_argument(
        "--time-budget", type=float, default=300.0, help="skip configurations started after this many seconds"
    )
    parser.add_argument("--corrupt-receiver", action="store_true", help=argparse.SUPPRESS)  # tests only
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if (args.backend == "nccl") != (args.device == "cuda"):
        parser.error("nccl needs --device cuda, gloo needs --device cpu")
    args.shape_list = ["tiny"] if args.tiny else [s for s in args.shapes.split(",") if s]
    default_buckets = "0.0625,1" if args.tiny else "64,256,1024"
    args.bucket_list = [float(b) for b in (args.bucket_mb or default_buckets).split(",") if b]
    args.gpu_indices = [int(i) for i in args.gpus.split(",")]
    if args.device == "cuda" and (len(args.gpu_indices) != 2 or args.gpu_indices[0] != 0):
        # NcclSender.connect runs ncclCommInitRank on a fresh thread, whose current device is 0.
        parser.error("--gpus must be '0,N': the trainer's NcclSender creates its communicator on device 0")
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    return args


def run(args: argparse.Namespace, report: dict, started: float, out: Path) -> None:
    """Measure every (shape, bucket size) in order, writing ``out`` after each; raises on any failure."""
    cuda = args.device == "cuda"
    if cuda:
        if torch.cuda.device_count() < 2:
            raise RuntimeError(
                f"the NCCL benchmark needs 2 GPUs, this machine has {torch.cuda.device_count()}"
            )
        torch.cuda.set_device(args.gpu_indices[0])
        sender_device = torch.device("cuda", args.gpu_indices[0])
        receiver_device = f"cuda:{args.gpu_indices[1]}"
        clock: Clock = CudaClock(sender_device)
    else:
        torch.set_num_threads(1)  # two processes on a small shared CPU host
        sender_device, receiver_device, clock = torch.device("cpu"), "cpu", WallClock()
    options = ReceiverOptions(
        backend=args.backend,
        device=receiver_device,
        timeout_s=args.timeout,
        hard_limit_s=args.hard_limit_s + 30,
        cpu_threads=1,
        corrupt=args.corrupt_receiver,
    )
    client = WeightSyncClient("http://127.0.0.1:9", backend=args.backend)  # for gather(); never connects
    sender = make_sender(args.backend, sender_device, args.timeout)
    startup_s = max(args.timeout, 300.0)  # the receiver imports torch and initialises its device first
    with spawn_receiver(options) as channel:
        try:
            report["meta"] |= environment(args, sender_device)  # imports transformers, as the receiver does
            from bench.packing import SHAPES, build_model  # late import, see top

            unknown = [s for s in args.shape_list if s not in SHAPES]
            if unknown:
                raise ValueError(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
            init_info = sender.prepare(WORLD_SIZE)
            channel.send("connect", init_info)
            sender.connect(WORLD_SIZE, time.monotonic() + startup_s, channel.check)
            report["meta"]["receiver"] = channel.expect("connected", startup_s)
            print(f"[{time.monotonic() - started:6.1f}s] connected: {report['meta']['receiver']}", flush=True)
            side = SenderSide(channel, sender, client, clock, args.timeout)
            for shape_index, shape in enumerate(args.shape_list):
                if time.monotonic() - started > args.time_budget:
                    report["skipped"].append({"shape": shape, "why": "time budget"})
                    continue
                model = None
                if cuda:
                    torch.cuda.empty_cache()
                channel.send("model", shape)
                model = build_model(shape, sender_device)
                randomize(model, seed=1)
                channel.expect("model_ready", startup_s)
                metas = describe(gather(model, client))
                payload = sum(m.nbytes for m in metas)
                raw = measure_raw(side, payload, sender_device, args.warmup, args.reps)
                report["raw"][shape] = raw | {"payload_bytes": payload}
                print(
                    f"[{time.monotonic() - started:6.1f}s] {shape}: raw {raw['raw_s'] * 1e3:.2f} ms",
                    flush=True,
                )
                for bucket_index, bucket_mb in enumerate(args.bucket_list):
                    if time.monotonic() - started > args.time_budget:
                        report["skipped"].append(
                            {"shape": shape, "bucket_mb": bucket_mb, "why": "time budget"}
                        )
                        continue
                    bucket_bytes = int(bucket_mb * MIB)
                    seed = 1000 * (1 + 10 * shape_index + bucket_index)
                    sync = measure_sync(side, model, bucket_bytes, args.warmup, args.reps, seed)
                    check = side.verify(model)
                    plan = plan_buckets([m.nbytes for m in metas], bucket_bytes)
                    record = {
                        "shape": shape,
                        "params": sum(m.nbytes // m.dtype.itemsize for m in metas),
                        "payload_bytes": payload,
                        "tensor_count": len(metas),
                        "bucket_mb": bucket_mb,
                        "bucket_bytes": bucket_bytes,
                        "bucket_count": len(plan),
                        "largest_bucket_bytes": max(sum(metas[i].nbytes for i in b) for b in plan),
                        "raw_s": raw["raw_s"],
                        "raw_gbps": raw["raw_gbps"],
                        **sync,
                        "sync_gbps": payload / sync["sync_s"] / 1e9,
                        "ratio": sync["sync_s"] / raw["raw_s"],
                        "exact_match": check["exact_match"],
                        "verified_tensors": check["checked"],
                        "mismatches": check["mismatches"],
                    }
                    record["within_target"] = record["ratio"] < TARGET_RATIO
                    report["results"].append(record)
                    report["best"] = best_per_shape(report["results"])
                    report["meta"]["elapsed_s"] = time.monotonic() - started
                    write_report(out, report)
                    print(
                        f"[{time.monotonic() - started:6.1f}s] {shape} bucket {bucket_mb:g} MiB "
                        f"({len(plan)} buckets): sync {sync['sync_s'] * 1e3:.2f} ms, ratio {record['ratio']:.2f}, "
                        f"exact {check['exact_match']}",
                        flush=True,
                    )
                    if not check["exact_match"]:
                        raise AssertionError(
                            f"{shape}, {bucket_mb:g} MiB buckets: the receiver's weights differ from the "
                            f"sender's: {check['mismatches']}"
                        )
        finally:
            sender.close()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1 on any failure, with the error in the JSON)."""
    args = parse_args(argv)
    started = time.monotonic()
    # Last line of defence against a wedged run (a CUDA call blocked on a dead peer): dump every
    # thread's stack and exit. The receiver dies with this process (PR_SET_PDEATHSIG).
    args.hard_limit_s = args.time_budget + 2 * args.timeout + 60
    faulthandler.dump_traceback_later(args.hard_limit_s, exit=True, file=sys.__stderr__)
    report: dict[str, Any] = {"meta": {}, "raw": {}, "results": [], "best": {}, "skipped": [], "errors": []}
    try:
        run(args, report, started, args.out)
        report["ok"] = True
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        report["ok"] = False
        report["errors"].append(
            {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        )
        traceback.print_exc()
    finally:
        faulthandler.cancel_dump_traceback_later()
    report["meta"]["elapsed_s"] = time.monotonic() - started
    write_report(args.out, report)
    if report["results"]:
        print(table(report["results"]))
    for shape, best in report["best"].items():
        print(
            f"best {shape}: {best['bucket_mb']:g} MiB, {best['sync_s'] * 1e3:.2f} ms, ratio {best['ratio']:.2f}"
        )
    if report["skipped"]:
        print("skipped:", report["skipped"])
    print(("OK" if report["ok"] else "FAILED") + f": {args.out}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: destructors of an aborted NCCL communicator must not be able to hang exit.
    os._exit(status)
