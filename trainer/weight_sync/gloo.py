"""A two-sided gloo (TCP) transfer group, used for real weight transfer when there is no GPU.

The trainer is rank 0 and hosts the ``TCPStore``; each vLLM worker joins at ``rank_offset + its rank``.
The group is built directly from ``ProcessGroupGloo`` rather than ``torch.distributed.init_process_group``
so it never touches (or collides with) the default process group either process may already own.
Every wait is bounded by the group's timeout, so a peer that never arrives raises instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from trainer.weight_sync.deadline import call_with_deadline

BACKEND_NAME = "gloo"  # the --weight-transfer-config backend name the CPU engine registers under
# Measured on a 2-core host, 27M-param fp32 model: 4 MiB buckets 0.45 s, 64 MiB 0.89 s, 256 MiB 1.17 s;
# small buckets let the server load one while the next is on the wire.
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


def open_store(
    *, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
) -> dist.TCPStore:
    """Rank 0 hosts the rendezvous store (``master_port=0`` picks a free port, see ``store.port``);
    the others connect to it, retrying until ``timeout_s``."""
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        rank == 0,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def build_group(
    store: dist.Store, *, group_name: str, rank: int, world_size: int, timeout_s: float, local_address: str
) -> dist.ProcessGroupGloo:
    """Build the gloo group over ``store``; blocks until every rank has joined or ``timeout_s`` passes.

    Args:
        store: the rendezvous store from :func:`open_store` (keep it alive as long as the group).
        group_name: key prefix in the store, new for every rendezvous so a re-init on the same store
            never reads an earlier group's keys.
        rank, world_size: this process's rank in the transfer group and the group size.
        timeout_s: bound on the rendezvous and on every later collective, in seconds.
        local_address: the address this process's gloo pairs listen on (reachable by the peers).
    """
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank, world_size, options)


def wait_work(work: dist.Work, deadline: float, what: str, check: Callable[[], None] | None = None) -> None:
    """Wait for a gloo ``Work`` until ``deadline`` (``time.monotonic()`` seconds).

    ``check`` runs while waiting (e.g. to surface a failed HTTP call early) and may raise.
    Raises ``TimeoutError`` naming ``what`` when the deadline passes first.
    """
    pause = 0.0002
    while not work.is_completed():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete in time")
        time.sleep(pause)
        # Back off: a tight poll would take a core from the receiving server on a small CPU host.
        pause = min(pause * 2, 0.005)
    work.wait()


def broadcast_buckets(
    group: dist.ProcessGroupGloo,
    buckets: Iterable[torch.Tensor],
    deadline: float,
    check: Callable[[], None] | None = None,
) -> int:
    """Broadcast each ``uint8`` bucket from rank 0, one at a time; returns the bytes sent."""
    sent = 0
    for i, bucket in enumerate(buckets):
        cpu = bucket if bucket.device.type == "cpu" else bucket.cpu()
        wait_work(group.broadcast(cpu, 0), deadline, f"gloo broadcast of bucket {i}", check)
        sent += cpu.numel()
    return sent


def receive_bucket(group: dist.ProcessGroupGloo, nbytes: int, deadline: float) -> torch.Tensor:
    """Receive one ``uint8`` bucket of ``nbytes`` broadcast from rank 0 into a fresh CPU tensor."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    wait_work(group.broadcast(buffer, 0), deadline, f"gloo receive of a {nbytes}-byte bucket")
    return buffer


def local_address_towards(host: str) -> str:
    """The local IP address this machine uses to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((socket.gethostbyname(host), 9))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class GlooSender:
    """Rank 0 of a trainer→vLLM gloo group: hosts the store, joins, and broadcasts packed buckets.

    The store (and its port) lives until :meth:`close`; every :meth:`prepare` starts a new group on it,
    so a client can re-initialise after a failure without a new port.
    """

    backend = BACKEND_NAME

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        master_address: str,
        master_port: int = 0,
        timeout_s: float = 300.0,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = timeout_s
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroupGloo | None = None
        self._group_name = ""
        self._generation = 0

    def prepare(self, world_size: int) -> dict:
        """Host the rendezvous store (once) and return the server-side ``init_info`` for a new group."""
        self.disconnect()
        if self._store is None:
            self._store = open_store(
                master_address=self.master_address,
                master_port=self.master_port,
                rank=0,
                world_size=world_size,
                timeout_s=self.timeout_s,
            )
        self._generation += 1
        self._group_name = f"trainer-weight-sync/{os.getpid()}/{self._generation}"
        return {
            "master_address": self.master_address,
            "master_port": self._store.port,
            "group_name": self._group_name,
            "world_size": world_size,
            "rank_offset": 1,
            "timeout_s": self.timeout_s,
            "packed_buffer_size_bytes": self.bucket_bytes,
        }

    def connect(self, world_size: int, deadline: float, check: Callable[[], None] | None = None) -> None:
        """Build the group as rank 0 (returns once every worker has joined)."""
        assert self._store is not None, "prepare() first"
        store, name, address = self._store, self._group_name, self.master_address
        # The gloo constructor blocks in C++ until the peers connect (bounded by its own timeout);
        # waiting on a side thread lets `check` abort early when the server has already failed.
        timeout_s = max(0.1, min(self.timeout_s, deadline - time.monotonic()))
        self._group = call_with_deadline(
            lambda: build_group(
                store,
                group_name=name,
                rank=0,
                world_size=world_size,
                timeout_s=timeout_s,
                local_address=address,
            ),
            deadline,
            "gloo rendezvous",
            check,
        )

    def send(
        self, buckets: Iterable[torch.Tensor], deadline: float, check: Callable[[], None] | None = None
    ) -> int:
        """Broadcast the buckets; returns the bytes sent."""
        if self._group is None:
            raise RuntimeError("gloo sender is not connected")
        return broadcast_buckets(self._group, buckets, deadline, check)

    def disconnect(self) -> None:
        """Drop the current group (after a failure); the store stays for the next :meth:`prepare`."""
        self._group = None

    def close(self) -> None:
        """Drop the group and the store (frees the port)."""
        self._group = None
        self._store = None
