"""The supervisor's writes while the trainer runs survive the database connection dying under them.

The fault is real: the supervisor's Postgres backend is terminated (``pg_terminate_backend``, what a
Postgres restart does to every client) between polls. Every control-plane write of the watch loop
(heartbeat, the trainer log's event, the trainer's ranks) must then be deferred to a later poll,
never raised: a raise ends the attempt with "supervisor error" and kills a healthy training run
(tests/faults/test_run_faults.py restarts Postgres mid-run; this was its intermittent failure).
"""

from __future__ import annotations

import json
import sys
import threading

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from controlplane.runs import services
from controlplane.runs.models import Run, RunEvent, RunEventKind
from trainer.processes.host import RANKS_FILE
from worker.processes import ManagedProcess
from worker.supervisor import RunSupervisor

DOC = {
    "model": "tiny",
    "train_dataset": "arithmetic",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {"max_completion_length": 128},
}


def kill_this_threads_connection() -> None:
    """Terminate this thread's Postgres backend from another connection (the socket dies under it)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]

    def terminate() -> None:
        with connection.cursor() as cursor:  # that thread's own connection
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            assert cursor.fetchone()[0]
        connection.close()

    thread = threading.Thread(target=terminate)
    thread.start()
    thread.join()


@pytest.fixture
def watched(tmp_path):
    """A RunSupervisor in its watch phase over a running run, its trainer log holding two lines."""
    owner = get_user_model().objects.create_user(username="blips")
    run, _ = services.run_create(owner=owner, name="blips", config=DOC, launch=False)
    # As run_launch leaves it, without a Celery task (this test is the supervisor).
    Run.objects.filter(pk=run.pk).update(celery_task_id="blips", launched_at=timezone.now())
    run = services.run_claim(run_id=run.pk, task_id="blips", worker_host="blips-host")
    assert services.run_mark_running(run_id=run.pk)
    supervisor = RunSupervisor(run)
    supervisor.out = tmp_path
    log = tmp_path / "trainer.attempt-1.log"
    trainer = ManagedProcess(
        "trainer",
        [sys.executable, "-c", "print('step 1: loss 0.51'); print('step 2: loss 0.47')"],
        log_path=log,
    ).start()
    assert trainer.proc.wait(timeout=30) == 0
    trainer.stop()
    supervisor.trainer = trainer
    return supervisor


@pytest.mark.django_db(transaction=True)
def test_log_event_and_heartbeat_wait_out_a_dead_connection_and_lose_no_line(watched):
    kill_this_threads_connection()
    watched._next_log_event = 0.0
    watched._maybe_log_event()  # refused: deferred, not raised
    assert not RunEvent.objects.filter(run_id=watched.run_id, kind=RunEventKind.LOG).exists()

    kill_this_threads_connection()
    watched._next_beat = 0.0
    watched._check()  # the heartbeat is deferred as well
    assert watched._next_beat > 0

    watched._next_log_event = 0.0
    watched._maybe_log_event()  # the database answers again: the same lines, once
    events = list(RunEvent.objects.filter(run_id=watched.run_id, kind=RunEventKind.LOG))
    assert len(events) == 1 and "step 1: loss 0.51\nstep 2: loss 0.47" in events[0].message
    watched._next_log_event = 0.0
    watched._maybe_log_event()  # nothing new in the log: no second event
    assert RunEvent.objects.filter(run_id=watched.run_id, kind=RunEventKind.LOG).count() == 1


@pytest.mark.django_db(transaction=True)
def test_trainer_ranks_are_recorded_on_the_poll_after_a_dead_connection(watched):
    ranks = [{"rank": 0, "device": "cpu", "gpu": None, "pid": 123, "host": "h"}]
    (watched.out / RANKS_FILE).write_text(json.dumps(ranks))
    kill_this_threads_connection()
    watched._record_ranks()  # refused: deferred, not raised
    assert Run.objects.get(pk=watched.run_id).placement["trainer"]["ranks"] != ranks
    watched._record_ranks()
    assert Run.objects.get(pk=watched.run_id).placement["trainer"]["ranks"] == ranks


@pytest.mark.django_db(transaction=True)
def test_output_ingest_waits_out_a_dead_connection_and_stores_each_step_once(watched):
    from controlplane.runs.models import MetricPoint, RunFileCursor
    from trainer.reporting.sinks import METRICS_FILE, JsonlSink

    watched.tailer.output_dir = watched.out
    sink = JsonlSink(watched.out)
    for step in (1, 2):
        sink.metrics(step, {"reward": step / 10})
    kill_this_threads_connection()
    watched._ingest_outputs()  # refused: deferred, not raised; the offset does not move
    assert not RunFileCursor.objects.filter(run_id=watched.run_id).exists()
    sink.metrics(3, {"reward": 0.3})
    watched._ingest_outputs()  # the database answers again: all three steps, once
    watched._ingest_outputs()
    rewards = MetricPoint.objects.filter(run_id=watched.run_id, name="reward").order_by("step")
    assert list(rewards.values_list("step", "value")) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert (
        RunFileCursor.objects.get(run_id=watched.run_id).offset == (watched.out / METRICS_FILE).stat().st_size
    )
