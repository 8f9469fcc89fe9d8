"""Adapter-only weight sync: publish each policy version's LoRA adapter to a vLLM server.

Chosen at start when the policy is a PEFT LoRA model and the server runs with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (spec: "PEFT로 어댑터 학습"); otherwise the adapter is merged and
the full weights synced (:mod:`trainer.weight_sync.client`). One version:

1. the adapter (``adapter_model.safetensors`` + ``adapter_config.json``, PEFT's layout) is written to
   ``<output_dir>/.vllm_lora/<name>-v<version>/``; vLLM reads adapters from disk, so a server on another
   machine needs that directory on a shared filesystem;
2. ``POST /v1/load_lora_adapter`` registers it under a new name per version (a new path, so no prefix-
   cache block computed under an older adapter is reused);
3. the trainer publishes the version to the rollout process, whose new rollouts request that name and
   keep it until they finish;
4. versions older than the staleness window are unloaded (``StalenessPolicy.lora_window``:
   ``max_staleness + 1`` stay live; the oldest goes only after the next one is loaded, hence
   ``--max-loras >= max_staleness + 2``, ``StalenessPolicy.lora_slots``) and their directories are
   deleted once no in-flight rollout is pinned to them.

The directory is a serving cache, not where the trained adapter is kept: checkpoints keep it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from trainer.reporting.metrics import PERF_WEIGHT_SYNC_S, PERF_WEIGHT_SYNC_TRANSFER_S
from trainer.rollout.flow import StalenessPolicy
from trainer.rollout.pinning import lora_adapter_name
from trainer.weight_sync.client import WeightSyncError, vllm_http_client
from trainer.weight_sync.fanout import call_on_each

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# vLLM's --max-lora-rank choices (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_DIR_NAME = ".vllm_lora"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class ServerLora:
    """A server's LoRA serving settings (``/server_info``'s ``lora_config`` and environment)."""

    max_lora_rank: int
    max_loras: int
    runtime_updating: bool


def server_lora(info: dict) -> ServerLora | None:
    """The server's LoRA settings, or None when it was started without ``--enable-lora``."""
    config = (info.get("vllm_config") or {}).get("lora_config")
    if not isinstance(config, dict):
        return None
    env = info.get("vllm_env") or {}
    updating = env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return ServerLora(
        max_lora_rank=int(config.get("max_lora_rank") or 16),
        max_loras=int(config.get("max_loras") or 1),
        runtime_updating=updating in (True, 1, "1", "true", "True"),
    )


def required_max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves an adapter of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"peft_config.r={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; lower r "
        "(or let the adapter be merged: start the server without --enable-lora)"
    )


def adapter_rank(peft_config) -> int:
    """The largest rank of any adapted module (``r`` and ``rank_pattern``)."""
    pattern = getattr(peft_config, "rank_pattern", None) or {}
    return max([int(peft_config.r), *(int(r) for r in pattern.values())])


def adapter_sync_blocker(peft_config) -> str | None:
    """Why vLLM could not serve this adapter as is (then it is merged and synced), or None."""
    kind = str(getattr(peft_config, "peft_type", "LORA")).rsplit(".", 1)[-1]
    if kind != "LORA":
        return f"peft_type {kind} (vLLM serves LoRA adapters only)"
    if getattr(peft_config, "use_dora", False):
        return "use_dora=True (vLLM does not serve DoRA)"
    if getattr(peft_config, "bias", "none") != "none":
        return f"bias={peft_config.bias!r} (vLLM's LoRA layers carry no bias)"
    if getattr(peft_config, "modules_to_save", None):
        return f"modules_to_save={list(peft_config.modules_to_save)} (vLLM loads only the LoRA matrices)"
    return None


def check_server_lora(lora: ServerLora, *, rank: int, staleness: StalenessPolicy, base_url: str) -> None:
    """Raise ``ValueError`` naming the server flags to restart with when the server cannot serve
    ``staleness.lora_slots`` adapters of ``rank`` (the ``max_staleness + 1`` of the window live, one
    being loaded)."""
    problems, flags = [], []
    need_rank = required_max_lora_rank(rank)
    if lora.max_lora_rank < rank:
        problems.append(f"--max-lora-rank {lora.max_lora_rank} < peft_config.r={rank}")
        flags.append(f"--max-lora-rank {need_rank}")
    need_loras = staleness.lora_slots
    if lora.max_loras < need_loras:
        problems.append(
            f"--max-loras {lora.max_loras} < max_staleness + 2 = {need_loras} "
            f"({staleness.lora_live_versions} versions live while the next one loads)"
        )
        flags.append(f"--max-loras {need_loras}")
    if not lora.runtime_updating:
        problems.append("VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set (no /v1/load_lora_adapter route)")
    if not problems:
        return
    fix = "restart it with " + " ".join(["VLLM_ALLOW_RUNTIME_LORA_UPDATING=1", "... --enable-lora", *flags])
    raise ValueError(
        f"the vLLM server at {base_url} was started with --enable-lora, but {'; '.join(problems)}: {fix} "
        "(or without --enable-lora to sync merged weights)"
    )


class LoraPublisher:
    """Writes, loads and retires adapter versions on a run's vLLM servers (each version written once,
    loaded on every server).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``, or several (a sequence): a version is
            loaded on each, one thread per server, and the round waits for all.
        directory: ``<output_dir>/.vllm_lora`` (created; readable by the server).
        lora_name: the prefix of every served adapter name (unique per training run).
        staleness: the ``max_staleness`` rule; versions in ``staleness.lora_window(current)`` stay loaded.
        timeout: seconds per HTTP call.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        directory: str | os.PathLike,
        lora_name: str,
        *,
        staleness: StalenessPolicy,
        timeout: float,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.base_urls = [url.rstrip("/") for url in urls]
        self.directory = Path(directory).resolve()
        self.lora_name = lora_name
        self.staleness = staleness
        self.timeout = float(timeout)
        self.loaded: list[int] = []  # versions registered on the server, oldest first
        self.on_disk: list[int] = []  # versions whose directory still exists, oldest first
        self._http = vllm_http_client(self.timeout)
        self._pool = ThreadPoolExecutor(max_workers=len(self.base_urls), thread_name_prefix="lora-publish")

    def path_of(self, version: int) -> Path:
        return self.directory / lora_adapter_name(self.lora_name, version)

    def _post(self, base_url: str, path: str, body: dict) -> httpx.Response:
        url = f"{base_url}{path}"
        try:
            return self._http.post(url, json=body)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc

    def _on_every_server(self, call: Callable[[str], None]) -> None:
        """``call(base_url)`` for every server at once; the first failure re-raised after all ended."""
        call_on_each(self._pool, call, self.base_urls)

    def publish(
        self, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict
    ) -> dict[str, float]:
        """Write version ``version`` and load it on the server; returns timings in seconds.

        ``tensors``: PEFT-format adapter state (``...lora_A.weight`` keys, no adapter name);
        ``adapter_config``: the ``adapter_config.json`` content. ``perf/weight_sync_transfer_s`` is
        the load call (vLLM reads the files and moves the matrices to its device).
        """
        from safetensors.torch import save_file

        started = time.perf_counter()
        final = self.path_of(version)
        staging = final.with_name(final.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(staging / ADAPTER_WEIGHTS)
        )
        (staging / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, default=_json_default))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)  # the server never sees a half-written adapter
        self.on_disk.append(version)
        written = time.perf_counter()
        name = lora_adapter_name(self.lora_name, version)

        def load(base_url: str) -> None:
            response = self._post(
                base_url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(final)}
            )
            if response.status_code >= 400:
                raise WeightSyncError(
                    f"POST {base_url}/v1/load_lora_adapter ({name}, {final}) returned "
                    f"{response.status_code}: {response.text[:500]}"
                )

        self._on_every_server(load)
        self.loaded.append(version)
        done = time.perf_counter()
        return {PERF_WEIGHT_SYNC_S: done - started, PERF_WEIGHT_SYNC_TRANSFER_S: done - written}

    def retire(self, current_version: int, oldest_pinned: int | None) -> None:
        """Unload versions older than ``staleness.lora_window(current_version)``; delete the
        directories of unloaded versions older than ``oldest_pinned`` (the oldest version an in-flight
        rollout uses; None: no rollout process to ask, so only versions outside the window are deleted)."""
        keep_from = self.staleness.lora_window(current_version).start
        for version in [v for v in self.loaded if v < keep_from]:
            self._unload(version)
        floor = keep_from if oldest_pinned is None else min(keep_from, oldest_pinned)
        for version in [v for v in self.on_disk if v < floor and v not in self.loaded]:
            shutil.rmtree(self.path_of(version), ignore_errors=True)
            self.on_disk.remove(version)

    def _unload(self, version: int) -> None:
        name = lora_adapter_name(self.lora_name, version)

        def unload(base_url: str) -> None:
            response = self._post(base_url, "/v1/unload_lora_adapter", {"lora_name": name})
            # 404: already gone (a restarted server); anything else leaves a slot taken on the server.
            if response.status_code >= 400 and response.status_code != 404:
                raise WeightSyncError(
                    f"POST {base_url}/v1/unload_lora_adapter ({name}) returned "
                    f"{response.status_code}: {response.text[:500]}"
                )

        self._on_every_server(unload)
        self.loaded.remove(version)

    def close(self) -> None:
        """Unload every version this publisher loaded and delete its directories (best effort)."""
        for version in list(self.loaded):
            with contextlib.suppress(WeightSyncError):
                self._unload(version)
        for version in list(self.on_disk):
            shutil.rmtree(self.path_of(version), ignore_errors=True)
        self.on_disk.clear()
        with contextlib.suppress(OSError):
            self.directory.rmdir()  # only when empty: other runs may share the output_dir
        self._http.close()
        self._pool.shutdown(wait=False)


def _json_default(value):
    if isinstance(value, set | frozenset | tuple):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    if hasattr(value, "value"):  # enums (peft_type, task_type)
        return value.value
    return str(value)
