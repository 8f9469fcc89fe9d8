"""``python -m trainer serve MODEL``: start a vLLM OpenAI server set up for async GRPO training.

The spec's flags: ``VLLM_SERVER_DEV_MODE=1`` (weight-transfer, pause/resume routes),
``--logprobs-mode processed_logprobs`` (logprobs of the distribution actually sampled),
``--max-model-len`` and ``--weight-transfer-config`` (NCCL on GPU; the CPU engine registered by
:mod:`trainer.weight_sync` on CPU). On a CPU-only machine the settings measured in NOTES.md are
added (KV cache space, host-memory fraction), and ``--dtype float32``, the trainer's dtype on CPU
(``--dtype`` given wins). Unknown flags pass through to vLLM unchanged; ``--scheduling-policy priority``
among them lets evaluation's requests go ahead of the rollouts (trainer/rollout/evaluation.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

DEFAULT_MAX_MODEL_LEN = 2048
GPU_WEIGHT_TRANSFER = {"backend": "nccl"}
# Registered by trainer.weight_sync.plugin through the `vllm.general_plugins` entry point.
CPU_WEIGHT_TRANSFER = {"backend": "gloo"}


@dataclass
class ServeCommand:
    """The argv and environment of one vLLM server process."""

    argv: list[str]
    env: dict[str, str]


def has_cuda_gpu() -> bool:
    """True when an NVIDIA GPU is visible (decides the vLLM flavour and weight-transfer backend)."""
    if not shutil.which("nvidia-smi"):
        return False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _has_flag(extra: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in extra)


def build_serve_command(
    model: str,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    max_model_len: int | None = None,
    gpu: bool | None = None,
    extra: list[str] | None = None,
    python: str = sys.executable,
) -> ServeCommand:
    """Build the vLLM server command line for ``model`` (hub id or local directory).

    ``extra`` vLLM flags are appended unchanged and win over the defaults chosen here
    (``--weight-transfer-config``, ``--logprobs-mode``, ``--dtype``, ...).
    """
    extra = list(extra or [])
    gpu = has_cuda_gpu() if gpu is None else gpu
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host]
    argv += ["--port", str(port)]
    argv += ["--max-model-len", str(max_model_len or DEFAULT_MAX_MODEL_LEN)]
    if not _has_flag(extra, "--logprobs-mode"):
        argv += ["--logprobs-mode", "processed_logprobs"]
    if not _has_flag(extra, "--weight-transfer-config"):
        argv += ["--weight-transfer-config", json.dumps(GPU_WEIGHT_TRANSFER if gpu else CPU_WEIGHT_TRANSFER)]
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if gpu:
        # Serialising top logprobs is CPU work in the API server; 8 processes keep it off the
        # critical path (spec: "vLLM 서버 구성").
        if not _has_flag(extra, "--api-server-count"):
            argv += ["--api-server-count", "8"]
    else:
        # NOTES.md: the default host-memory fraction refuses to start on these machines.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if not _has_flag(extra, "--gpu-memory-utilization"):
            argv += ["--gpu-memory-utilization", "0.3"]
        # The trainer's dtype on CPU is float32 (spec default; no bf16 autocast without a bf16
        # accelerator), and vLLM's "auto" would serve the checkpoint's own (bf16 for the tiny model),
        # so every run warned that sampler and trainer log-probs disagree. Serve what the trainer trains.
        if not _has_flag(extra, "--dtype"):
            argv += ["--dtype", "float32"]
        # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded request
        # is prefilled in chunks; the trainer seeds every request, so prefill whole prompts.
        if not (
            _has_flag(extra, "--enable-chunked-prefill") or _has_flag(extra, "--no-enable-chunked-prefill")
        ):
            argv += ["--no-enable-chunked-prefill"]
    if _has_flag(extra, "--enable-lora"):
        env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    return ServeCommand(argv=argv + extra, env=env)


def main(argv: list[str]) -> int:
    """CLI entry: parse ``MODEL [--port N] [--host H] [--max-model-len N] [vLLM flags...]`` and exec vLLM."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer serve",
        description="Start a vLLM server for async GRPO training (extra flags go to vLLM).",
    )
    parser.add_argument("model", help="hub id or local model directory ('tiny' = the embedded model)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--print-command", action="store_true", help="print the command and exit")
    args, extra = parser.parse_known_args(argv)
    model = args.model
    if model == "tiny":
        from trainer.plugins.registry import resolve_model

        model = resolve_model("tiny")
    cmd = build_serve_command(
        model, port=args.port, host=args.host, max_model_len=args.max_model_len, extra=extra
    )
    if args.print_command:
        print(" ".join(cmd.argv))
        return 0
    # exec: signals (SIGTERM from the worker's supervisor, Ctrl-C) reach vLLM directly.
    os.execvpe(cmd.argv[0], cmd.argv, cmd.env)
    return 0  # unreachable
