"""Issue 29 item 1: the per-user creation rate and queued-run cap hold under parallel requests.

Real parallel clients (threads, one connection each) against daphne on the real Postgres: 16 of
them once let 40 of 40 creations through a 30/min limit, and 30 left 23 queued against a cap of 20
(each request read the counts, then wrote). The counts are now read and the run written under a
lock on the owner's row (``services.lifecycle._creation_limits_check``).
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.error import HTTPError

import pytest

from controlplane.runs import services
from controlplane.runs.models import Run
from tests.conftest import daphne_on_test_db
from trainer.config.run_config import RunConfigError

pytestmark = pytest.mark.django_db(transaction=True)

CLIENTS = 12
DOCUMENT = {
    "model": "tiny",
    "train_dataset": "arithmetic-small",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {"max_steps": 2, "max_completion_length": 64},
}


def create_in_parallel(base: str, token: str, n: int) -> list[tuple[int, dict]]:
    """``n`` run creations from ``CLIENTS`` concurrent clients; (status, body) of each."""

    def one(i: int) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"{base}/api/v1/runs/",
            data=json.dumps({"name": f"parallel {i}", "config": DOCUMENT}).encode(),
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except HTTPError as exc:
            return exc.code, {
                "detail": exc.read().decode()[:300],
                "retry_after": exc.headers.get("Retry-After"),
            }

    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        return list(pool.map(one, range(n)))


def test_the_rate_and_the_queued_cap_hold_for_parallel_creations(tmp_path, django_user_model):
    token = services.token_issue(username="eager")
    owner = django_user_model.objects.get(username="eager")
    env = {"GRPO_RUN_CREATE_RATE": "7/min", "GRPO_MAX_QUEUED_RUNS_PER_USER": "1000"}
    with daphne_on_test_db(tmp_path / "rate.log", queue="unused", env=env) as base:
        answers = create_in_parallel(base, token, 3 * CLIENTS)
    codes = sorted(code for code, _ in answers)
    assert codes.count(201) == 7 and codes.count(429) == len(codes) - 7, [
        a for a in answers if a[0] not in (201, 429)
    ]
    assert Run.objects.filter(owner=owner).count() == 7
    assert all(int(body["retry_after"]) > 0 for code, body in answers if code == 429)

    for run in Run.objects.filter(owner=owner):  # none queued now: the cap starts from zero
        services.run_stop(run=run)
    # The API's request throttle (DRF's, which counts requests, not runs) is set out of the way:
    # the bound under test is the database's.
    env = {"GRPO_RUN_CREATE_RATE": "1000/min", "GRPO_MAX_QUEUED_RUNS_PER_USER": "4"}
    with daphne_on_test_db(tmp_path / "cap.log", queue="unused", env=env) as base:
        answers = create_in_parallel(base, token, 3 * CLIENTS)
    codes = sorted(code for code, _ in answers)
    assert codes.count(201) == 4 and codes.count(429) == len(codes) - 4, [
        a for a in answers if a[0] not in (201, 429)
    ]
    assert Run.objects.filter(owner=owner, status="queued").count() == 4
    assert all("GRPO_MAX_QUEUED_RUNS_PER_USER" in body["detail"] for code, body in answers if code == 429)


def test_a_creation_over_the_cap_is_refused_before_the_launch_checks(django_user_model, settings):
    """The limits are read before the launch checks (then again under the lock): a user at the cap
    gets the 429's reason at once, without the launch checks' second of loading a tokenizer and a
    dataset. The document here passes its own rules but fails the launch checks (its completions do
    not fit the model's context), so checks made first would say so. A document that breaks its own
    rules is still told so first (tests/test_runs_api.py: a 400 while capped)."""
    owner = django_user_model.objects.create_user(username="capped")
    settings.GRPO_MAX_QUEUED_RUNS_PER_USER = 1
    services.run_create(owner=owner, config=DOCUMENT, launch=False)
    too_long = {**DOCUMENT, "args": {**DOCUMENT["args"], "max_completion_length": 100_000}}
    with pytest.raises(services.QueuedRunsLimit, match="GRPO_MAX_QUEUED_RUNS_PER_USER"):
        services.run_create(owner=owner, config=too_long, launch=False)
    assert Run.objects.filter(owner=owner).count() == 1
    # below the cap the same document is refused by the launch checks, naming the field
    settings.GRPO_MAX_QUEUED_RUNS_PER_USER = 2
    with pytest.raises(RunConfigError) as refused:
        services.run_create(owner=owner, config=too_long, launch=False)
    assert "args.max_completion_length" in refused.value.errors
