"""Issue 22 item 1 (server side): each logging step's wall time and attempt (``MetricStep``, from the
``timestamp`` of a metrics.jsonl row, never a metric point), served beside the columns and on the
socket; and a user's pinned charts (``/api/v1/preferences/charts/``). Real Postgres, real files."""

from __future__ import annotations

import json
import time

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from controlplane.runs.models import ChartPreference, MetricPoint, MetricStep, Run
from controlplane.runs.services import ingest
from tests.test_run_downloads import api_for
from trainer.reporting.sinks import METRICS_FILE, JsonlSink
from worker.tailer import RunOutputTailer

pytestmark = pytest.mark.django_db


def make_user(name: str):
    return get_user_model().objects.create_user(username=name, password="s3cret-pass")


def make_run(owner, attempt: int = 1) -> Run:
    return Run.objects.create(
        owner=owner, name="r", config={"model": "tiny"}, config_sha256="0" * 64, attempt=attempt
    )


def test_the_sink_stamps_each_row_and_the_tailer_stores_it_on_the_step_not_as_a_metric(tmp_path):
    owner = make_user("stamp")
    run = make_run(owner)
    before = time.time()
    JsonlSink(tmp_path).metrics(1, {"reward": 0.5})
    JsonlSink(tmp_path).metrics(2, {"reward": 0.75})
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert all(before - 0.001 <= r["timestamp"] <= time.time() + 1 for r in rows), rows  # ms precision
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    tailer.poll()
    assert not MetricPoint.objects.filter(run=run, name="timestamp").exists()
    assert MetricPoint.objects.filter(run=run).count() == 2
    steps = list(MetricStep.objects.filter(run=run).order_by("step"))
    assert [(s.step, s.attempt) for s in steps] == [(1, 1), (2, 1)]
    assert [round(s.time.timestamp(), 3) for s in steps] == [r["timestamp"] for r in rows]
    # A restarted worker reads the file again from the start: nothing doubles or moves.
    from controlplane.runs.models import RunFileCursor

    RunFileCursor.objects.filter(run=run).delete()
    RunOutputTailer(run_id=run.pk, output_dir=tmp_path).poll()
    again = list(MetricStep.objects.filter(run=run).order_by("step"))
    assert [(s.step, s.time, s.attempt) for s in again] == [(s.step, s.time, s.attempt) for s in steps]
    assert MetricPoint.objects.filter(run=run).count() == 2


def test_a_resumed_attempt_re_logging_steps_records_its_attempt_and_the_api_serves_the_steps():
    owner = make_user("resume")
    run = make_run(owner)
    t0 = 1_767_225_600.0
    ingest.metric_steps_ingest(
        run_id=run.pk, steps=[(s, {"reward": 0.1 * s, "timestamp": t0 + s}) for s in (1, 2, 3, 4)]
    )
    Run.objects.filter(pk=run.pk).update(attempt=2)  # resumed from the checkpoint of step 2
    ingest.metric_steps_ingest(run_id=run.pk, steps=[(3, {"reward": 0.9, "timestamp": t0 + 100})])
    # A row without a timestamp (an old file, a direct call) gets the time it was stored.
    ingest.metric_points_ingest(run_id=run.pk, step=5, values={"reward": 1.0})
    client = api_for(owner)
    body = client.get(f"/api/v1/runs/{run.pk}/metrics/?layout=columns").json()
    assert body["series"]["reward"]["steps"] == [1, 2, 3, 4, 5]
    assert body["steps"]["step"] == [1, 2, 3, 4, 5]
    assert body["steps"]["attempt"] == [1, 1, 2, 1, 2]
    assert body["steps"]["time"][:4] == [t0 + 1, t0 + 2, t0 + 100, t0 + 4]
    assert abs(body["steps"]["time"][4] - time.time()) < 60
    since = client.get(f"/api/v1/runs/{run.pk}/metrics/?layout=columns&since_step=3").json()
    assert since["steps"]["step"] == [4, 5]
    # The points layout is as it was (no "steps" key added there).
    assert set(client.get(f"/api/v1/runs/{run.pk}/metrics/").json()) == {"series"}


def test_lines_a_killed_attempt_left_unread_keep_its_attempt_when_the_next_one_catches_up(tmp_path):
    """The supervisor of attempt 2 first stores what attempt 1's killed worker had not (as attempt
    1's: the resume marker stays where the run restarted), then attempt 2's own lines."""
    owner = make_user("catchup")
    run = make_run(owner)
    sink = JsonlSink(tmp_path)
    for step in (1, 2):
        sink.metrics(step, {"reward": 0.1 * step})
    RunOutputTailer(run_id=run.pk, output_dir=tmp_path).poll()
    for step in (3, 4):  # written by attempt 1's trainer; its worker was killed before storing them
        sink.metrics(step, {"reward": 0.1 * step})
    Run.objects.filter(pk=run.pk).update(attempt=2)
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    tailer.drain(attempt=1)  # as RunSupervisor._attempt does before starting attempt 2's trainer
    sink.metrics(3, {"reward": 0.9})  # attempt 2 resumed from the checkpoint of step 2
    tailer.poll()
    attempts = dict(MetricStep.objects.filter(run=run).values_list("step", "attempt"))
    assert attempts == {1: 1, 2: 1, 3: 2, 4: 1}


def test_the_published_message_carries_time_and_attempt(monkeypatch, django_capture_on_commit_callbacks):
    from controlplane.runs.consumers import _metrics_message

    owner = make_user("pub")
    run = make_run(owner, attempt=3)
    sent: list[dict] = []
    monkeypatch.setattr(ingest, "_message_publish", lambda run_id, message: sent.append(message))
    with django_capture_on_commit_callbacks(execute=True):
        ingest.metric_steps_ingest(run_id=run.pk, steps=[(7, {"loss": 1.0, "timestamp": 1_767_225_600.5})])
        ingest.metric_steps_ingest(
            run_id=run.pk, steps=[(8, {"loss": 2.0}), (9, {"loss": 3.0, "timestamp": "x"})]
        )
    assert sent[0] == {
        "type": "run.metrics",
        "step": 7,
        "values": {"loss": 1.0},
        "time": 1_767_225_600.5,
        "attempt": 3,
    }
    assert [(i["step"], i["attempt"]) for i in sent[1]["steps"]] == [(8, 3), (9, 3)]
    assert all(abs(i["time"] - time.time()) < 60 for i in sent[1]["steps"])  # stored now
    # The consumer forwards them; a message of an older publisher gets nulls.
    assert _metrics_message(sent[0] | {"type": "x"}) == {
        "type": "metrics",
        "step": 7,
        "values": {"loss": 1.0},
        "time": 1_767_225_600.5,
        "attempt": 3,
    }
    assert _metrics_message({"step": 7, "values": {}})["time"] is None


def test_chart_preferences_are_per_user_authenticated_and_validated(settings):
    settings.GRPO_MAX_PINNED_CHARTS = 3
    alice, bob = make_user("alice"), make_user("bob")
    assert Client().get("/api/v1/preferences/charts/").status_code in (401, 403)
    assert APIClient().put(
        "/api/v1/preferences/charts/", {"pinned": ["reward"]}, format="json"
    ).status_code in (401, 403)
    a, b = api_for(alice), api_for(bob)
    assert a.get("/api/v1/preferences/charts/").json() == {
        "pinned": ["reward", "loss", "entropy", "perf/step_s"],
        "default": True,
    }
    resp = a.put(
        "/api/v1/preferences/charts/", {"pinned": ["rollout/concurrency", "reward", "reward"]}, format="json"
    )
    assert resp.status_code == 200, resp.content
    assert resp.json() == {"pinned": ["rollout/concurrency", "reward"], "default": False}
    assert a.get("/api/v1/preferences/charts/").json()["pinned"] == ["rollout/concurrency", "reward"]
    assert b.get("/api/v1/preferences/charts/").json()["default"] is True  # bob sees none of alice's
    too_many = a.put("/api/v1/preferences/charts/", {"pinned": ["a", "b", "c", "d"]}, format="json")
    assert too_many.status_code == 400
    assert (
        "at most 3" in too_many.json()["pinned"][0]
        and "GRPO_MAX_PINNED_CHARTS" in too_many.json()["pinned"][0]
    )
    for bad in ({"pinned": "reward"}, {"pinned": ["x" * 201]}, {"pinned": [""]}, {}):
        resp = a.put("/api/v1/preferences/charts/", bad, format="json")
        assert resp.status_code == 400 and "pinned" in resp.json(), (bad, resp.content)
    # Unpinning everything is a choice, kept (not the defaults again).
    assert a.put("/api/v1/preferences/charts/", {"pinned": []}, format="json").json() == {
        "pinned": [],
        "default": False,
    }
    assert ChartPreference.objects.count() == 1
