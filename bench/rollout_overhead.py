"""Generated tokens/s through the rollout loop vs a plain concurrent client, on one vLLM server.

Both sides send the same requests (token-id prompts of the arithmetic task, the same
``max_tokens``, ``logprobs`` and concurrency) to the same running server:

* plain: ``concurrency`` asyncio workers posting ``/v1/completions`` back to back (aiohttp);
* loop: the spawned rollout process (``start_rollout_process``), scoring with a trivial reward,
  allowance unlimited, the trainer side draining the queue as fast as it can. Its start-up
  (process spawn, first group) is excluded: the clock starts after a warm-up.

The difference is the loop's overhead: chat-template rendering, logprob parsing, reconciliation,
scoring, pickling through the queue, and its flow control (one group at a time until the first
finishes, then groups of ``num_generations`` admitted while slots are free).

    python bench/rollout_overhead.py --base-url http://127.0.0.1:8201 --model-dir DIR --served-name tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config.async_grpo_config import AsyncGRPOConfig  # noqa: E402
from trainer.rollout import AsyncRolloutLoop, start_rollout_process  # noqa: E402
from trainer.tasks.arithmetic import arithmetic_rows  # noqa: E402


def rank_reward(completions, **kwargs):
    """Different for every rollout of a group, so every group is kept and reaches the queue."""
    return [float(i) for i in range(len(completions))]


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in rows
    ]


async def plain_client(args, prompts: list[list[int]]) -> dict:
    """``concurrency`` workers sending requests back to back for ``duration`` seconds."""
    generated = 0
    requests = 0
    stop_at = time.monotonic() + args.duration
    seed = iter(range(10**9))
    connector = aiohttp.TCPConnector(limit=args.concurrency)

    async def worker(session: aiohttp.ClientSession, offset: int) -> None:
        nonlocal generated, requests
        i = offset
        while time.monotonic() < stop_at:
            payload = {
                "model": args.served_name,
                "prompt": prompts[i % len(prompts)],
                "max_tokens": args.max_tokens,
                "temperature": 1.0,
                "logprobs": args.logprobs,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "seed": next(seed),
            }
            async with session.post(args.base_url + "/v1/completions", json=payload) as resp:
                body = await resp.json()
            generated += len(body["choices"][0]["token_ids"])
            requests += 1
            i += args.concurrency

    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session, k) for k in range(args.concurrency)))
    elapsed = time.monotonic() - started
    return {
        "generated_tokens": generated,
        "requests": requests,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
    }


def through_loop(args, tokenizer, rows: list[dict]) -> dict:
    """The spawned rollout loop; tokens counted from the kept samples the trainer side receives."""
    config = AsyncGRPOConfig(
        output_dir="/tmp/rollout_overhead_out",
        vllm_server_base_url=args.base_url,
        num_generations=args.num_generations,
        max_completion_length=args.max_tokens,
        num_sampler_logprobs=args.logprobs,
        max_concurrent_rollouts=args.concurrency,
        bf16=False,
        use_cpu=True,
    )
    handle = start_rollout_process(
        AsyncRolloutLoop,
        initial_token_allowance=1e15,
        config=config,
        model_name=args.served_name,
        dataset=rows,
        reward_funcs=[rank_reward],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
    )
    try:
        handle.get(timeout=120)
        warm_until = time.monotonic() + args.warmup
        while time.monotonic() < warm_until:
            handle.get(timeout=max(0.01, warm_until - time.monotonic()))
        handle.drain_metrics()
        generated = rollouts = 0
        started = time.monotonic()
        stop_at = started + args.duration
        while time.monotonic() < stop_at:
            result = handle.get(timeout=max(0.01, stop_at - time.monotonic()))
            if result is None:
                continue
            for sample in result.samples:
                generated += sample.num_trained_tokens
                rollouts += 1
        elapsed = time.monotonic() - started
        from trainer.reporting.metrics import MetricWindow

        window = MetricWindow()
        for payload in handle.drain_metrics():
            window.merge(payload["metrics"])
        metrics = window.reduce()
    finally:
        handle.stop()
    return {
        "generated_tokens": generated,
        "rollouts": rollouts,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
        "concurrency_mean": metrics.get("rollout/concurrency"),
        "backpressure_s": metrics.get("rollout/backpressure_s"),
        "score_s": metrics.get("rollout/score_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8201")
    parser.add_argument("--served-name", default="tiny")
    parser.add_argument("--model-dir", required=True, help="tokenizer directory (the served model)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    rows = arithmetic_rows(256, seed=0)
    prompts = prompt_ids(tokenizer, rows)
    runs = []
    for _ in range(args.repeats):  # interleaved, so load from elsewhere on the machine hits both alike
        plain = asyncio.run(plain_client(args, prompts))
        loop = through_loop(args, tokenizer, rows)
        runs.append({"plain": plain, "loop": loop, "ratio": loop["tokens_per_s"] / plain["tokens_per_s"]})
        print(json.dumps(runs[-1]), flush=True)
    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "runs": runs,
        "plain_tokens_per_s_median": statistics.median(r["plain"]["tokens_per_s"] for r in runs),
        "loop_tokens_per_s_median": statistics.median(r["loop"]["tokens_per_s"] for r in runs),
        "ratio_median": statistics.median(r["ratio"] for r in runs),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
