"""The run page's diagnosis strip and events panel in a real browser (Debian Chromium driven by
Playwright, daphne on the test database; no worker, no vLLM: the run's rows are written directly).

Issue 22: the diagnosis is a compact strip that expands to the spec's cards, its numbers under the
spec's names or plain words; the events panel filters by kind and searches, on the server, and live
events follow the same filter.
"""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model

from controlplane.runs import services
from controlplane.runs.models import RunEventKind
from controlplane.runs.services import ingest
from tests.conftest import CHROMIUM, DbThread, browser_login, daphne_on_test_db
from tests.test_dashboard_soak import running_run

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "s3cret-pass"
TRACEBACK = (
    "2026-12-02 16:34:53,000 ERROR trainer.rollout: reward function failed\n"
    "Traceback (most recent call last):\n"
    '  File "/work/trainer/rewards.py", line 12, in accuracy_reward\n'
    "ValueError: could not convert string to float: 'x'"
)


def test_diagnosis_strip_expands_and_events_filter_and_search(tmp_path):
    from playwright.sync_api import sync_playwright

    owner = get_user_model().objects.create_user(username="watcher", password=PASSWORD)
    run = running_run(owner, name="panels", reward_funcs=(), max_steps=100)
    for step in range(1, 21):  # every group solved: reward ~1, frac_reward_zero_std ~1
        ingest.metric_points_ingest(
            run_id=run.pk,
            step=step,
            values={
                "frac_reward_zero_std": 0.97,
                "reward_dropped": 1.0,
                "reward": 0.98,
                "perf/rollout_wait_s": 4.0,
                "rollout/backpressure_s": 0.0,
                "perf/step_s": 5.0,
                "completions/clipped_ratio": 0.0,
            },
        )
    services.run_event_create(run_id=run.pk, kind=RunEventKind.LOG, message="INFO trainer.trainer: step 1")
    services.run_event_create(run_id=run.pk, kind=RunEventKind.LOG, message=TRACEBACK)
    services.run_event_create(run_id=run.pk, kind=RunEventKind.INFO, message="trainer environment: CPU")
    with (
        DbThread() as db,
        daphne_on_test_db(tmp_path / "daphne.log", queue="unused") as base,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            browser_login(page, base, "watcher", PASSWORD, f"/runs/{run.pk}/")
            page.wait_for_selector("#conn.live", timeout=30_000)

            # The strip: one chip per topic, in one short line; the cards stay closed.
            page.wait_for_selector("#diagnosis .diagnosis[data-topic='saturation']", timeout=30_000)
            chip = page.locator("#diagnosis .diagnosis[data-topic='saturation']")
            assert chip.get_attribute("data-verdict") == "saturated_top"
            assert "Saturated at the top" in chip.inner_text()
            topics = page.eval_on_selector_all(
                "#diagnosis .diagnosis", "els => els.map(e => e.dataset.topic)"
            )
            assert topics == ["bottleneck", "concurrency", "saturation", "clipping"]
            assert page.locator("#diagnosis-panel").bounding_box()["height"] < 80
            assert not page.is_visible("#diagnosis-details .diagnosis[data-topic='saturation']")

            # Opened: the spec's cards, the numbers under the spec's names or plain words.
            page.click("#diagnosis-panel summary")
            card = "#diagnosis-details .diagnosis[data-topic='saturation']"
            page.wait_for_selector(card)
            labels = page.eval_on_selector_all(f"{card} td:first-child", "els => els.map(e => e.textContent)")
            assert "lowest reward (the reward range)" in labels and "frac_reward_zero_std" in labels
            assert not [t for t in labels if re.search(r"\w:\w", t)], labels  # no internal keys
            assert (
                page.get_attribute(f"{card} tr[data-key='reward_range:lo'] td", "title") == "reward_range:lo"
            )
            assert "harder prompts" in page.inner_text(f"{card} .advice")

            # Events: all three, then by kind, then searched (the server filters), then nothing.
            def shown() -> list[str]:
                return page.eval_on_selector_all("#events pre", "els => els.map(e => e.textContent)")

            page.wait_for_function("() => document.querySelectorAll('#events tr').length === 3")
            page.select_option("#event-kind", "log")
            page.wait_for_function("() => document.querySelectorAll('#events tr').length === 2")
            assert all(
                k == "log"
                for k in page.eval_on_selector_all("#events tr", "els => els.map(e => e.dataset.kind)")
            )
            page.fill("#event-search", "traceback")
            page.wait_for_function("() => document.querySelectorAll('#events tr').length === 1")
            assert shown() == [TRACEBACK]  # the record whole, as stored
            page.fill("#event-search", "nothing says this \u2603")
            page.wait_for_selector("#events-empty:not([hidden])")
            assert shown() == []

            # Live events follow the filter: a matching one shows, others do not.
            page.fill("#event-search", "step")
            page.wait_for_function("() => document.querySelectorAll('#events tr').length === 1")
            db(
                services.run_event_create,
                run_id=run.pk,
                kind=RunEventKind.INFO,
                message="step 2 info, not a log",
            )
            db(
                services.run_event_create,
                run_id=run.pk,
                kind=RunEventKind.LOG,
                message="INFO trainer.trainer: step 2",
            )
            page.wait_for_function(
                "() => document.querySelectorAll('#events tr').length === 2", timeout=15_000
            )
            assert shown() == ["INFO trainer.trainer: step 1", "INFO trainer.trainer: step 2"]

            # Back to everything: every event once, in order.
            page.select_option("#event-kind", "")
            page.fill("#event-search", "")
            page.wait_for_function("() => document.querySelectorAll('#events tr').length === 5")
            assert shown()[-2:] == ["step 2 info, not a log", "INFO trainer.trainer: step 2"]
            assert not errors, errors
        finally:
            browser.close()
