"""Trainer side of weight sync: drives a vLLM server's weight-transfer routes and the data transfer.

One round (:meth:`WeightSyncClient.sync`), as the spec's ``weight_sync_steps`` asks:

1. ``POST /pause?mode=keep``: the scheduler freezes; in-flight requests keep their state and continue on
   the new weights after ``/resume`` (``perf/weight_sync_pause_s``);
2. ``POST /start_weight_update``: every server worker arms layerwise reload and is ready to receive
   (``perf/weight_sync_barrier_s``);
3. ``POST /update_weights`` with the round's metadata, concurrently with the packed broadcast from this
   process, then ``POST /finish_weight_update`` (``perf/weight_sync_transfer_s``);
4. ``POST /resume``. ``perf/weight_sync_s`` is the whole round.

The data moves over NCCL (``backend="nccl"``, vLLM's built-in engine, GPU) or gloo over TCP
(``backend="gloo"``, :mod:`trainer.weight_sync.cpu_engine`, a CPU server). Every HTTP call and every
collective wait is bounded by ``timeout``; a failure raises :class:`WeightSyncError` naming the server URL.
The server needs ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": ...}'``.

A trainer killed inside a round (SIGKILL, a lost host) leaves the server paused with its update still
open: vLLM then refuses a new ``/start_weight_update`` and a ``/resume`` alone serves from layers
still on the meta device (the engine dies). :func:`close_abandoned_round` finishes such a round and
resumes; :meth:`WeightSyncClient.init` calls it, so the next trainer on a named server mends it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch

from trainer.reporting.metrics import (
    PERF_WEIGHT_SYNC_BARRIER_S,
    PERF_WEIGHT_SYNC_PAUSE_S,
    PERF_WEIGHT_SYNC_S,
    PERF_WEIGHT_SYNC_TRANSFER_S,
)
from trainer.weight_sync import gloo
from trainer.weight_sync.wire_format import TensorMeta, iter_bucket_tensors, update_info

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
# Spellings of the same dtype across torch, vLLM's --dtype and the trainer config.
_DTYPE_ALIASES = {
    "float": "float32",
    "half": "float16",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}


class WeightSyncError(RuntimeError):
    """A weight-sync step failed or timed out; the message names the server URL and the step."""


def close_abandoned_round(base_url: str, timeout: float = 30.0) -> bool:
    """If the server at ``base_url`` is paused, finish any open weight update and resume it.

    Returns True if it was paused (and is now resumed). ``/finish_weight_update`` finalises the
    layerwise reload of an update that was started and never finished, putting every layer back on
    its device with the weights it holds; on a server with no open update vLLM answers it with an
    error, which is expected here and ignored. Raises :class:`WeightSyncError` if the server cannot
    say whether it is paused or refuses to resume.
    """
    url = base_url.rstrip("/")
    try:
        response = httpx.get(f"{url}/is_paused", timeout=timeout)
        response.raise_for_status()
        paused = bool(response.json().get("is_paused"))
    except (httpx.HTTPError, ValueError) as exc:
        raise WeightSyncError(f"GET {url}/is_paused failed: {type(exc).__name__}: {exc}") from exc
    if not paused:
        return False
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/finish_weight_update", timeout=timeout)
    try:
        httpx.post(f"{url}/resume", timeout=timeout).raise_for_status()
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"POST {url}/resume failed: {type(exc).__name__}: {exc}") from exc
    return True


def _get_json(base_url: str, path: str, timeout: float) -> Any:
    url = f"{base_url.rstrip('/')}{path}"
    try:
        response = httpx.get(url, timeout=timeout)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise WeightSyncError(f"GET {url} failed: {exc}") from exc


def server_info(base_url: str, timeout: float = 30.0) -> dict:
    """The server's ``/server_info?config_format=json`` (``vllm_config``, ``vllm_env``, ``system_env``).

    Needs ``VLLM_SERVER_DEV_MODE=1``; raises :class:`WeightSyncError` naming the URL otherwise.
    """
    return _get_json(base_url, "/server_info?config_format=json", timeout)


def _normalise_dtype(dtype: str | torch.dtype | None) -> str | None:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"torch.bfloat16"`` → ``"bfloat16"``; ``"auto"``/None → None."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.").lower()
    if name == "auto":
        return None
    return _DTYPE_ALIASES.get(name, name)


def server_dtype(info: dict) -> str | None:
    """The dtype the server runs its model in (``"float32"``, ``"bfloat16"``, ...), if it says."""
    model_config = (info.get("vllm_config") or {}).get("model_config") or {}
    return _normalise_dtype(model_config.get("dtype"))


def server_backend(info: dict) -> str | None:
    """The server's ``--weight-transfer-config`` backend, or None when weight transfer is off."""
    config = (info.get("vllm_config") or {}).get("weight_transfer_config")
    return config.get("backend") if isinstance(config, dict) else None


def check_dtype(trainer_dtype: str | torch.dtype, info: dict) -> str | None:
    """A warning text when the trainer's and the server's dtypes differ, else None.

    The spec's sampler/trainer mismatch metrics assume both sides compute in the same precision; a
    difference shows up as ``sampling/sampling_logp_difference`` away from 0 at zero staleness.
    ``"auto"`` on either side cannot be compared and gives None.
    """
    ours, theirs = _normalise_dtype(trainer_dtype), server_dtype(info)
    if ours is None or theirs is None or ours == theirs:
        return None
    return (
        f"trainer dtype {ours} differs from the vLLM server's dtype {theirs}: sampler and trainer log-probs "
        f"will disagree (see sampling/sampling_logp_difference). Serve with `--dtype {ours}` or set "
        f"dtype={theirs!r} in the trainer config."
    )


# Routes whose repeat does what one call does (the server's pause state, its prefix cache): sent again
# once when the server dropped the connection unanswered. Not the weight update's own routes.
IDEMPOTENT_ROUTES = frozenset({"/pause", "/resume", "/reset_prefix_cache"})
# uvicorn (vLLM's server) closes a connection idle for 5 s; httpx kept one 5 s too, so a request sent as
# the server closed its connection was lost ("Server disconnected without sending a response", a CI
# run at the pause after a slow step). Idle connections are dropped on our side first.
KEEPALIVE_EXPIRY_S = 2.0


def vllm_http_client(timeout: float) -> httpx.Client:
    """An HTTP client for a vLLM server's control routes, its idle connections dropped before the server
    drops them (KEEPALIVE_EXPIRY_S)."""
    return httpx.Client(timeout=timeout, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))


class WeightSyncClient:
    """Pushes the trainer's weights into a running vLLM server.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds allowed for each HTTP call and each collective wait (rendezvous, transfer).
        backend: ``"gloo"`` (CPU), ``"nccl"`` (GPU), or None to use the server's configured backend.
        bucket_bytes: packed bucket size, sent to the server at :meth:`init` so both sides cut alike;
            None: the backend's default (gloo 4 MiB, nccl 256 MiB).
        master_address: address the server's workers use to reach this process (gloo rendezvous);
            default: this host's address on the route to the server.
        master_port: gloo rendezvous port; 0 picks a free one.
        wire_dtype: cast every tensor to this dtype before sending (e.g. the server's bf16 to halve the
            bytes); None sends each tensor as it is. The server converts to its own dtype on load.
        pause_mode: ``/pause`` mode; ``"keep"`` freezes in-flight requests and continues them afterwards.
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 300.0,
        backend: str | None = None,
        *,
        bucket_bytes: int | None = None,
        master_address: str | None = None,
        master_port: int = 0,
        wire_dtype: torch.dtype | None = None,
        pause_mode: str = "keep",
    ) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: must be one of {BACKENDS} or None")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.master_address = master_address
        self.master_port = master_port
        self.wire_dtype = wire_dtype
        self.pause_mode = pause_mode
        self.world_size: int | None = None
        self._sender: Any = None
        self._connected = False
        self._update_future: Future | None = None
        self._http = vllm_http_client(self.timeout)
        self._lock = threading.Lock()

    # --- HTTP ------------------------------------------------------------------------------------
    def _post(self, path: str, json: dict | None = None, timeout: float | None = None) -> None:
        url = f"{self.base_url}{path}"
        try:
            try:
                response = self._http.post(url, json=json, timeout=timeout or self.timeout)
            except httpx.RemoteProtocolError:
                # The server closed the connection without answering (a kept-alive connection it
                # dropped as the request went out): sent again once where a repeat is harmless.
                if path.split("?")[0] not in IDEMPOTENT_ROUTES:
                    raise
                logger.info("POST %s: the server dropped the connection unanswered; sending it again", url)
                response = self._http.post(url, json=json, timeout=timeout or self.timeout)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise WeightSyncError(f"POST {url} returned {response.status_code}: {response.text[:500]}")

    def _post_async(self, pool: ThreadPoolExecutor, path: str, json: dict) -> Future:
        return pool.submit(self._post, path, json)

    def _server_world_size(self) -> int:
        """Number of server workers that receive (TP × PP × DP); 1 when the server lacks the route."""
        url = f"{self.base_url}/get_world_size?include_dp=true"
        try:
            response = self._http.get(url)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 404:
            return 1
        if response.status_code >= 400:
            raise WeightSyncError(f"GET {url} returned {response.status_code}: {response.text[:500]}")
        return int(response.json()["world_size"])

    # --- lifecycle -------------------------------------------------------------------------------
    def init(self) -> None:
        """Rendezvous with the server's weight-transfer engine (``/init_weight_transfer_engine``).

        Raises :class:`WeightSyncError` naming the URL if the server is unreachable, has no weight
        transfer configured, or its workers do not join within ``timeout``. Callable again after a
        failure (or to reconnect after a server restart).
        """
        with self._lock:
            self._connected = False
            if close_abandoned_round(self.base_url, min(self.timeout, 30.0)):
                logger.warning(
                    "%s was paused (a trainer stopped inside a weight-sync round): finished that round "
                    "and resumed it",
                    self.base_url,
                )
            if self.backend is None:
                self.backend = server_backend(server_info(self.base_url, self.timeout))
                if self.backend not in BACKENDS:
                    raise WeightSyncError(
                        f"server {self.base_url} has weight transfer backend {self.backend!r}; start it with "
                        f'--weight-transfer-config \'{{"backend": "gloo"}}\' (CPU) or nccl (GPU)'
                    )
            self.world_size = 1 + self._server_world_size()
            if self._sender is None:
                self._sender = self._make_sender()
            init_info = self._sender.prepare(self.world_size)
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-init")
            try:
                future = self._post_async(pool, "/init_weight_transfer_engine", {"init_info": init_info})
                deadline = time.monotonic() + self.timeout
                try:
                    self._sender.connect(self.world_size, deadline, _raise_if_failed(future))
                except WeightSyncError:
                    self._sender.disconnect()
                    raise
                except Exception as exc:
                    self._sender.disconnect()
                    raise WeightSyncError(
                        f"weight-transfer rendezvous with {self.base_url} ({self.backend}) failed: {exc}"
                    ) from exc
                _result(future, deadline, f"POST {self.base_url}/init_weight_transfer_engine")
            finally:
                pool.shutdown(wait=False)
            self._connected = True

    def _make_sender(self) -> Any:
        if self.backend == "nccl":
            from trainer.weight_sync import nccl

            return nccl.NcclSender(self.bucket_bytes or nccl.DEFAULT_BUCKET_BYTES)
        address = self.master_address or gloo.local_address_towards(urlsplit(self.base_url).hostname or "")
        return gloo.GlooSender(
            self.bucket_bytes or gloo.DEFAULT_BUCKET_BYTES,
            master_address=address,
            master_port=self.master_port,
            timeout_s=self.timeout,
        )

    def close(self) -> None:
        """Release the transfer group here and (best effort) on the server; the client can ``init`` again."""
        with self._lock:
            if self._connected:
                with contextlib.suppress(WeightSyncError):
                    self._post("/shutdown_weight_transfer_engine", timeout=min(self.timeout, 30.0))
            if self._sender is not None:
                self._sender.close()
                self._sender = None
            self._connected = False
        self._http.close()
        self._http = vllm_http_client(self.timeout)

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- one round -------------------------------------------------------------------------------
    def _prepare_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Detach, gather DTensor shards (``full_tensor``) and apply ``wire_dtype``."""
        out = []
        for name, tensor in named_tensors:
            full = getattr(tensor, "full_tensor", None)
            t = (full() if callable(full) else tensor).detach()
            if self.wire_dtype is not None and t.is_floating_point() and t.dtype != self.wire_dtype:
                t = t.to(self.wire_dtype)
            out.append((name, t))
        return out

    def sync(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> dict[str, float]:
        """Pause the server, transfer ``named_tensors`` (HF names), resume; returns timings in seconds.

        Keys: ``perf/weight_sync_s``, ``perf/weight_sync_pause_s``, ``perf/weight_sync_barrier_s``,
        ``perf/weight_sync_transfer_s``. ``weight_version`` is recorded on the server (``/weight_info``).
        On failure the server is resumed (best effort), the transfer group is dropped (call :meth:`init`
        again) and :class:`WeightSyncError` is raised.
        """
        with self._lock:
            if not self._connected:
                raise WeightSyncError(
                    f"weight sync with {self.base_url} is not initialised: call init() first"
                )
            self._update_future = None
            pairs = self._prepare_tensors(named_tensors)
            metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in pairs]
            t0 = time.perf_counter()
            self._post(f"/pause?mode={self.pause_mode}")
            t_paused = time.perf_counter()
            try:
                self._post("/start_weight_update")
                t_ready = time.perf_counter()
            except BaseException:
                self._resume_quietly()
                raise
            try:
                self._transfer(pairs, metas, weight_version)
                t_done = time.perf_counter()
            except BaseException:
                self._connected = False
                self._sender.disconnect()
                self._recover_server()
                self._resume_quietly()
                raise
            # KV computed with the old weights must not serve new tokens: drop the prefix cache and
            # preempt in-flight requests (they recompute their KV under the new weights on resume).
            # This is why a sync shows up in rollout/vllm_preemption_count.
            self._post("/reset_prefix_cache?reset_running_requests=true")
            self._post("/resume")
            t_end = time.perf_counter()
        return {
            PERF_WEIGHT_SYNC_S: t_end - t0,
            PERF_WEIGHT_SYNC_PAUSE_S: t_paused - t0,
            PERF_WEIGHT_SYNC_BARRIER_S: t_ready - t_paused,
            PERF_WEIGHT_SYNC_TRANSFER_S: t_done - t_ready,
        }

    def _transfer(
        self, pairs: list[tuple[str, torch.Tensor]], metas: list[TensorMeta], weight_version: str | None
    ) -> None:
        """``/update_weights`` on a side thread while this thread broadcasts; then ``/finish_weight_update``."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-update")
        deadline = time.monotonic() + self.timeout
        try:
            future = self._post_async(pool, "/update_weights", {"update_info": update_info(metas)})
            self._update_future = future
            buckets = (b for _, b in iter_bucket_tensors(pairs, metas, self._sender.bucket_bytes))
            try:
                self._sender.send(buckets, deadline, _raise_if_failed(future))
            except WeightSyncError:
                raise
            except Exception as exc:
                raise WeightSyncError(
                    f"weight transfer to {self.base_url} ({self.backend}) failed: {exc}"
                ) from exc
            _result(future, deadline, f"POST {self.base_url}/update_weights")
        finally:
            # Never join the request thread: after a failed broadcast it may wait on a peer forever.
            pool.shutdown(wait=False)
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._post("/finish_weight_update", body)

    def _recover_server(self) -> None:
        """After a failed transfer, ask the server to put its kept weights back (best effort).

        vLLM's ``start_weight_update`` moves the served layers to the meta device until
        ``finish_weight_update``; a round that fails in between would leave the server unable to run.
        A fresh start + finish with nothing loaded restores the kept tensors. Only safe once the
        server's ``/update_weights`` has returned: a still-running one would serialise these calls
        behind it, and a start whose finish never arrives is exactly the broken state.
        """
        future = self._update_future
        if future is None or not future.done():
            return
        with contextlib.suppress(WeightSyncError):
            self._post("/start_weight_update", timeout=min(self.timeout, 30.0))
            self._post("/finish_weight_update", timeout=min(self.timeout, 30.0))

    def _resume_quietly(self) -> None:
        with contextlib.suppress(WeightSyncError):
            self._post("/resume", timeout=min(self.timeout, 10.0))


def _raise_if_failed(future: Future) -> Callable[[], None]:
    """A check for the collective wait loops: re-raise the HTTP side's error as soon as it fails."""

    def check() -> None:
        if future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]

    return check


def _result(future: Future, deadline: float, what: str) -> None:
    """Wait for an HTTP call running on a side thread until ``deadline``."""
    try:
        future.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError as exc:
        raise WeightSyncError(f"{what} did not answer in time") from exc
