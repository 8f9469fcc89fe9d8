"""The comparison page in a real browser (Debian Chromium driven by Playwright, daphne on the test
database; no worker, no vLLM: the runs' rows are written directly, as a supervisor would).

Issue 22 item 4: several metrics at once, each a chart overlaying the runs; run names in the legends
with one colour per run; the config keys that differ; an active run's new steps drawn live while a
finished run opens no socket; "Compare with…" from a run's page; usable at 390 px.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.runs.models import Run, RunStatus
from controlplane.runs.services import ingest
from tests.conftest import CHROMIUM, DbThread, browser_login, daphne_on_test_db
from tests.test_dashboard_soak import running_run

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "s3cret-pass"
CONFIG = {
    "model": "tiny",
    "train_dataset": "arithmetic-small",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
}


def finished_run(owner, name: str, max_steps: int) -> Run:
    """A completed run whose document differs from ``running_run``'s in ``args.max_steps`` only."""
    return Run.objects.create(
        owner=owner,
        name=name,
        config=CONFIG | {"args": {"max_steps": max_steps}},
        config_sha256="0" * 64,
        status=RunStatus.COMPLETED,
        finished_at=timezone.now(),
    )


def chart_points(page, metric: str) -> int:
    return int(page.get_attribute(f"#compare-charts .chart[data-metric='{metric}']", "data-points"))


def test_compare_page_overlays_metrics_live_with_names_diff_and_compare_with(tmp_path):
    from playwright.sync_api import sync_playwright

    alice = get_user_model().objects.create_user(username="alice", password=PASSWORD)
    live = running_run(alice, name="live <i>one</i>", max_steps=1000)
    assert live.config == CONFIG | {"args": {"max_steps": 1000}}
    done = finished_run(alice, "done two", 2000)
    other = finished_run(alice, "done three", 3000)
    for run in (live, done, other):
        for step in (1, 2, 3):
            values = {"reward": step / 10 + run.pk / 100, "loss": 1 / step, "entropy": 0.5}
            ingest.metric_points_ingest(run_id=run.pk, step=step, values=values)
    ids = f"{live.pk},{done.pk},{other.pk}"

    with (
        DbThread() as db,
        daphne_on_test_db(tmp_path / "daphne.log", queue="no-worker-compare") as base,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on(
            "console", lambda msg: errors.append(msg.text) if "Content Security Policy" in msg.text else None
        )
        sockets: list[str] = []
        page.on("websocket", lambda ws: sockets.append(ws.url))
        try:
            browser_login(page, base, "alice", PASSWORD, "/runs/")
            page.wait_for_url("**/runs/")

            # Two metrics of three runs, one chart each, every run's points drawn.
            page.goto(f"{base}/runs/compare/?runs={ids}&metrics=reward,loss")
            page.wait_for_selector("#compare-charts[data-loaded=true]", timeout=20_000)
            metrics = page.eval_on_selector_all(
                "#compare-charts .chart", "els => els.map(e => e.dataset.metric)"
            )
            assert metrics == ["reward", "loss"]
            assert chart_points(page, "reward") == 9 and chart_points(page, "loss") == 9
            assert page.locator("#compare-charts .chart canvas").count() == 2

            # Legends carry "#<id> <name>" as text (the run's "<i>" stays characters), one colour per
            # run on every chart and in the run list above them.
            labels = page.eval_on_selector_all(
                "#compare-charts .chart[data-metric=reward] .u-legend .u-series .u-label",
                "els => els.map(e => e.textContent)",
            )
            assert labels[1:] == [
                f"#{live.pk} live <i>one</i>",
                f"#{done.pk} done two",
                f"#{other.pk} done three",
            ]
            assert page.locator("#compare-charts .u-legend i").count() == 0
            markers = page.evaluate(
                """() => [...document.querySelectorAll('#compare-charts .chart')].map(c =>
                    [...c.querySelectorAll('.u-legend .u-series .u-marker')].slice(1)
                      .map(m => getComputedStyle(m).borderLeftColor))"""
            )
            swatches = page.eval_on_selector_all(
                "#compare-runs .swatch", "els => els.map(e => getComputedStyle(e).backgroundColor)"
            )
            assert markers[0] == markers[1] == swatches and len(set(swatches)) == 3
            statuses = page.eval_on_selector_all(
                "#compare-runs .status", "els => els.map(e => e.textContent)"
            )
            assert statuses == ["running", "completed", "completed"]

            # The config diff: only the differing key, all of them after the toggle.
            visible = "#config-diff tbody tr:visible"
            assert page.eval_on_selector_all(visible, "els => els.map(e => e.dataset.key)") == [
                "args.max_steps"
            ]
            assert page.locator(f"{visible} td").all_inner_texts() == [
                "args.max_steps",
                "1000",
                "2000",
                "3000",
            ]
            total = page.locator("#config-diff tbody tr").count()
            assert total > 3 and page.inner_text("#diff-toggle") == f"show all {total} keys"
            page.click("#diff-toggle")
            assert page.locator(visible).count() == total
            assert "model" in page.eval_on_selector_all(visible, "els => els.map(e => e.dataset.key)")

            # Live: the running run's new step is appended to both charts; finished runs opened no socket.
            page.wait_for_selector(
                f"#compare-runs li[data-run-id='{live.pk}'][data-live=open]", timeout=10_000
            )
            db(ingest.metric_points_ingest, run_id=live.pk, step=4, values={"reward": 0.9, "loss": 0.2})
            page.wait_for_function(
                "() => ['reward', 'loss'].every(m => document.querySelector("
                "`#compare-charts .chart[data-metric='${m}']`).dataset.points === '10')",
                timeout=10_000,
            )
            assert [url.split("/ws/")[1] for url in sockets] == [f"runs/{live.pk}/"]
            assert page.get_attribute(f"#compare-runs li[data-run-id='{done.pk}']", "data-live") is None

            # The metric picker: another metric chosen, submitted as a ?runs=&metrics= link.
            page.click("#metric-picker summary")
            page.fill("#metric-filter", "entr")
            assert page.is_hidden("#metric-picker input[value=reward]")
            page.check("#metric-picker input[value=entropy]")
            page.click("#compare-show")
            page.wait_for_url(f"**/runs/compare/?runs={ids}&metrics=reward,loss,entropy")
            page.wait_for_selector("#compare-charts[data-loaded=true]")
            assert page.locator("#compare-charts .chart").count() == 3 and chart_points(page, "entropy") == 9

            # "Compare with…" from a run's page: its recent runs listed, one picked, the comparison opens.
            page.goto(f"{base}/runs/{done.pk}/")
            page.click("#compare-with summary")
            page.wait_for_selector(f"#compare-with-results li[data-run-id='{other.pk}']")
            listed = page.eval_on_selector_all(
                "#compare-with-results li", "els => els.map(e => e.dataset.runId)"
            )
            assert str(done.pk) not in listed and str(live.pk) in listed  # not itself
            page.fill("#compare-with-search", "three")
            page.wait_for_function(
                "() => [...document.querySelectorAll('#compare-with-results li')].map(e => e.dataset.runId)"
                f".join() === '{other.pk}'"
            )
            page.check(f"#compare-with-results input[value='{other.pk}']")
            page.click("#compare-with-open")
            page.wait_for_url(f"**/runs/compare/?runs={done.pk},{other.pk}&metrics=reward,loss")
            page.wait_for_selector("#compare-charts[data-loaded=true]")
            shown = page.eval_on_selector_all("#compare-runs li", "els => els.map(e => e.dataset.runId)")
            assert shown == [str(done.pk), str(other.pk)] and chart_points(page, "reward") == 6

            # 390 px wide: no sideways scroll of the page; the legends wrap inside their chart.
            page.set_viewport_size({"width": 390, "height": 800})
            page.goto(f"{base}/runs/compare/?runs={ids}&metrics=reward,loss")
            page.wait_for_selector("#compare-charts[data-loaded=true]")
            assert page.evaluate("document.documentElement.scrollWidth") <= 390
            legend = page.locator("#compare-charts .chart[data-metric=reward] .u-legend").bounding_box()
            assert legend["x"] >= 0 and legend["x"] + legend["width"] <= 390
            page.goto(f"{base}/runs/{live.pk}/")
            page.click("#compare-with summary")
            page.wait_for_selector("#compare-with-results li[data-run-id]")
            # (the run page's own width is its metric cards' concern; the control fits in 390 px)
            panel = page.locator("#compare-with").bounding_box()
            assert panel["x"] >= 0 and panel["x"] + panel["width"] <= 390
            assert not errors, errors
        finally:
            browser.close()
