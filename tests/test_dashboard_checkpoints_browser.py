"""Issue 28 item 6 in a real browser (Debian Chromium driven by Playwright, daphne on the test
database; no worker, no vLLM: checkpoints are stored by the real ingest service, as the
supervisor's tailer stores them): the run page's Checkpoints panel follows the socket, each row with
its download and "new run from this checkpoint" links, in step order, a re-saved step replacing
its row."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from controlplane.runs.services import ingest
from tests.conftest import DbThread, browser_login, chromium_page, daphne_on_test_db
from tests.test_dashboard_soak import running_run

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "s3cret-pass"


def test_checkpoints_appear_live_with_their_links(tmp_path):
    from playwright.sync_api import sync_playwright

    alice = get_user_model().objects.create_user(username="alice", password=PASSWORD)
    run = running_run(alice, name="checkpoints", reward_funcs=(), max_steps=100)

    def rows(page) -> list[tuple[str, str]]:
        return page.eval_on_selector_all(
            "#checkpoints li[data-step]",
            "els => els.map(e => [e.dataset.step, e.querySelector('code').textContent])",
        )

    with (
        DbThread() as db,
        daphne_on_test_db(tmp_path / "daphne.log", queue="unused") as base,
        sync_playwright() as pw,
        chromium_page(pw) as (page, errors),
    ):
        browser_login(page, base, "alice", PASSWORD, f"/runs/{run.pk}/")
        page.wait_for_selector("#conn.live", timeout=30_000)
        assert page.inner_text("#checkpoints") == "None yet."

        db(ingest.run_output_ingest, run_id=run.pk, checkpoints=[(50, "/out/checkpoint-50")], cursors={})
        page.wait_for_selector('#checkpoints li[data-step="50"]', timeout=15_000)
        assert page.query_selector("#checkpoints-empty") is None
        row = '#checkpoints li[data-step="50"]'
        assert page.get_attribute(f"{row} a.checkpoint-download", "href") == (
            f"/runs/{run.pk}/checkpoints/50/download/"
        )
        assert page.get_attribute(f"{row} a.checkpoint-new-run", "href") == (
            f"/runs/new/?clone={run.pk}&checkpoint=50"
        )
        # The event the page already showed, and the panel, now say the same.
        page.wait_for_function(
            "() => document.getElementById('events').textContent.includes('checkpoint saved at step 50')"
        )

        # In step order; a step saved again (a resumed attempt) replaces its row.
        db(ingest.checkpoint_record, run_id=run.pk, step=25, path="/out/checkpoint-25")
        db(ingest.checkpoint_record, run_id=run.pk, step=50, path="/out2/checkpoint-50")
        page.wait_for_function(
            "() => document.querySelector('#checkpoints li[data-step=\"50\"] code').textContent === '/out2/checkpoint-50'"
        )
        assert rows(page) == [["25", "/out/checkpoint-25"], ["50", "/out2/checkpoint-50"]]

        # A reload draws the same rows on the server (and the socket's first status re-reads them).
        page.reload()
        page.wait_for_selector("#conn.live", timeout=30_000)
        assert rows(page) == [["25", "/out/checkpoint-25"], ["50", "/out2/checkpoint-50"]]
        assert not errors, errors


def test_the_eta_reads_recent_steps_and_says_when_dropped_groups_slow_them(tmp_path):
    """Issue 34 item 4: the ETA uses the last steps' time, and says when steps slowed because most
    groups are dropped; a run whose steps slowed for another reason gets no such note."""
    from playwright.sync_api import sync_playwright

    alice = get_user_model().objects.create_user(username="alice", password=PASSWORD)

    def recorded(name: str, dropped_late: float):
        run = running_run(alice, name=name, reward_funcs=(), max_steps=100)
        steps = [
            (
                s,
                {
                    "perf/step_s": 1.0 if s <= 10 else 4.0,
                    "frac_reward_zero_std": 0.2 if s <= 10 else dropped_late,
                },
            )
            for s in range(1, 21)
        ]
        ingest.metric_steps_ingest(run_id=run.pk, steps=steps)
        return run

    slowed, other = recorded("dropped", 0.8), recorded("longer answers", 0.1)
    with (
        daphne_on_test_db(tmp_path / "daphne.log", queue="unused") as base,
        sync_playwright() as pw,
        chromium_page(pw) as (page, errors),
    ):
        browser_login(page, base, "alice", PASSWORD, f"/runs/{slowed.pk}/")
        page.wait_for_function("() => document.getElementById('run-eta').textContent.includes('ETA')")
        eta = page.inner_text("#run-eta")
        # 80 steps left at the last ten steps' 4 s: 5m 20s, not the whole run's mean of 2.5 s.
        assert "(4 s/step)" in eta and "slowing 4×: 80% of groups dropped" in eta, eta
        page.goto(f"{base}/runs/{other.pk}/")
        page.wait_for_function("() => document.getElementById('run-eta').textContent.includes('ETA')")
        assert "slowing" not in page.inner_text("#run-eta")
        assert not errors, errors
