"""Run comparison on the server: the config diff selector, ``GET /api/v1/runs/compare/`` and the
comparison page's query (issue 22 item 4). Real Postgres (pytest-django); the page's drawing and
live updates are in tests/test_compare_browser.py."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from controlplane.runs import selectors
from controlplane.runs.models import Run
from controlplane.runs.services import ingest
from tests.test_run_downloads import api_for

pytestmark = pytest.mark.django_db


def make_user(name: str):
    return get_user_model().objects.create_user(username=name, password=None)


def make_run(owner, *, name: str = "run", config: dict | None = None) -> Run:
    config = config or {"model": "tiny", "train_dataset": "arithmetic-small", "reward_funcs": [], "args": {}}
    return Run.objects.create(owner=owner, name=name, config=config, config_sha256="0" * 64)


def browser_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def unsaved(config) -> Run:
    return Run(config=config)


def test_config_flatten_walks_mappings_and_lists_of_mappings_only():
    doc = {
        "model": "tiny",
        "reward_funcs": ["a.b", "c.d"],
        "args": {"learning_rate": 1e-5, "lr_scheduler_kwargs": {}, "nested": {"deep": {"x": None}}},
        "tools": [{"name": "calc", "opts": {"n": 1}}, "plain"],
    }
    assert selectors.config_flatten(doc) == {
        "model": "tiny",
        "reward_funcs": ["a.b", "c.d"],  # a list of plain values is one leaf
        "args.learning_rate": 1e-5,
        "args.lr_scheduler_kwargs": {},  # an empty mapping is a leaf, not nothing
        "args.nested.deep.x": None,
        "tools[0].name": "calc",
        "tools[0].opts.n": 1,
        "tools[1]": "plain",
    }


def test_config_diff_rows_by_key_with_missing_keys_and_lists():
    a = {"model": "tiny", "reward_funcs": ["r.acc"], "args": {"learning_rate": 1e-5, "seed": 1, "beta": None}}
    b = {
        "model": "tiny",
        "reward_funcs": ["r.acc", "r.len"],
        "args": {"learning_rate": 2e-5, "seed": 1.0, "max_steps": 10},
    }
    rows = {row["key"]: row for row in selectors.run_config_diff(runs=[unsaved(a), unsaved(b)])}
    assert list(rows) == sorted(rows)  # sorted by key
    assert rows["model"] == {
        "key": "model",
        "values": ["tiny", "tiny"],
        "present": [True, True],
        "differs": False,
    }
    assert rows["args.learning_rate"]["differs"] and rows["args.learning_rate"]["values"] == [1e-5, 2e-5]
    assert not rows["args.seed"]["differs"]  # 1 and 1.0: one number
    assert rows["reward_funcs"]["differs"] and rows["reward_funcs"]["values"] == [
        ["r.acc"],
        ["r.acc", "r.len"],
    ]
    # a key one side lacks: absent, which differs even from an explicit null
    assert rows["args.max_steps"] == {
        "key": "args.max_steps",
        "values": [None, 10],
        "present": [False, True],
        "differs": True,
    }
    assert rows["args.beta"]["present"] == [True, False] and rows["args.beta"]["differs"]
    # true and 1 are not one value
    flags = selectors.run_config_diff(runs=[unsaved({"x": True}), unsaved({"x": 1})])
    assert flags[0]["differs"]
    # three runs: a key differs when any one of them has another value; one run differs nowhere
    three = selectors.run_config_diff(runs=[unsaved({"k": 1}), unsaved({"k": 1}), unsaved({"k": 2})])
    assert three == [{"key": "k", "values": [1, 1, 2], "present": [True, True, True], "differs": True}]
    assert not any(row["differs"] for row in selectors.run_config_diff(runs=[unsaved(a)]))


def test_compare_api_answers_runs_and_diff_only_for_visible_runs():
    alice, bob = make_user("alice"), make_user("bob")
    base = {"model": "tiny", "train_dataset": "arithmetic-small", "reward_funcs": [], "args": {"seed": 1}}
    first = make_run(alice, name="lr low", config=base | {"args": {"seed": 1, "learning_rate": 1e-5}})
    second = make_run(alice, name="lr high", config=base | {"args": {"seed": 1, "learning_rate": 3e-5}})
    hidden = make_run(bob, name="bobs")
    api = api_for(alice)
    answer = api.get(f"/api/v1/runs/compare/?ids={second.pk},{first.pk}")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert [r["id"] for r in body["runs"]] == [second.pk, first.pk]  # the order asked
    assert [r["name"] for r in body["runs"]] == ["lr high", "lr low"]
    differing = [row for row in body["diff"] if row["differs"]]
    assert differing == [
        {"key": "args.learning_rate", "values": [3e-5, 1e-5], "present": [True, True], "differs": True}
    ]
    assert {row["key"] for row in body["diff"]} >= {"model", "args.seed"}
    # someone else's run reads as absent (404), never as its data
    refused = api.get(f"/api/v1/runs/compare/?ids={first.pk},{hidden.pk}")
    assert refused.status_code == 404 and str(hidden.pk) in refused.json()["detail"]
    assert "bobs" not in refused.content.decode()
    # bad input names the field and the fix
    for query, fragment in (("", "give the runs"), ("?ids=", "give the runs"), ("?ids=1,x", "not a run id")):
        bad = api.get("/api/v1/runs/compare/" + query)
        assert bad.status_code == 400 and "ids" in bad.json(), (query, bad.content)
        assert fragment in " ".join(bad.json()["ids"]), bad.json()
    assert APIClient().get(f"/api/v1/runs/compare/?ids={first.pk}").status_code in (401, 403)


def test_too_many_runs_is_a_clear_400_on_the_api_and_the_page(settings):
    settings.GRPO_COMPARE_MAX_RUNS = 3
    alice = make_user("alice")
    ids = ",".join(str(make_run(alice, name=f"r{i}").pk) for i in range(4))
    answer = api_for(alice).get(f"/api/v1/runs/compare/?ids={ids}")
    assert answer.status_code == 400
    message = answer.json()["ids"][0]
    assert "at most 3 runs" in message and "4 given" in message and "GRPO_COMPARE_MAX_RUNS" in message
    page = browser_for(alice).get(f"/runs/compare/?runs={ids}")
    assert page.status_code == 400
    html = page.content.decode()
    assert 'id="query-errors"' in html and "at most 3 runs" in html
    assert "data-run-id" not in html.split('id="compare-runs"')[1].split("</ul>")[0]  # nothing drawn
    # the same run twice counts once
    first = ids.split(",")[0]
    assert browser_for(alice).get(f"/runs/compare/?runs={first},{first},{first},{first}").status_code == 200
    settings.GRPO_COMPARE_MAX_METRICS = 2
    page = browser_for(alice).get(f"/runs/compare/?runs={first}&metrics=a,b,c")
    assert page.status_code == 400 and "at most 2 metrics" in page.content.decode()


def page_data(html: str) -> dict:
    start = html.index('<script id="compare-data" type="application/json">') + len(
        '<script id="compare-data" type="application/json">'
    )
    return json.loads(html[start : html.index("</script>", start)])


def test_compare_page_metrics_defaults_picker_and_diff():
    alice, bob = make_user("alice"), make_user("bob")
    first = make_run(alice, name="<b>bold</b>", config={"model": "tiny", "args": {"learning_rate": 1e-5}})
    second = make_run(alice, name="second", config={"model": "tiny", "args": {"learning_rate": 2e-5}})
    hidden = make_run(bob, name="bobs")
    ingest.metric_points_ingest(
        run_id=first.pk, step=1, values={"reward": 0.5, "loss": 0.2, "my_plugin_metric": 1}
    )
    ingest.metric_points_ingest(run_id=second.pk, step=1, values={"rollout/vllm_kv_cache_usage_frac": 0.5})
    browser = browser_for(alice)

    # several metrics, in the order asked; runs in the order asked; someone else's run left out
    html = browser.get(
        f"/runs/compare/?runs={second.pk},{first.pk},{hidden.pk}&metrics=loss,rollout/vllm_kv_cache_usage_frac"
    ).content.decode()
    data = page_data(html)
    assert [r["id"] for r in data["runs"]] == [second.pk, first.pk]
    assert data["runs"][1]["label"] == f"#{first.pk} <b>bold</b>"  # text for textContent, not markup
    assert data["runs"][0]["ws"] == f"/ws/runs/{second.pk}/" and data["runs"][0]["status"] == "queued"
    assert [m["name"] for m in data["metrics"]] == ["loss", "rollout/vllm_kv_cache_usage_frac"]
    assert data["metrics"][1]["namespace"] == "rollout" and "KV" in data["metrics"][1]["help"]
    assert "<b>bold</b>" not in html and "&lt;b&gt;bold&lt;/b&gt;" in html  # escaped where rendered
    assert f"#{hidden.pk}" in html.split('id="compare-missing"')[1].split("</p>")[0]
    assert "bobs" not in html
    # the picker: every logged name, grouped by the catalogue's namespaces in its order
    picker = html[
        html.index('id="metric-picker"') : html.index("</details>", html.index('id="metric-picker"'))
    ]
    namespaces = [part.split('"')[0] for part in picker.split('data-namespace="')[1:]]
    assert namespaces == ["train", "rollout"]
    assert 'value="loss" checked' in picker and 'value="reward">' in picker
    assert 'value="my_plugin_metric">' in picker  # an undeclared (plugin) name under "train"
    # the config diff: the differing key shown, the identical ones behind the toggle
    diff = html[html.index('id="config-diff"') :]
    assert '<tr class="differs" data-key="args.learning_rate">' in diff
    assert '<tr class="same" data-key="model">' in diff
    assert "1 of 2 keys differ" in html and "show all 2 keys" in html

    # no metric chosen: reward and loss; the one-metric ?metric= link still works
    assert [
        m["name"]
        for m in page_data(browser.get(f"/runs/compare/?runs={first.pk}").content.decode())["metrics"]
    ] == [
        "reward",
        "loss",
    ]
    old = page_data(
        browser.get(f"/runs/compare/?run={first.pk}&run={second.pk}&metric=reward").content.decode()
    )
    assert [m["name"] for m in old["metrics"]] == ["reward"] and len(old["runs"]) == 2
    # runs that logged neither reward nor loss: what they have
    only_kv = page_data(browser.get(f"/runs/compare/?runs={second.pk}").content.decode())
    assert [m["name"] for m in only_kv["metrics"]] == ["rollout/vllm_kv_cache_usage_frac"]
    # bad ids are a 400 naming the field
    bad = browser.get("/runs/compare/?runs=3,x²")
    assert (
        bad.status_code == 400 and "runs:" in bad.content.decode() and "not a run id" in bad.content.decode()
    )
    assert Client().get("/runs/compare/").status_code == 302  # login required


def test_run_page_offers_compare_with():
    alice = make_user("alice")
    run = make_run(alice)
    html = browser_for(alice).get(f"/runs/{run.pk}/").content.decode()
    assert 'id="compare-with"' in html and f'data-run-id="{run.pk}"' in html
    assert 'data-compare="/runs/compare/"' in html and 'data-api="/api/v1/runs/"' in html
    assert 'data-max-runs="8"' in html and "runs/compare_with.js" in html
