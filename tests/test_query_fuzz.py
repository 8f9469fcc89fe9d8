"""Every query parameter of every page and API view, fuzzed with Hypothesis: no input is a 5xx.

Found this way: ``/runs/compare/?runs=%C2%B2`` was a 500 (``str.isdigit`` accepts '²', ``int``
does not). The strategies mix arbitrary text with the shapes that break parsers: Unicode digits,
NUL, huge and negative integers, floats, separators.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.runs import services
from controlplane.runs.models import Run

PARAMS = (
    "runs",
    "run",
    "metric",
    "metrics",
    "ids",
    "clone",
    "names",
    "since_step",
    "layout",
    "after_id",
    "step",
    "page",
    "page_size",
    "search",
    "format",
    "status",
    "next",
    "limit",
    "offset",
    "owner",
    "model",
    "dataset",
    "tag",
    "q",
    "ordering",
    "reward_min",
    "reward_max",
    "group_id",
    "groups",
    "by",
)
TRICKY = st.sampled_from(
    [
        "²",
        "١٢",
        "-1",
        "0",
        "1e400",
        "9" * 40,
        "\x00",
        "a\x00b",
        "NaN",
        "inf",
        ",,,",
        "1,²",
        "3,5",
        " 7 ",
        "%",
        "🙂",
        "a" * 3000,
        "[]",
        "{}",
        "json",
        "api",
        "csv",
        "-step",
        "name",
    ]
)
VALUES = st.one_of(TRICKY, st.text(max_size=40), st.integers(min_value=-(10**30), max_value=10**30).map(str))
QUERY = st.dictionaries(st.sampled_from(PARAMS), st.one_of(VALUES, st.lists(VALUES, max_size=3)), max_size=4)


def _paths(run_id: int) -> list[str]:
    api = f"/api/v1/runs/{run_id}/"
    return [
        "/",
        "/healthz",
        "/runs/",
        "/runs/new/",
        "/runs/compare/",
        f"/runs/{run_id}/",
        "/api/v1/runs/",
        api,
        api + "metrics/",
        api + "completions/",
        api + "completions/steps/",
        api + "events/",
        api + "checkpoints/",
        api + "diagnosis/",
        "/api/v1/registry/",
        "/api/v1/registry/datasets/arithmetic-small/",
        "/api/v1/metrics/catalogue/",
        "/api/v1/runs/compare/",
    ]


@pytest.fixture
def logged_in(client, django_user_model):
    user = django_user_model.objects.create_user("fuzzer", password="pw")
    client.force_login(user)
    run, _ = services.run_create(
        owner=user,
        config={
            "model": "tiny",
            "train_dataset": "arithmetic-small",
            "reward_funcs": ["trainer.rewards.accuracy_reward"],
            "args": {"max_steps": 3, "max_completion_length": 128},
        },
        launch=False,
    )
    return client, run


@pytest.mark.django_db
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=QUERY, which=st.integers(min_value=0, max_value=16))
def test_no_query_parameter_makes_a_server_error(logged_in, query, which):
    client, run = logged_in
    path = _paths(run.pk)[which]
    response = client.get(path, query)
    assert response.status_code < 500, (path, query, response.status_code)
    if response.streaming:  # a download fails while it is sent, not before
        b"".join(response.streaming_content)


@pytest.mark.django_db
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    run_id=st.integers(min_value=0, max_value=10**30),
    tail=st.sampled_from(["", "metrics/", "events/", "diagnosis/"]),
)
def test_no_run_id_makes_a_server_error(logged_in, run_id, tail):
    client, _ = logged_in
    for path in (f"/api/v1/runs/{run_id}/{tail}", f"/runs/{run_id}/", f"/runs/new/?clone={run_id}"):
        response = client.get(path)
        assert response.status_code < 500, (path, response.status_code)
    assert Run.objects.count() == 1
