"""Synchronous checks of the vLLM server from the trainer process (the rollout side is async)."""

from __future__ import annotations

import logging
import time

import httpx

logger = logging.getLogger(__name__)


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


def pick_served_model(served: list[dict], wanted: str) -> tuple[str, int]:
    """The served model id matching ``wanted`` (or the only one served) and its max_model_len."""
    if not served:
        raise RuntimeError("the vLLM server serves no model (/v1/models is empty)")
    for entry in served:
        if entry["id"] == wanted:
            return entry["id"], int(entry["max_model_len"])
    if len(served) == 1:
        logger.info(
            "server serves %r, trainer loaded %r: generating with the served one", served[0]["id"], wanted
        )
        return served[0]["id"], int(served[0]["max_model_len"])
    raise RuntimeError(f"the server serves {[e['id'] for e in served]}, none of them {wanted!r}")
