"""The run page of a recorded demo run (tests/data/demo_run, ingested as the worker ingests) at a
desktop and a phone width, in Chromium (Playwright, daphne on the test database).

Issue 22 item 8: the run page is usable at 390 px (nothing on it scrolls the page sideways, every
card's controls are on screen) and each chart's y-axis labels fit their axis (the recorded
``frac_reward_zero_std``, 0 to 0.8, drew "0.75" as ".75" when the axis was sized for "0.5").
"""

from __future__ import annotations

import shutil

import pytest
from django.contrib.auth import get_user_model

from tests.conftest import CHROMIUM, DbThread, browser_login, daphne_on_test_db
from tests.recorded_run import recorded_run

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "s3cret-pass"

# Every element of the page whose right edge passes the viewport (the page would scroll sideways).
PAST_THE_EDGE = """(width) => [...document.querySelectorAll('body *')]
  .filter(e => e.getClientRects().length && e.getBoundingClientRect().right > width + 0.5)
  .filter(e => !e.closest('pre, .chart-plot, table'))  // these scroll inside their own box
  .map(e => `${e.tagName.toLowerCase()}#${e.id}.${e.className} ${Math.round(e.getBoundingClientRect().right)}`)"""

# Charts whose widest drawn y label is wider than the room its axis leaves for labels.
LABELS_CUT = """() => [...document.querySelectorAll('.chart[data-y-axis-px]')]
  .filter(c => Number(c.dataset.yLabelPx) > Number(c.dataset.yAxisPx))
  .map(c => `${c.dataset.metric}: label ${c.dataset.yLabelPx} px, room ${c.dataset.yAxisPx} px`)"""


def test_recorded_run_page_fits_a_phone_and_its_axis_labels_fit(tmp_path):
    from playwright.sync_api import sync_playwright

    owner = get_user_model().objects.create_user(username="phone", password=PASSWORD)
    run, output = recorded_run(owner)
    try:
        with (
            DbThread(),
            daphne_on_test_db(tmp_path / "daphne.log", queue="unused") as base,
            sync_playwright() as pw,
        ):
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            errors: list[str] = []
            for width, height in ((1400, 1000), (390, 844)):
                page = browser.new_page(viewport={"width": width, "height": height})
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                browser_login(page, base, "phone", PASSWORD, f"/runs/{run.pk}/")
                page.wait_for_selector(
                    '.chart[data-metric="frac_reward_zero_std"][data-y-axis-px]', timeout=30_000
                )
                page.wait_for_selector("#completions .cgroup", timeout=30_000)
                page.wait_for_timeout(300)  # the last animation frame's draws
                charts = page.locator(".chart[data-y-axis-px]").count()
                assert charts >= 40, charts  # every recorded metric is charted
                assert page.evaluate(LABELS_CUT) == [], width

                assert page.evaluate("document.documentElement.scrollWidth") <= width
                assert page.evaluate(PAST_THE_EDGE, width) == [], width
                # The controls a user reaches for are on screen and usable at this width.
                for selector in (
                    "#clone-link",
                    "#metric-filter",
                    "#chart-x",
                    "#completion-search",
                    "#event-search",
                    "#diagnosis-panel summary",
                ):
                    box = page.locator(selector).first.bounding_box()
                    assert box and box["x"] >= 0 and box["x"] + box["width"] <= width, (selector, box, width)
                page.close()
            assert not errors, errors
            browser.close()
    finally:
        shutil.rmtree(output, ignore_errors=True)
