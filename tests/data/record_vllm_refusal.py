"""Record the trainer log of a run that vLLM refuses (``tests/data/vllm_max_tokens_refused.log``).

The README's old REST example on the tiny model (``max_completion_length`` left at its 2048 default,
the tiny model's server at ``--max-model-len 1024``): the real rollout process (the trainer's
``start_rollout_process`` with the real loop, tokenizer, dataset and reward) generates against an HTTP
stand-in for the vLLM server that answers ``/v1/completions`` with vLLM's own 400, built by vLLM's
request validation (``TokenizeParams``) and error response (``create_error_response``); the trainer's
side waits for samples as ``AsyncGRPOTrainer._next_group`` does and dies of the ``RuntimeError`` the
handle raises, printed as ``python -m trainer train`` prints it. Run from the repository root:

    .venv/bin/python tests/data/record_vllm_refusal.py > tests/data/vllm_max_tokens_refused.log 2>&1

The recorded paths and pids are what they were on the recording machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

README_DOC = {
    "model": "tiny",
    "train_dataset": "arithmetic",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {"max_steps": 50},
}
SERVED_MAX_MODEL_LEN = 1024


def vllm_refusal(max_tokens: int) -> bytes:
    """The body vLLM answers a request for ``max_tokens`` with, from vLLM's own code."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.renderers.params import TokenizeParams

    try:
        TokenizeParams(
            max_total_tokens=SERVED_MAX_MODEL_LEN,
            max_output_tokens=max_tokens,
            max_total_tokens_param="max_model_len",
            max_output_tokens_param="max_tokens",
        )
    except Exception as exc:
        return create_error_response(exc).model_dump_json().encode()
    raise AssertionError("vLLM accepted the request")


def serve(model_dir: str, refusal: bytes) -> str:
    """An HTTP stand-in for the tiny model's vLLM server; returns its base URL."""
    models = json.dumps(
        {"data": [{"id": model_dir, "root": model_dir, "max_model_len": SERVED_MAX_MODEL_LEN}]}
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError):  # the rollout process is gone: nothing to answer
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/v1/models":
                self._send(200, models)
            else:
                self._send(404, b'{"detail":"Not Found"}')

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            if self.path == "/v1/completions":
                self._send(400, refusal)
            else:
                self._send(404, b'{"detail":"Not Found"}')

        def log_message(self, *args) -> None:
            """Quiet: the test's output stays readable (http.server logs every request to stderr)."""

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:
            pass  # a client that went away mid-answer is not the recording's business

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


def main() -> None:
    refusal = vllm_refusal(2048)  # max_completion_length's default (before the log starts: vLLM logs)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from transformers import AutoTokenizer

    from trainer.config.run_config import validate_run_document
    from trainer.plugins.registry import load_dataset_by_name, resolve_callable, resolve_model
    from trainer.rollout.loop import AsyncRolloutLoop
    from trainer.rollout.process import start_rollout_process

    model_dir = resolve_model("tiny")
    spec = validate_run_document(README_DOC, output_dir=tempfile.mkdtemp(prefix="recorded-run-"))
    assert spec.args.max_completion_length == 2048
    spec.args.vllm_server_base_url = serve(model_dir, refusal)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    handle = start_rollout_process(
        AsyncRolloutLoop,
        initial_token_allowance=1e6,
        config=spec.args,
        model_name=model_dir,
        dataset=load_dataset_by_name(spec.train_dataset),
        reward_funcs=[resolve_callable(p) for p in spec.reward_funcs],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
    )
    try:
        while True:
            handle.get(timeout=1.0)  # as AsyncGRPOTrainer._next_group waits for a group
    finally:
        handle.stop(grace_s=2)


if __name__ == "__main__":
    main()
