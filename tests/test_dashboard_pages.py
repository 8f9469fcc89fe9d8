"""What the dashboard loads over REST and the pages around it: columnar metric history, completions
by step, the diagnosis endpoint, the run list's progress, the comparison page, static files.
Real Postgres (pytest-django)."""

from __future__ import annotations

import math

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from controlplane.runs import services
from controlplane.runs.models import Run, RunEventKind
from controlplane.runs.services import ingest

pytestmark = pytest.mark.django_db


def make_user(name: str):
    return get_user_model().objects.create_user(username=name, password=None)


def make_run(owner, *, max_steps: int | None = 30, name: str = "run") -> Run:
    args = {"max_steps": max_steps} if max_steps else {"num_train_epochs": 1}
    config = {"model": "tiny", "train_dataset": "arithmetic-small", "reward_funcs": [], "args": args}
    return Run.objects.create(owner=owner, name=name, config=config, config_sha256="0" * 64)


def api_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username=user.username))
    return client


def browser_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_metric_history_in_columns_matches_points_layout():
    alice = make_user("alice")
    run = make_run(alice)
    for step in (1, 2, 3):
        ingest.metric_points_ingest(
            run_id=run.pk,
            step=step,
            values={"reward": step / 10, "perf/step_s": math.nan if step == 2 else 1.5},
        )
    api = api_for(alice)
    columns = api.get(f"/api/v1/runs/{run.pk}/metrics/?layout=columns").json()["series"]
    assert columns["reward"] == {"steps": [1, 2, 3], "values": [0.1, 0.2, 0.3]}
    assert columns["perf/step_s"] == {"steps": [1, 2, 3], "values": [1.5, None, 1.5]}  # NaN -> null
    points = api.get(f"/api/v1/runs/{run.pk}/metrics/").json()["series"]
    assert points["reward"] == [{"step": s, "value": s / 10} for s in (1, 2, 3)]
    since = api.get(f"/api/v1/runs/{run.pk}/metrics/?layout=columns&since_step=2&names=reward,nope").json()
    assert since["series"] == {"reward": {"steps": [3], "values": [0.3]}, "nope": {"steps": [], "values": []}}
    bad = api.get(f"/api/v1/runs/{run.pk}/metrics/?layout=rows")
    assert bad.status_code == 400 and "layout" in bad.json()


def test_completions_filter_by_step_and_page_size():
    alice = make_user("alice")
    run = make_run(alice)
    for step in (1, 2):
        ingest.completion_samples_ingest(
            run_id=run.pk,
            step=step,
            items=[{"prompt": f"p{i}", "completion": f"c{step}-{i}", "group_id": i // 2} for i in range(6)],
        )
    api = api_for(alice)
    body = api.get(f"/api/v1/runs/{run.pk}/completions/?step=1").json()
    assert body["count"] == 6 and {c["step"] for c in body["results"]} == {1}
    page = api.get(f"/api/v1/runs/{run.pk}/completions/?page_size=4").json()
    assert len(page["results"]) == 4 and page["count"] == 12 and page["results"][0]["step"] == 2


def test_diagnosis_endpoint_applies_the_rules_to_the_latest_steps():
    alice, bob = make_user("alice"), make_user("bob")
    run = make_run(alice)
    assert api_for(alice).get(f"/api/v1/runs/{run.pk}/diagnosis/").json() == []
    for step in range(1, 31):
        ingest.metric_points_ingest(
            run_id=run.pk,
            step=step,
            values={
                # a starved trainer: empty queue, long waits, no backpressure
                "rollout/queue_size": 0.0,
                "perf/rollout_wait_s": 4.0,
                "rollout/backpressure_s": 0.0,
                "perf/step_s": 5.0,
                "batch/samples_per_step": 64.0,
                # all groups dropped at the bottom of a 0/1 reward
                "frac_reward_zero_std": 0.9,
                "reward_dropped": 0.02,
                "reward": 0.03,
                "completions/clipped_ratio": 0.6,
            },
        )
    body = api_for(alice).get(f"/api/v1/runs/{run.pk}/diagnosis/").json()
    verdicts = {d["topic"]: d for d in body}
    assert verdicts["bottleneck"]["verdict"] == "generation_bound"
    assert verdicts["bottleneck"]["evidence"]["perf/rollout_wait_s"] == pytest.approx(4.0)
    assert verdicts["saturation"]["verdict"] == "stuck_bottom"
    assert "clipped_ratio" in verdicts["saturation"]["advice"]
    assert verdicts["clipping"]["verdict"] == "truncated"
    assert api_for(bob).get(f"/api/v1/runs/{run.pk}/diagnosis/").status_code == 404
    # every evidence key comes with the spec's name or plain words, never an internal key
    labels = verdicts["saturation"]["labels"]
    assert set(labels) == set(verdicts["saturation"]["evidence"])
    assert labels["reward_range:lo"] == "lowest reward (the reward range)"
    assert labels["frac_reward_zero_std"] == "frac_reward_zero_std"


def test_events_filter_by_kind_and_search_server_side():
    alice, bob = make_user("alice"), make_user("bob")
    run = make_run(alice)
    services.run_event_create(run_id=run.pk, kind=RunEventKind.STATUS, message="queued -> running")
    services.run_event_create(run_id=run.pk, kind=RunEventKind.LOG, message="INFO trainer: step 1 loss 0.5")
    services.run_event_create(
        run_id=run.pk, kind=RunEventKind.LOG, message="ERROR trainer: CUDA out of memory"
    )
    services.run_event_create(run_id=run.pk, kind=RunEventKind.ERROR, message="trainer exited: Out Of Memory")
    api = api_for(alice)
    url = f"/api/v1/runs/{run.pk}/events/"

    def messages(query: str) -> list[str]:
        response = api.get(url + query)
        assert response.status_code == 200, response.content
        return [e["message"] for e in response.json()]

    assert len(messages("")) == 4
    assert len(messages("?kind=&q=")) == 4  # empty filters: everything
    assert messages("?kind=log") == ["INFO trainer: step 1 loss 0.5", "ERROR trainer: CUDA out of memory"]
    assert messages("?q=out%20of%20memory") == [
        "ERROR trainer: CUDA out of memory",
        "trainer exited: Out Of Memory",
    ]
    assert messages("?kind=error&q=memory") == ["trainer exited: Out Of Memory"]
    assert messages("?kind=status&q=memory") == []
    first = api.get(url).json()[0]["id"]
    assert messages(f"?after_id={first}&kind=log&q=step") == ["INFO trainer: step 1 loss 0.5"]
    assert api.get(url + "?kind=nope").status_code == 400
    assert api.get(url + "?q=" + "x" * 201).status_code == 400
    assert api_for(bob).get(url + "?kind=log").status_code == 404
    # the page's kind filter offers every kind (and "all"); the diagnosis starts as a closed strip
    html = browser_for(alice).get(f"/runs/{run.pk}/").content.decode()
    options = html[html.index('id="event-kind"') : html.index("</select>", html.index('id="event-kind"'))]
    assert '<option value="">all</option>' in options
    for kind in RunEventKind.values:
        assert f'<option value="{kind}">' in options, kind
    assert '<details id="diagnosis-panel">' in html and 'id="event-search"' in html


def test_run_list_shows_progress_and_last_reward_and_compare_overlays_own_runs():
    alice, bob = make_user("alice"), make_user("bob")
    first, second = make_run(alice, name="first"), make_run(alice, name="second", max_steps=None)
    hidden = make_run(bob, name="bobs")
    ingest.metric_points_ingest(run_id=first.pk, step=7, values={"reward": 0.625, "loss": 0.1})
    ingest.metric_points_ingest(run_id=first.pk, step=8, values={"loss": 0.1})
    ingest.metric_points_ingest(run_id=second.pk, step=2, values={"reward": 0.25, "entropy": 1.0})
    browser = browser_for(alice)
    html = browser.get("/runs/").content.decode()
    row = html[html.index(f'data-run-id="{first.pk}"') :]
    row = row[: row.index("</tr>")]
    assert "8 / 30" in row and "0.625" in row and 'style="width:27%"' in row
    html = browser.get(
        f"/runs/compare/?run={first.pk}&run={second.pk}&run={hidden.pk}&metric=loss"
    ).content.decode()
    assert f'data-run-id="{first.pk}"' in html and f'data-run-id="{second.pk}"' in html
    assert f'data-run-id="{hidden.pk}"' not in html  # someone else's run is not shown
    # the metric picker: the chosen one checked, every other name logged by these runs offered
    assert 'name="metric" value="loss" checked' in html and 'name="metric" value="entropy">' in html
    assert "runs/compare.js" in html and "vendor/uplot/uPlot.iife.min.js" in html


def test_run_page_carries_what_the_dashboard_script_needs():
    alice = make_user("alice")
    run = make_run(alice, max_steps=12)
    html = browser_for(alice).get(f"/runs/{run.pk}/").content.decode()
    assert f'data-ws="/ws/runs/{run.pk}/"' in html and 'data-max-steps="12"' in html
    assert f'data-api="/api/v1/runs/{run.pk}/"' in html
    assert 'data-catalogue="/api/v1/metrics/catalogue/"' in html  # chart groups and title tooltips
    scripts = (
        "vendor/uplot/uPlot.iife.min.js",
        "runs/dom.js",
        "runs/charts.js",
        "runs/chart_kit.js",
        "runs/chart_pins.js",
        "runs/metric_panel.js",
        "runs/completion_panel.js",
        "runs/dashboard.js",
    )
    assert [html.index(script) for script in scripts] == sorted(html.index(script) for script in scripts)
    assert 'data-preferences="/api/v1/preferences/charts/"' in html  # pinned charts, per user
    assert 'id="stop-form"' in html and f'data-api="/api/v1/runs/{run.pk}/stop/"' in html
    assert Client().get(f"/runs/{run.pk}/").status_code == 302  # login required


def test_static_files_are_served_by_the_asgi_app():
    """The vendored chart library is found by the static finders the ASGI app serves from."""
    from django.contrib.staticfiles import finders

    for path in ("vendor/uplot/uPlot.iife.min.js", "vendor/uplot/LICENSE", "runs/dashboard.js"):
        assert finders.find(path), path


def test_run_page_lists_checkpoints_with_download_and_new_run_links():
    """Issue 28 item 6: each checkpoint row offers "new run from this checkpoint" and, to the run's
    owner, its download; the card carries the same links' prefixes for the rows dashboard.js adds
    from the socket's ``checkpoint`` messages."""
    alice = make_user("alice")
    run = make_run(alice)
    empty = browser_for(alice).get(f"/runs/{run.pk}/").content.decode()
    assert 'id="checkpoints-empty"' in empty and "None yet." in empty
    ingest.checkpoint_record(run_id=run.pk, step=50, path="/runs/out/checkpoint-50")
    ingest.checkpoint_record(run_id=run.pk, step=100, path="/runs/out/checkpoint-100")
    html = browser_for(alice).get(f"/runs/{run.pk}/").content.decode()
    card = html[html.index('id="checkpoints-panel"') : html.index("<h2>Config</h2>")]
    assert "None yet." not in card
    assert card.index('data-step="50"') < card.index('data-step="100"')
    assert "<code>/runs/out/checkpoint-50</code>" in card
    download = f"/runs/{run.pk}/checkpoints/50/download/"
    assert f'href="{download}"' in card and "download (tar)" in card
    assert f'href="/runs/new/?clone={run.pk}&amp;checkpoint=50"' in card
    # What dashboard.js builds a live row's links from: prefix + step (+ "/download/").
    assert f'data-download="/runs/{run.pk}/checkpoints/"' in card
    assert f'data-new-run="/runs/new/?clone={run.pk}&amp;checkpoint="' in card
    # Staff see the run and may start from its checkpoints, but its weights are the owner's.
    boss = get_user_model().objects.create_user(username="boss", password=None, is_staff=True)
    staff = browser_for(boss).get(f"/runs/{run.pk}/").content.decode()
    staff_card = staff[staff.index('id="checkpoints-panel"') : staff.index("<h2>Config</h2>")]
    assert "/download/" not in staff_card and "data-download" not in staff_card
    assert f"clone={run.pk}&amp;checkpoint=100" in staff_card
