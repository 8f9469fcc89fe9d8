"""Graceful interrupt and automatic resume (issue 28, item 5), without a worker: the trainer's request
file and marker, the ``interrupted`` status in the life cycle, the resume a starting worker makes and
the demo run ``make run`` continues. Real Postgres (pytest-django; ``on_commit`` never fires here, so
nothing is enqueued).

The whole path, with a real stack, trainer and vLLM server (Ctrl-C on ``make run``, the checkpoint at
the step's end, ``make run`` again continuing the same run), is
``tests/test_make_run.py::test_ctrl_c_interrupts_the_demo_run_and_the_next_make_run_continues_it``.
"""

from __future__ import annotations

import pytest

from controlplane.runs import services
from controlplane.runs.models import Run, RunEvent, RunStatus
from tests.test_runs_api import api_for, good_config, make_user
from trainer.processes.interrupt import (
    interrupt_clear,
    interrupt_request,
    interrupt_requested,
    marker_read,
    marker_write,
)

pytestmark = pytest.mark.django_db


def _interrupted(owner, *, host: str = "host-a", config: dict | None = None) -> Run:
    """A run whose attempt on ``host`` ended ``interrupted`` (as the supervisor records it)."""
    run, _ = services.run_create(owner=owner, config=config or good_config())
    services.run_claim(run_id=run.pk, task_id=run.celery_task_id, worker_host=host)
    assert services.run_finish(run_id=run.pk, status=RunStatus.INTERRUPTED, trainer_exit_code=75)
    run.refresh_from_db()
    return run


def test_the_request_file_and_the_marker(tmp_path):
    out = tmp_path / "run"
    assert not interrupt_requested(out) and marker_read(out) is None
    interrupt_request(out)
    assert interrupt_requested(out)
    marker_write(out, step=7, checkpoint=str(out / "checkpoint-7"))
    assert marker_read(out) == {"step": 7, "checkpoint": str(out / "checkpoint-7")}
    interrupt_clear(out)  # a new attempt starts unasked
    assert not interrupt_requested(out) and marker_read(out) is None


def test_an_interrupted_run_has_ended_is_not_a_failure_and_can_be_resumed():
    alice = make_user("alice")
    run = _interrupted(alice)
    assert run.status == RunStatus.INTERRUPTED and run.finished_at is not None
    assert run.failure_reason == "" and run.trainer_exit_code == 75
    client = api_for(alice)
    assert client.get(f"/api/v1/runs/{run.pk}/").json()["status"] == "interrupted"
    assert client.post(f"/api/v1/runs/{run.pk}/stop/").status_code == 409  # nothing live to stop
    resumed = client.post(f"/api/v1/runs/{run.pk}/resume/")
    assert resumed.status_code == 202 and resumed.json()["status"] == "queued"


def test_a_starting_worker_resumes_the_interrupted_runs_of_its_host_and_pools(settings):
    settings.GRPO_RUN_POOLS = [settings.GRPO_RUNS_QUEUE, "other-pool"]
    alice = make_user("alice")
    mine = _interrupted(alice)
    other_host = _interrupted(alice, host="host-b")
    other_pool = _interrupted(alice, config={**good_config(), "resources": {"pool": "other-pool"}})
    failed, _ = services.run_create(owner=alice, config=good_config())
    services.run_claim(run_id=failed.pk, task_id=failed.celery_task_id, worker_host="host-a")
    services.run_finish(run_id=failed.pk, status=RunStatus.FAILED, failure_reason="boom")

    resumed = services.runs_resume_interrupted(worker_host="host-a", queues=[settings.GRPO_RUNS_QUEUE])

    assert resumed == [mine.pk]
    status = dict(Run.objects.values_list("pk", "status"))
    assert status[mine.pk] == RunStatus.QUEUED
    assert status[other_host.pk] == status[other_pool.pk] == RunStatus.INTERRUPTED
    assert status[failed.pk] == RunStatus.FAILED  # a failure is resumed by hand, never by itself
    assert RunEvent.objects.filter(run_id=mine.pk, message__startswith="resumed automatically").exists()
    # A second worker of the same host finds nothing left to resume.
    assert services.runs_resume_interrupted(worker_host="host-a", queues=[settings.GRPO_RUNS_QUEUE]) == []


def test_make_run_continues_the_interrupted_demo_run_unless_resuming_is_off(settings):
    demo = services.demo_run_start()
    services.run_claim(run_id=demo.pk, task_id=demo.celery_task_id, worker_host="host-a")
    services.run_finish(run_id=demo.pk, status=RunStatus.INTERRUPTED)

    again = services.demo_run_start()
    assert again.pk == demo.pk and again.status == RunStatus.QUEUED  # the same run, from its checkpoint

    services.run_claim(run_id=demo.pk, task_id=again.celery_task_id, worker_host="host-a")
    services.run_finish(run_id=demo.pk, status=RunStatus.INTERRUPTED)
    settings.GRPO_RESUME_INTERRUPTED = False
    fresh = services.demo_run_start()
    assert fresh.pk != demo.pk and Run.objects.get(pk=demo.pk).status == RunStatus.INTERRUPTED
