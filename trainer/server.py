"""Synchronous checks of the vLLM server from the trainer process (the rollout side is async)."""

from __future__ import annotations

import time

import httpx


def wait_for_server(base_url: str, timeout_s: float) -> None:
    """Poll ``/health`` until it answers 200; ``TimeoutError`` naming the URL after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=5.0).status_code == 200:
                return
            last_error = "not healthy yet"
        except httpx.HTTPError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(1.0)
    raise TimeoutError(
        f"vLLM server at {base_url} not ready after {timeout_s:.0f}s ({last_error}); start it with "
        "`python -m trainer serve MODEL` or fix vllm_server_base_url"
    )


def served_models(base_url: str, timeout_s: float = 30.0) -> list[dict]:
    """``/v1/models`` entries (``id``, ``max_model_len``, ...)."""
    response = httpx.get(f"{base_url}/v1/models", timeout=timeout_s)
    response.raise_for_status()
    return list(response.json().get("data", []))
