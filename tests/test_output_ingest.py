"""The trainer reports through files; the supervisor's tailer stores them (no database in the
trainer). Real Postgres, real files as ``trainer.reporting.sinks.JsonlSink`` writes them; no vLLM."""

from __future__ import annotations

import json
import math
import os

import pytest
from django.contrib.auth import get_user_model

from controlplane.runs.models import CompletionSample, MetricPoint, Run, RunFileCursor
from trainer.reporting.sinks import COMPLETIONS_FILE, METRICS_FILE, JsonlSink
from worker.processes import CONTROL_PLANE_ENV, child_environment
from worker.tailer import RunOutputTailer

pytestmark = pytest.mark.django_db


def make_run() -> Run:
    owner = get_user_model().objects.create_user(username="ingest")
    return Run.objects.create(owner=owner, name="ingest", config={"model": "tiny"}, config_sha256="0" * 64)


def completion(text: str) -> dict:
    return {"prompt": "p", "completion": text, "reward": 1.0, "rewards": {}, "advantage": 0.0, "group_id": 0}


def test_a_partial_last_line_waits_for_the_next_poll_and_nan_is_kept(tmp_path):
    run = make_run()
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    JsonlSink(tmp_path).metrics(1, {"reward": 0.5, "tools/failure_frequency": float("nan")})
    line = json.dumps({"step": 2, "reward": 0.25}) + "\n"
    with open(tmp_path / METRICS_FILE, "a") as fh:
        fh.write(line[:7])  # the trainer is in the middle of its write
    tailer.poll()
    assert sorted(MetricPoint.objects.filter(run=run).values_list("step", flat=True)) == [1, 1]
    assert math.isnan(MetricPoint.objects.get(run=run, name="tools/failure_frequency").value)
    cursor = RunFileCursor.objects.get(run=run, name=METRICS_FILE)
    assert cursor.offset == (tmp_path / METRICS_FILE).stat().st_size - 7
    with open(tmp_path / METRICS_FILE, "a") as fh:
        fh.write(line[7:])
    tailer.poll()
    assert MetricPoint.objects.get(run=run, name="reward", step=2).value == 0.25


def test_a_cut_line_from_a_killed_trainer_does_not_swallow_the_next_attempts_first_line(tmp_path):
    run = make_run()
    with open(tmp_path / METRICS_FILE, "w") as fh:
        fh.write(json.dumps({"step": 1, "reward": 0.5}) + "\n" + '{"step": 2, "rew')  # kill -9 here
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    tailer.drain()
    tailer.new_attempt()
    JsonlSink(tmp_path).metrics(2, {"reward": 0.75})  # the resumed attempt's sink ends the cut line
    tailer.drain()
    assert list(MetricPoint.objects.filter(run=run).order_by("step").values_list("step", "value")) == [
        (1, 0.5),
        (2, 0.75),
    ]


def test_completion_blocks_continue_across_polls_and_restart_with_an_attempt(tmp_path):
    run = make_run()
    sink = JsonlSink(tmp_path)
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    sink.completions(1, [completion("a"), completion("b")])
    tailer.poll()
    # The rest of the step's block, read by the next poll (and by a restarted worker's tailer).
    sink.completions(1, [completion("c")])
    RunOutputTailer(run_id=run.pk, output_dir=tmp_path).poll()
    rows = CompletionSample.objects.filter(run=run, step=1).order_by("index")
    assert [(r.index, r.completion) for r in rows] == [(0, "a"), (1, "b"), (2, "c")]
    # A resumed attempt re-does step 1: its rows replace the old ones from index 0.
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    tailer.new_attempt()
    sink.completions(1, [completion("x")])
    tailer.poll()
    rows = CompletionSample.objects.filter(run=run, step=1).order_by("index")
    assert [(r.index, r.completion) for r in rows] == [(0, "x"), (1, "b"), (2, "c")]
    assert (tmp_path / COMPLETIONS_FILE).read_text().count("\n") == 4


def test_the_run_processes_get_no_control_plane_settings(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@db/grpo")
    monkeypatch.setenv("REDIS_URL", "redis://secret@redis/0")
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    env = child_environment(os.environ)
    assert not CONTROL_PLANE_ENV & set(env)
    assert "DATABASE_URL" not in env and env["PATH"] == os.environ["PATH"]


def test_the_guard_that_starts_the_run_processes_loads_no_control_plane(tmp_path):
    import subprocess
    import sys

    env = {**child_environment(os.environ), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    probe = f"import os; print(sorted(k for k in os.environ if k in {sorted(CONTROL_PLANE_ENV)!r}))"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.guard",
            "--parent",
            str(os.getpid()),
            "--",
            sys.executable,
            "-c",
            probe,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
