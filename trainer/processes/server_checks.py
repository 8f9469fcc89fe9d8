"""Synchronous checks of the vLLM server from the trainer process (the rollout side is async)."""

from __future__ import annotations

import logging
import time

import httpx

logger = logging.getLogger(__name__)


def server_urls(value: str | None) -> list[str]:
    """The servers ``vllm_server_base_url`` names: one URL, or several separated by commas (one run's
    rollouts spread over them, weights synced to each), trailing slashes dropped, order kept."""
    return [url.strip().rstrip("/") for url in (value or "").split(",") if url.strip()]


def served_model_of_all(urls: list[str], wanted: str) -> tuple[str, int]:
    """The served model id every server of ``urls`` serves as ``wanted`` picks it, and the smallest
    ``max_model_len`` among them; ``RuntimeError`` naming the URL of a server that serves another."""
    picks = [(url, *pick_served_model(served_models(url), wanted)) for url in urls]
    name = picks[0][1]
    for url, other, _ in picks[1:]:
        if other != name:
            raise RuntimeError(
                f"vLLM server {url} serves {other!r} and {picks[0][0]} serves {name!r}: every server of "
                "vllm_server_base_url must serve the same model"
            )
    return name, min(length for _, _, length in picks)


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
