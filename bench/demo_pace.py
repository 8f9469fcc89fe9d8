"""The demo's pace on CPU: does it keep its step time as it learns, and reach its last step in time?

Runs the demo document (:data:`trainer.tasks.demo.DEMO_RUN`, what ``make run`` starts) the way the
worker does (one ``python -m trainer serve`` of the tiny model with the supervisor's flags, one
``python -m trainer train`` process), for ``--steps`` steps or ``--minutes`` minutes, and records
minute by minute, from the trainer's first metric: steps done, the median step time
(``perf/step_s``), samples per step (``batch/samples_per_step``), the mean reward and the curriculum's
stage (``curriculum/level``), and why steps slow (``perf/rollout_wait_s``, ``frac_reward_zero_std``,
``rollout/retired_prompts``, ``rollout/retired_fraction``); plus the steps where the stage changed, the minutes to the last step,
and the ratio of the median step time of the last 20 steps to that of the first 20.

    .venv/bin/python -m bench.demo_pace --out bench/results/demo-pace-cpu.json
    .venv/bin/python -m bench.demo_pace --before --minutes 10 --out bench/results/demo-pace-before-cpu.json

``--before`` runs the document as it was before the curriculum (no ``loop_cls``, no
``max_samples_per_row``); ``--set KEY=JSON`` overrides an arg; ``--base-url`` reuses a server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.demo_learning import run_document, start_tiny_server, train_once  # noqa: E402

EDGE_STEPS = 20  # the "first 20" and "last 20" steps


def step_arrivals(rows: list[dict], seen: dict[int, float], now: float) -> None:
    """Record when each step's row was first seen (``seen``: step -> monotonic seconds)."""
    for row in rows:
        seen.setdefault(int(row["step"]), now)


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.fmean(values), 3) if values else None


def _last(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return values[-1] if values else None


def per_minute(rows: list[dict], arrived: dict[int, float], start: float) -> list[dict]:
    """One entry per minute since ``start``: steps done in it, median step s, mean samples/step, reward, stage."""
    minutes: dict[int, list[dict]] = {}
    for row in rows:
        minute = int((arrived[int(row["step"])] - start) // 60)
        minutes.setdefault(minute, []).append(row)
    out = []
    for minute in range(max(minutes, default=-1) + 1):
        got = minutes.get(minute, [])
        rewards = [r["reward"] for r in got if "reward" in r]
        stages = [r["curriculum/level"] for r in got if "curriculum/level" in r]
        out.append(
            {
                "minute": minute + 1,
                "steps": len(got),
                "last_step": got[-1]["step"] if got else None,
                "median_step_s": round(statistics.median(r["perf/step_s"] for r in got), 2) if got else None,
                "samples_per_step": round(statistics.fmean(r["batch/samples_per_step"] for r in got), 1)
                if got
                else None,
                "reward": round(statistics.fmean(rewards), 3) if rewards else None,
                "stage": max(stages) if stages else None,
                # why a step is slow: waiting on generation, and how much of it was dropped or skipped
                "rollout_wait_s": _median(got, "perf/rollout_wait_s"),
                "frac_reward_zero_std": _mean(got, "frac_reward_zero_std"),
                "retired_prompts": _last(got, "rollout/retired_prompts"),
                "retired_fraction": _last(got, "rollout/retired_fraction"),
            }
        )
    return out


def stage_changes(rows: list[dict], arrived: dict[int, float], start: float) -> list[dict]:
    """The steps at which ``curriculum/level`` changed, with the minute they arrived."""
    changes, last = [], None
    for row in rows:
        stage = row.get("curriculum/level")
        if stage is not None and stage != last:
            changes.append(
                {"step": row["step"], "stage": stage, "at_s": round(arrived[row["step"]] - start, 1)}
            )
            last = stage
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the document's max_steps")
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="stop after this long (from the first metric)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--before", action="store_true", help="the document without the curriculum")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override an arg")
    parser.add_argument("--base-url", default=None, help="reuse a running server")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    opts = parser.parse_args(argv)
    overrides = {}
    for item in opts.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)

    from trainer.tasks.demo import demo_run_document

    steps = opts.steps or demo_run_document()["args"]["max_steps"]
    workroot = Path(tempfile.mkdtemp(prefix="demo-pace-"))
    server = None
    base_url = opts.base_url
    if base_url is None:
        server = start_tiny_server(workroot)
        base_url = server.base_url
    doc = run_document(steps, opts.seed, overrides, workroot / "out", base_url)
    if opts.before:
        doc.pop("loop_cls", None)
        doc["args"].pop("max_samples_per_row", None)
    arrived: dict[int, float] = {}
    first: list[float] = []

    def stop_when(rows: list[dict]) -> bool:
        now = time.monotonic()
        step_arrivals(rows, arrived, now)
        if rows and not first:
            first.append(now)
        return bool(first) and now - first[0] > opts.minutes * 60

    try:
        rows = train_once(doc, workroot, timeout_s=opts.minutes * 60 + 900, stop_when=stop_when)
    finally:
        if server is not None:
            server.stop()
    step_arrivals(rows, arrived, time.monotonic())
    start = first[0] if first else time.monotonic()
    times = [r["perf/step_s"] for r in rows]
    head, tail = times[:EDGE_STEPS], times[-EDGE_STEPS:]
    ratio = statistics.median(tail) / statistics.median(head) if len(times) >= 2 * EDGE_STEPS else None
    result = {
        "document": {k: v for k, v in doc.items() if k != "args"}
        | {"args": doc["args"] | {"output_dir": "OUT"}},
        "steps_done": rows[-1]["step"] if rows else 0,
        "minutes_to_last_step": round((arrived[rows[-1]["step"]] - start) / 60, 2) if rows else None,
        "median_step_s_first20": round(statistics.median(head), 2) if head else None,
        "median_step_s_last20": round(statistics.median(tail), 2) if tail else None,
        "step_time_ratio_last20_over_first20": None if ratio is None else round(ratio, 2),
        "stage_changes": stage_changes(rows, arrived, start),
        "per_minute": per_minute(rows, arrived, start),
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("document", "per_minute")}))
    for minute in result["per_minute"]:
        print(json.dumps(minute))
    if opts.out:
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
