"""Several vLLM servers serving one run's policy, behind :class:`~trainer.rollout.vllm_client.VLLMClient`'s
interface.

A run outgrows one server (one node's GPUs, TP x DP inside it) by naming several in
``vllm_server_base_url`` (comma-separated). The rollout loop then talks to a :class:`VLLMServerPool`:

* each generation request goes to the server with the fewest requests outstanding from this
  process, skipping a server whose last ``/metrics`` reading showed its KV cache above
  :data:`~trainer.rollout.flow.LOWER_ABOVE_USAGE` while another is below it; ties go round-robin;
* what the loop reads once at startup (:class:`ServerSettings`) is the servers' combination:
  the smallest ``max_model_len``, KV capacity and data-parallel engines summed, a capability
  (sampling masks, scale-out, priority scheduling) only when every server has it;
* a load reading (:class:`ServerLoad`) is their combination as the spec defines it over engines:
  KV usage the largest, requests and preemptions summed; each server's own reading is kept for the
  request routing and ``rollout/server/<name>/...``.

A server that stops answering fails the run through its client's retries, whose error names its
URL. Weight sync reaches every server: :mod:`trainer.weight_sync.fanout`.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from trainer.reporting.metrics import ROLLOUT_SERVER_KV_CACHE_USAGE_FRAC, ROLLOUT_SERVER_REQUESTS
from trainer.rollout.flow import LOWER_ABOVE_USAGE
from trainer.rollout.types import TurnRecord
from trainer.rollout.vllm_client import (
    SamplingSettings,
    ServerLoad,
    ServerSettings,
    VLLMClient,
    VLLMRequestError,
)

__all__ = ["VLLMServerPool", "combined_load", "combined_settings", "server_label"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]+")


def server_label(base_url: str) -> str:
    """The name of a server in metric names: its ``host:port`` (``rollout/server/<label>/...``)."""
    parts = urlsplit(base_url)
    return _UNSAFE.sub("_", parts.netloc or base_url)


def combined_settings(settings: Sequence[ServerSettings], urls: Sequence[str]) -> ServerSettings:
    """What the rollout loop may assume of every server of ``settings`` (one per URL of ``urls``).

    Raises :class:`VLLMRequestError` naming both URLs when two servers would train differently
    (logprobs computed in another mode, another served dtype): their samples could not share a batch.
    """
    first = settings[0]
    for url, other in zip(urls[1:], settings[1:], strict=True):
        for field in ("logprobs_mode", "dtype"):
            mine, theirs = getattr(first, field), getattr(other, field)
            if mine is not None and theirs is not None and mine != theirs:
                raise VLLMRequestError(
                    f"vLLM servers {urls[0]} and {url} differ in {field} ({mine!r} vs {theirs!r}): every "
                    "server of one run must be started alike (same `python -m trainer serve` flags)"
                )
    kv = [s.kv_cache_tokens for s in settings]
    crashing = [s for s in settings if s.seeded_requests_crash]
    # seeded_requests_crash of the combination: any server's (its device and chunked_prefill kept).
    shape = crashing[0] if crashing else first
    logprobs = [s.max_logprobs for s in settings if s.max_logprobs is not None]
    return replace(
        first,
        max_model_len=min(s.max_model_len for s in settings),
        kv_cache_tokens=None if any(k is None for k in kv) else sum(kv),  # type: ignore[arg-type]
        return_sampling_mask=all(s.return_sampling_mask for s in settings),
        scale_out=all(s.scale_out for s in settings),
        max_logprobs=min(logprobs) if logprobs else None,
        device=shape.device,
        chunked_prefill=shape.chunked_prefill,
        data_parallel_size=sum(s.data_parallel_size for s in settings),
        priority_scheduling=all(s.priority_scheduling for s in settings),
    )


def combined_load(loads: Sequence[ServerLoad | None]) -> ServerLoad | None:
    """One reading over servers: KV usage the largest, counts summed (None: no server has ``/metrics``)."""
    seen = [load for load in loads if load is not None]
    if not seen:
        return None
    kv = [load.kv_cache_tokens for load in seen]
    return ServerLoad(
        kv_cache_usage=max(load.kv_cache_usage for load in seen),
        running=sum(load.running for load in seen),
        waiting=sum(load.waiting for load in seen),
        preemptions_total=sum(load.preemptions_total for load in seen),
        kv_cache_tokens=None if any(k is None for k in kv) else sum(kv),  # type: ignore[arg-type]
    )


class VLLMServerPool:
    """Clients of several servers used as one (see the module docstring).

    Args:
        clients: one :class:`VLLMClient` per server, all serving the same model.
        kv_cap: KV-cache usage (0..1) above which a server takes new requests only when no other
            server is below it.
    """

    def __init__(self, clients: Sequence[VLLMClient], *, kv_cap: float = LOWER_ABOVE_USAGE) -> None:
        if not clients:
            raise ValueError("VLLMServerPool needs at least one client")
        self.clients = list(clients)
        self.kv_cap = kv_cap
        self.labels = [server_label(c.base_url) for c in self.clients]
        self.outstanding = [0] * len(self.clients)  # requests sent and not answered, per server
        self.completed = [0] * len(self.clients)  # answered requests since the last record_metrics()
        self.loads: list[ServerLoad | None] = [None] * len(self.clients)
        self._turn = itertools.count()

    @property
    def base_url(self) -> str:
        return ",".join(c.base_url for c in self.clients)

    @property
    def model_name(self) -> str:
        return self.clients[0].model_name

    # The loop sets these once after reading the settings; every server gets the same.
    def _set_all(self, name: str, value: Any) -> None:
        for client in self.clients:
            setattr(client, name, value)

    use_sampling_mask = property(
        lambda self: self.clients[0].use_sampling_mask, lambda self, v: self._set_all("use_sampling_mask", v)
    )
    send_seeds = property(
        lambda self: self.clients[0].send_seeds, lambda self, v: self._set_all("send_seeds", v)
    )
    send_priority = property(
        lambda self: self.clients[0].send_priority, lambda self, v: self._set_all("send_priority", v)
    )

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def wait_for_health(self, timeout: float | None = None, poll_s: float = 1.0) -> None:
        """Every server answers ``/health``; the first that does not in ``timeout`` raises, naming it."""
        await asyncio.gather(*(c.wait_for_health(timeout, poll_s) for c in self.clients))

    async def server_settings(self) -> ServerSettings:
        settings = await asyncio.gather(*(c.server_settings() for c in self.clients))
        return combined_settings(settings, [c.base_url for c in self.clients])

    async def server_load(self) -> ServerLoad | None:
        """Read every server's ``/metrics`` (one that fails to answer keeps no reading: its requests
        retry on their own) and return the combination."""
        results = await asyncio.gather(*(c.server_load() for c in self.clients), return_exceptions=True)
        self.loads = [r if isinstance(r, ServerLoad) else None for r in results]
        return combined_load(self.loads)

    def pick(self) -> int:
        """Index of the server the next request goes to (least outstanding under the KV cap)."""
        n = len(self.clients)
        under = [i for i in range(n) if self.loads[i] is None or self.loads[i].kv_cache_usage <= self.kv_cap]
        candidates = under or list(range(n))
        start = next(self._turn) % n
        return min(candidates, key=lambda i: (self.outstanding[i], (i - start) % n))

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingSettings,
        *,
        model: str | None = None,
        seed: int | None = None,
    ) -> TurnRecord:
        index = self.pick()
        if seed is None and self.send_seeds:
            # One counter for every server: two servers never get the same seed for one prompt.
            seed = self.clients[0].next_seed()
        self.outstanding[index] += 1
        try:
            turn = await self.clients[index].generate(prompt_ids, sampling, model=model, seed=seed)
        finally:
            self.outstanding[index] -= 1
        self.completed[index] += 1
        return turn

    def record_metrics(self, window: Any) -> None:
        """``rollout/server/<label>/request_count`` (answered since the last call) and the last KV reading."""
        for i, label in enumerate(self.labels):
            window.add(ROLLOUT_SERVER_REQUESTS.format(server=label), self.completed[i])
            if self.loads[i] is not None:
                window.add(
                    ROLLOUT_SERVER_KV_CACHE_USAGE_FRAC.format(server=label), self.loads[i].kv_cache_usage
                )
        self.completed = [0] * len(self.clients)
