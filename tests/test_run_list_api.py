"""The run list (issue 22, item 3) through the API and the page: server-side filters, search, sort
and pagination with the same parameters; each run's tags and note, edited by its owner with
``PATCH /api/v1/runs/<id>/`` and bounded by settings and database constraints. Real Postgres."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.runs import services
from controlplane.runs.models import MetricPoint, Run, RunStatus

pytestmark = pytest.mark.django_db


def make_user(name: str, **extra):
    return get_user_model().objects.create_user(username=name, password=None, **extra)


def api_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username=user.username))
    return client


def make_run(
    owner, name: str, *, model="tiny", dataset="arithmetic-small", status=RunStatus.QUEUED, **fields
) -> Run:
    config = {
        "model": model,
        "train_dataset": dataset,
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {"max_steps": 10},
    }
    now = timezone.now()
    if status in (RunStatus.RUNNING, RunStatus.STARTING, RunStatus.STOPPING):
        fields |= {"launched_at": now, "heartbeat_at": now, "attempt": 1, "worker_host": "h"}
    if status in (RunStatus.COMPLETED, RunStatus.STOPPED):
        fields |= {"finished_at": now}
    if status == RunStatus.FAILED:
        fields |= {"finished_at": now, "failure_reason": "boom"}
    return Run.objects.create(
        owner=owner, name=name, config=config, config_sha256="0" * 64, status=status, **fields
    )


@pytest.fixture
def alice():
    return make_user("alice")


@pytest.fixture
def bob():
    return make_user("bob")


@pytest.fixture
def runs(alice, bob):
    """Five of alice's runs and one of bob's, oldest first."""
    made = [
        make_run(alice, "lr sweep a", tags=["sweep", "lr"], note="baseline learning rate"),
        make_run(alice, "lr sweep b", tags=["sweep"], status=RunStatus.RUNNING),
        make_run(alice, "qwen try", model="Qwen/Qwen3-0.6B", status=RunStatus.COMPLETED),
        make_run(alice, "gsm run", dataset="gsm8k", status=RunStatus.FAILED, note="OOM at step 3"),
        make_run(alice, "zeta", tags=["ablation:kl"], status=RunStatus.RUNNING),
        make_run(bob, "bob's sweep", tags=["sweep"]),
    ]
    MetricPoint.objects.bulk_create(
        [MetricPoint(run=made[1], step=s, name="reward", value=s / 10) for s in range(1, 8)]
        + [MetricPoint(run=made[4], step=s, name="reward", value=0.5) for s in range(1, 3)]
    )
    return made


def names(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [r["name"] for r in response.json()["results"]]


def test_api_list_filters_search_and_sorts_on_the_server(alice, runs):
    api = api_for(alice)
    get = lambda query: names(api.get("/api/v1/runs/" + query))  # noqa: E731
    assert get("") == ["zeta", "gsm run", "qwen try", "lr sweep b", "lr sweep a"]  # newest first, own only
    assert get("?status=running") == ["zeta", "lr sweep b"]
    assert get("?status=failed,completed") == ["gsm run", "qwen try"]
    assert get("?model=qwen") == ["qwen try"]  # substring, any case
    assert get("?dataset=GSM") == ["gsm run"]
    assert get("?tag=sweep") == ["lr sweep b", "lr sweep a"]
    assert get("?tag=sweep,lr") == ["lr sweep a"]  # every tag given
    assert get("?q=oom") == ["gsm run"]  # the note
    assert get("?q=ablation") == ["zeta"]  # a tag
    assert get("?q=Qwen3") == ["qwen try"]  # the model
    assert get("?q=alice") == get("")  # the owner
    assert get("?ordering=name") == ["gsm run", "lr sweep a", "lr sweep b", "qwen try", "zeta"]
    assert get("?ordering=-name") == ["zeta", "qwen try", "lr sweep b", "lr sweep a", "gsm run"]
    assert get("?ordering=-step")[:2] == ["lr sweep b", "zeta"]  # most progress first, none last
    assert get("?ordering=model")[0] == "qwen try" and get("?ordering=-model")[-1] == "qwen try"
    assert get("?owner=bob") == []  # bob's runs stay invisible to alice
    assert get(f"?id={runs[0].pk},{runs[4].pk},{runs[5].pk}") == ["zeta", "lr sweep a"]  # bob's is not hers
    assert api.get("/api/v1/runs/?id=1,%C2%B2").status_code == 400
    body = api.get("/api/v1/runs/?status=running&ordering=-step").json()
    first = body["results"][0]
    assert (first["step"], first["max_steps"], first["last_reward"]) == (7, 10, 0.7)
    assert first["tags"] == ["sweep"] and first["note"] == "" and "config" not in first


def test_api_list_staff_filter_by_owner_and_bad_queries_are_400(alice, runs):
    staff = api_for(make_user("ops", is_staff=True))
    assert names(staff.get("/api/v1/runs/?owner=bob")) == ["bob's sweep"]
    assert names(staff.get("/api/v1/runs/?tag=sweep&owner=alice")) == ["lr sweep b", "lr sweep a"]
    api = api_for(alice)
    bad = api.get("/api/v1/runs/?status=runing")
    assert bad.status_code == 400 and "status" in bad.json()
    assert api.get("/api/v1/runs/?ordering=config").status_code == 400
    assert api.get("/api/v1/runs/?q=" + "x" * 201).status_code == 400


def test_api_list_pages_by_the_setting(alice, runs, settings):
    settings.GRPO_RUN_LIST_PAGE_SIZE = 2
    api = api_for(alice)
    body = api.get("/api/v1/runs/?ordering=name").json()
    assert body["count"] == 5 and [r["name"] for r in body["results"]] == ["gsm run", "lr sweep a"]
    query = parse_qs(urlsplit(body["next"]).query)
    assert query["page"] == ["2"] and query["ordering"] == ["name"]  # the filters ride along
    assert names(api.get("/api/v1/runs/?ordering=name&page=3")) == ["zeta"]
    assert len(api.get("/api/v1/runs/?page_size=4").json()["results"]) == 4


def test_owner_edits_tags_and_note_through_the_api(alice, bob, runs):
    run = runs[1]
    response = api_for(alice).patch(
        f"/api/v1/runs/{run.pk}/",
        {"tags": ["best", "lr:3e-6", "best"], "note": "keep\nthis one"},
        format="json",
    )
    assert response.status_code == 200, response.content
    assert response.json()["tags"] == ["best", "lr:3e-6"] and response.json()["note"] == "keep\nthis one"
    run.refresh_from_db()
    assert run.tags == ["best", "lr:3e-6"] and run.note == "keep\nthis one"
    assert run.status == RunStatus.RUNNING  # nothing else is written
    # One field at a time; the other is left alone.
    assert api_for(alice).patch(f"/api/v1/runs/{run.pk}/", {"note": ""}, format="json").status_code == 200
    run.refresh_from_db()
    assert run.tags == ["best", "lr:3e-6"] and run.note == ""
    assert api_for(alice).get(f"/api/v1/runs/{run.pk}/").json()["tags"] == ["best", "lr:3e-6"]
    # The config and status cannot be changed this way (unknown fields are ignored; nothing given: 400).
    response = api_for(alice).patch(f"/api/v1/runs/{run.pk}/", {"status": "completed"}, format="json")
    assert response.status_code == 400
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING


def test_only_the_owner_edits_tags_and_note(alice, bob, runs):
    run = runs[0]
    assert api_for(bob).patch(f"/api/v1/runs/{run.pk}/", {"note": "mine"}, format="json").status_code == 404
    staff = api_for(make_user("ops", is_staff=True))
    assert staff.get(f"/api/v1/runs/{run.pk}/").status_code == 200  # staff read every run
    assert staff.patch(f"/api/v1/runs/{run.pk}/", {"note": "mine"}, format="json").status_code == 403
    assert APIClient().patch(f"/api/v1/runs/{run.pk}/", {"note": "x"}, format="json").status_code in (
        401,
        403,
    )
    web = Client(enforce_csrf_checks=True)
    web.force_login(alice)
    assert (
        web.patch(f"/api/v1/runs/{run.pk}/", '{"note": "x"}', content_type="application/json").status_code
        == 403
    )
    run.refresh_from_db()
    assert run.note == "baseline learning rate"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"tags": ["two words"]}, "tags"),
        ({"tags": ["a,b"]}, "tags"),
        ({"tags": [""]}, "tags"),
        ({"tags": ["x" * 41]}, "tags"),  # GRPO_RUN_TAG_MAX_CHARS = 40
        ({"tags": [f"t{i}" for i in range(17)]}, "tags"),  # GRPO_RUN_MAX_TAGS = 16
        ({"tags": "sweep"}, "tags"),
        ({"note": "n" * 4001}, "note"),  # GRPO_RUN_NOTE_MAX_CHARS = 4000
        ({"note": "a\x00b"}, "note"),
        ({}, "non_field_errors"),
    ],
)
def test_tags_and_note_are_validated_against_the_settings(alice, runs, payload, field):
    run = runs[0]
    response = api_for(alice).patch(f"/api/v1/runs/{run.pk}/", payload, format="json")
    assert response.status_code == 400 and field in response.json(), response.content
    run.refresh_from_db()
    assert run.tags == ["sweep", "lr"] and run.note == "baseline learning rate"


def test_tag_and_note_limits_follow_the_settings(alice, runs, settings):
    settings.GRPO_RUN_MAX_TAGS, settings.GRPO_RUN_NOTE_MAX_CHARS = 2, 5
    api = api_for(alice)
    url = f"/api/v1/runs/{runs[0].pk}/"
    assert api.patch(url, {"tags": ["a", "b", "c"]}, format="json").status_code == 400
    assert api.patch(url, {"tags": ["a", "b"], "note": "12345"}, format="json").status_code == 200
    assert api.patch(url, {"note": "123456"}, format="json").status_code == 400


@pytest.mark.parametrize(
    "fields",
    [
        {"tags": ["ok", ""]},
        {"tags": [f"t{i}" for i in range(65)]},
        {"tags": ["x" * 65]},
        {"tags": ["two words"]},
        {"tags": ["a,b"]},
        {"note": "n" * 20_001},
    ],
)
def test_database_refuses_tags_and_notes_past_its_ceilings(alice, fields):
    with pytest.raises(IntegrityError), transaction.atomic():
        make_run(alice, "r", **fields)


def test_run_list_page_filters_sorts_and_pages_with_the_same_parameters(alice, runs, settings):
    settings.GRPO_RUN_LIST_PAGE_SIZE = 2
    web = Client()
    web.force_login(alice)
    page = web.get("/runs/?tag=sweep&ordering=name")
    assert page.status_code == 200
    html = page.content.decode()
    assert "lr sweep a" in html and "lr sweep b" in html and "zeta" not in html and "bob&#x27;s" not in html
    assert 'class="tag" href="?tag=lr&amp;ordering=name"' in html  # a tag filters, keeping the sort
    # the script polls the rows shown, by id
    assert f'data-poll="/api/v1/runs/?id={runs[0].pk}%2C{runs[1].pk}&amp;page_size=2"' in html
    assert "baseline learning rate" in html  # the note under the name
    # Sort links toggle the column's direction and drop the page number.
    assert 'href="?tag=sweep&amp;ordering=-name"' in html
    # Pages: 5 runs by 2.
    html = web.get("/runs/?ordering=name&page=2").content.decode()
    assert "lr sweep b" in html and "qwen try" in html and "gsm run" not in html
    assert '<span class="run-step">7 / 10</span>' in html  # progress: last step / max_steps
    assert 'href="?ordering=name&amp;page=3"' in html and 'href="?ordering=name&amp;page=1"' in html
    assert "page 2 of 3" in html
    # Search and status, and a query that matches nothing.
    html = web.get("/runs/?q=oom&status=failed").content.decode()
    assert "gsm run" in html and "lr sweep" not in html
    assert "No run matches." in web.get("/runs/?q=nothing+like+this").content.decode()
    # A bad parameter is reported, and the whole list is shown.
    bad = web.get("/runs/?ordering=bogus")
    assert bad.status_code == 400 and "ordering" in bad.content.decode() and "zeta" in bad.content.decode()


def test_run_page_offers_editing_to_the_owner_only_and_download_links(alice, runs):
    run = runs[0]
    web = Client()
    web.force_login(alice)
    html = web.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="annotations-form"' in html and 'class="tag" href="/runs/?tag=sweep"' in html
    for kind in ("metrics", "completions"):
        for fmt in ("csv", "json"):
            assert f'href="/api/v1/runs/{run.pk}/{kind}/?format={fmt}"' in html
    staff = Client()
    staff.force_login(make_user("ops", is_staff=True))
    html = staff.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="annotations-form"' not in html and "baseline learning rate" in html
