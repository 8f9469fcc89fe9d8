"""The run list and the run page's tags, note and downloads in a real browser (headless Debian
Chromium driven by Playwright) against daphne on the test database; no worker is needed: the test
plays the supervisor by writing the runs' status and metrics itself.

A user filters, searches, sorts and pages the list through links, watches a run's status and
progress change in place without a reload, edits a run's tags and note on its page, and downloads
its metrics as CSV."""

from __future__ import annotations

import csv
import io

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.runs.models import MetricPoint, Run, RunStatus
from tests.conftest import CHROMIUM, DbThread, browser_login, daphne_on_test_db


@pytest.fixture
def web_server(transactional_db, tmp_path):
    """daphne on the test database, two runs a page; nothing consumes its queue."""
    env = {"GRPO_RUN_LIST_PAGE_SIZE": "2"}
    with daphne_on_test_db(tmp_path / "daphne.log", queue="no-worker-list", env=env) as base:
        yield base


def make_run(owner, name: str, status: str, **fields) -> Run:
    config = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["x.y"],
        "args": {"max_steps": 10},
    }
    now = timezone.now()
    if status == RunStatus.RUNNING:
        fields |= {
            "launched_at": now,
            "started_at": now,
            "heartbeat_at": now,
            "attempt": 1,
            "worker_host": "h",
        }
    if status == RunStatus.COMPLETED:
        fields |= {"finished_at": now}
    return Run.objects.create(
        owner=owner, name=name, config=config, config_sha256="0" * 64, status=status, **fields
    )


def finish_with_metrics(run_id: int) -> None:
    """What a supervisor would record: three steps of reward, then completed."""
    MetricPoint.objects.bulk_create(
        [MetricPoint(run_id=run_id, step=s, name="reward", value=s / 4) for s in (1, 2, 3)]
    )
    Run.objects.filter(pk=run_id).update(status=RunStatus.COMPLETED, finished_at=timezone.now())


@pytest.mark.slow
def test_run_list_filters_updates_live_and_runs_carry_tags_notes_and_downloads(web_server):
    from playwright.sync_api import sync_playwright

    alice = get_user_model().objects.create_user(username="alice", password="s3cret-pass")
    bob = get_user_model().objects.create_user(username="bob", password="other-pass")
    alpha = make_run(alice, "alpha sweep", RunStatus.RUNNING, tags=["sweep"])
    make_run(alice, "beta", RunStatus.QUEUED)
    make_run(alice, "gamma", RunStatus.COMPLETED, note="the good one")
    make_run(bob, "bob secret", RunStatus.QUEUED)

    with sync_playwright() as pw, DbThread() as db:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900}, accept_downloads=True)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on(
            "console", lambda msg: errors.append(msg.text) if "Content Security Policy" in msg.text else None
        )
        rows = "#runs tbody tr[data-run-id]"
        try:
            browser_login(page, web_server, "alice", "s3cret-pass", "/runs/")
            page.wait_for_url("**/runs/")
            # Newest first, two a page; bob's run is not listed.
            assert page.locator(rows).count() == 2 and "page 1 of 2" in page.inner_text("#pager")
            page.click("#page-next")
            page.wait_for_url("**/runs/?page=2")
            assert page.locator(rows).count() == 1 and "alpha sweep" in page.inner_text(rows)
            # Sort by name through its header; the order is in the URL.
            page.click("a.sort[data-sort=name]")
            page.wait_for_url("**/runs/?ordering=name")
            assert "alpha sweep" in page.locator(rows).first.inner_text()
            # Search (the note matches) and clear.
            page.fill("#run-filters input[name=q]", "good one")
            page.click("#filter-button")
            page.wait_for_url("**q=good+one**")
            assert page.locator(rows).count() == 1 and "gamma" in page.inner_text(rows)
            page.click("#clear-filters")
            page.wait_for_url("**/runs/")
            # A status filter from a link; the running run then finishes with no reload.
            page.goto(web_server + "/runs/?status=running")
            assert page.locator(rows).count() == 1
            row = f"tr[data-run-id='{alpha.pk}']"
            assert page.inner_text(f"{row} .status") == "running"
            page.evaluate("window.__sameDocument = true")
            db(finish_with_metrics, alpha.pk)
            page.wait_for_function(
                f"() => document.querySelector(\"{row} .status\").textContent === 'completed'", timeout=20_000
            )
            page.wait_for_function(
                f"() => document.querySelector(\"{row} .run-step\").textContent === '3 / 10'"
            )
            assert page.get_attribute(f"{row} .progress > div", "style") == "width: 30%;"
            assert page.inner_text(f"{row} .run-reward") == "0.75"
            assert page.evaluate("window.__sameDocument") is True

            # The run page: tags and note edited in place (PATCH), refused input explained.
            page.goto(f"{web_server}/runs/{alpha.pk}/")
            page.click("#annotations-edit")
            page.fill("#annotations-tags", "best, lr:1e-5 bad!tag")
            page.click("#annotations-save")
            page.wait_for_selector("#annotations-errors li")
            assert "bad!tag" in page.inner_text("#annotations-errors")
            page.fill("#annotations-tags", "best, lr:1e-5")
            page.fill("#annotations-note", "keeps the\nhigher LR")
            page.click("#annotations-save")
            page.wait_for_selector("#annotations-form", state="hidden")
            assert page.locator("#run-tags a.tag").all_inner_texts() == ["best", "lr:1e-5"]
            assert page.inner_text("#run-note") == "keeps the\nhigher LR"
            stored = db(lambda: Run.objects.values_list("tags", "note").get(pk=alpha.pk))
            assert stored == (["best", "lr:1e-5"], "keeps the\nhigher LR")
            # A tag links to the list filtered by it.
            page.click("#run-tags a.tag >> text=best")
            page.wait_for_url("**/runs/?tag=best")
            assert page.locator(rows).count() == 1

            # Downloads from the run page.
            page.goto(f"{web_server}/runs/{alpha.pk}/")
            with page.expect_download() as info:
                page.click("#download-metrics-csv")
            download = info.value
            assert download.suggested_filename == f"run-{alpha.pk}-metrics.csv"
            with open(download.path(), encoding="utf-8") as fh:
                assert list(csv.reader(io.StringIO(fh.read()))) == [
                    ["step", "reward"],
                    ["1", "0.25"],
                    ["2", "0.5"],
                    ["3", "0.75"],
                ]
            assert not errors, errors
        finally:
            browser.close()
