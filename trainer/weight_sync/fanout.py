"""Weight sync to every vLLM server of a run (``vllm_server_base_url`` naming several).

:class:`WeightSyncFanout` has :class:`~trainer.weight_sync.client.WeightSyncClient`'s interface
(``init``, ``sync``, ``close``) over one client per server, each with its own transfer group (one
NCCL or gloo group per server: a server's workers join only their own). A round prepares the
tensors once (DTensor shards gathered, ``wire_dtype`` applied), then runs every server's round on
its own thread: each server pauses, receives and resumes independently, and the step waits for all.
The round's timings are the slowest server's, per phase. A server that fails its round fails the
sync with its own error (which names its URL) once every other round has ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from trainer.weight_sync.client import WeightSyncClient

__all__ = ["WeightSyncFanout", "call_on_each", "weight_sync_client"]

T = TypeVar("T")
Item = TypeVar("Item")


def call_on_each(pool: ThreadPoolExecutor, call: Callable[[Item], T], items: Sequence[Item]) -> list[T]:
    """``call(item)`` for every item at once on ``pool``; the results in order, or the first failure
    (in item order) re-raised once every call has ended (a server's round is never left half-done)."""
    futures = [pool.submit(call, item) for item in items]
    for future in futures:
        if future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
    return [future.result() for future in futures]


class WeightSyncFanout:
    """One :class:`WeightSyncClient` per server, driven together (see the module docstring)."""

    def __init__(self, clients: Sequence[WeightSyncClient]) -> None:
        if not clients:
            raise ValueError("WeightSyncFanout needs at least one client")
        self.clients = list(clients)
        self._pool = ThreadPoolExecutor(
            max_workers=len(self.clients), thread_name_prefix="weight-sync-fanout"
        )

    @property
    def base_url(self) -> str:
        return ",".join(c.base_url for c in self.clients)

    def _each(self, call: Callable[[WeightSyncClient], T]) -> list[T]:
        return call_on_each(self._pool, call, self.clients)

    def init(self) -> None:
        """Rendezvous with every server's weight-transfer engine (in parallel)."""
        self._each(lambda client: client.init())

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def __enter__(self) -> WeightSyncFanout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> dict[str, float]:
        """One round on every server; timings (``perf/weight_sync_*``) of the slowest per phase."""
        pairs = self.clients[0]._prepare_tensors(named_tensors)  # gathered once, not once per thread
        timings = self._each(lambda client: client.sync(pairs, weight_version=weight_version))
        return {key: max(t[key] for t in timings) for key in timings[0]}


def weight_sync_client(urls: Sequence[str], *, timeout: float) -> WeightSyncClient | WeightSyncFanout:
    """The weight-sync client of a run's servers: a plain client for one, a fan-out for several."""
    clients = [WeightSyncClient(url, timeout=timeout) for url in urls]
    return clients[0] if len(clients) == 1 else WeightSyncFanout(clients)
