"""Database connections under concurrent requests to daphne (issue 17 item 1).

With ``conn_max_age=60`` every thread that ran a request kept its connection: 400 metric reads from
10 clients gave 43 × 500 ("too many clients already") and one daphne held 71 connections. The
daphne here runs with the default settings and ``PGAPPNAME`` so that its connections can be counted
in ``pg_stat_activity`` while the load runs (``bench/load.py`` measures 2,000 from 20 clients).
"""

from __future__ import annotations

import os
import time

import pytest

from bench.load import bench_connections, connections_held
from controlplane.runs import services
from controlplane.runs.services import ingest
from tests.conftest import daphne_on_test_db

pytestmark = pytest.mark.django_db(transaction=True)

CLIENTS = 10


def test_concurrent_reads_keep_no_connection_and_never_fail(tmp_path, django_user_model):
    user = django_user_model.objects.create_user("reader")
    token = services.token_issue(username="reader")
    run, _ = services.run_create(
        owner=user,
        config={
            "model": "tiny",
            "train_dataset": "arithmetic-small",
            "reward_funcs": ["trainer.rewards.accuracy_reward"],
            "args": {"max_steps": 200, "max_completion_length": 128},
        },
        launch=False,
    )
    ingest.metric_steps_ingest(
        run_id=run.pk, steps=[(s, {"reward": s / 200, "loss": 0.1}) for s in range(1, 201)]
    )
    app_name = f"grpo-conn-test-{os.getpid()}"
    env = {"PGAPPNAME": app_name}
    if "GRPO_DB_CONN_MAX_AGE" in os.environ:  # the default is what is under test
        env["GRPO_DB_CONN_MAX_AGE"] = "0"
    with daphne_on_test_db(tmp_path / "daphne.log", queue="unused", env=env) as base:
        result = bench_connections(
            base,
            f"/api/v1/runs/{run.pk}/metrics/",
            token,
            requests=400,
            clients=CLIENTS,
            app_name=app_name,
        )
        # Connections of the requests that just ended close on daphne's threads a moment later
        # (one was seen still closing under CI load): wait briefly for them, then count.
        deadline = time.monotonic() + 5
        while (left := connections_held(app_name)) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert result["server_errors"] == 0, result
    assert result["status_counts"] == {"200": 400}, result
    # One connection per request in flight, plus those of requests just answered: Django closes a
    # request's connection after its response is sent, and Postgres counts the backend until it has
    # exited, so a client can be into its next request before its last connection is gone (14 for 10
    # clients was seen on a loaded CI box). Kept connections grow without bound instead (71 before
    # the fix, and they stay: the check after the load).
    assert result["max_connections_held"] <= 2 * CLIENTS, result
    assert left <= 1, left  # idle daphne keeps none (at most the one finishing as we look)
