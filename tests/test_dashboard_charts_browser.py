"""The run page's metric charts in a real browser (Debian Chromium driven by Playwright, daphne on the
test database; no worker, no vLLM: the run's rows are written with the real ingest service).

Issue 22 item 1 (+ item 8's resume marker and axis labels): a hover readout and zoom synced across
charts, EMA smoothing over a faint raw series, a log scale per chart, step / wall-time / relative
x axes, a dashed marker where a resumed attempt starts and where a curriculum's level changes, pinned charts saved per user on the server,
collapsible groups, regex and glob filters, and charts that fit a 390 px wide phone. Issue 30: the eval
charts (eval/reward, eval/pass@k) pinned by default until the user saves pins, and an eval line for an
earlier step arriving live joins its charts without moving the progress back.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from controlplane.runs.models import Run
from controlplane.runs.services import ingest
from tests.conftest import CHROMIUM, DbThread, browser_login, chromium_page, daphne_on_test_db
from tests.test_dashboard_soak import running_run

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "s3cret-pass"
T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC
STEPS = 30


def _card(metric: str) -> str:
    return f'.chart[data-metric="{metric}"]'


def _login(page, base: str, user: str, run_id: int) -> None:
    browser_login(page, base, user, PASSWORD, f"/runs/{run_id}/")


def _data(page, metric: str, key: str) -> str | None:
    return page.get_attribute(_card(metric), f"data-{key}")


def _x_range(page, metric: str) -> tuple[float, float]:
    return float(_data(page, metric, "x-min")), float(_data(page, metric, "x-max"))


def _drag(page, metric: str, start: float, end: float) -> None:
    """A drag across the chart's plot area from ``start`` to ``end`` (fractions of its width)."""
    box = page.locator(f"{_card(metric)} .u-over").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * start, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * (start + end) / 2, y, steps=3)
    page.mouse.move(box["x"] + box["width"] * end, y, steps=3)
    page.mouse.up()


def test_charts_sync_zoom_smooth_log_time_axes_markers_pins_groups_and_filters(tmp_path):
    from playwright.sync_api import sync_playwright

    users = get_user_model().objects
    alice = users.create_user(username="alice", password=PASSWORD)
    bob = users.create_user(username="bob", password=PASSWORD)
    run = running_run(alice, name="charts", reward_funcs=(), max_steps=100)
    for step in range(1, STEPS + 1):
        values = {
            "reward": 0.1 + step / 40 + (0.2 if step % 2 else 0.0),  # noisy: smoothing shows
            "loss": 2.0 / step,
            "perf/step_s": 5.0,
            "rollout/concurrency": float(step),
            "sample/advantage_min": -1.0 + step / 20,  # crosses zero: log becomes asinh
            "curriculum/level": 0.0 if step < 12 else 1.0,  # a curriculum's next level from step 12
        }
        ingest.metric_points_ingest(run_id=run.pk, step=step, values={**values, "timestamp": T0 + 10 * step})
    # Attempt 2 resumed from the checkpoint of step 20 and re-did steps 21.. an hour later.
    Run.objects.filter(pk=run.pk).update(attempt=2)
    for step in range(21, STEPS + 1):
        ingest.metric_points_ingest(
            run_id=run.pk, step=step, values={"reward": 0.9, "timestamp": T0 + 3600 + 10 * step}
        )
    # Eval lines: step 10's and 20's (each after later steps' lines, as the trainer writes them).
    for step in (10, 20):
        ingest.metric_points_ingest(
            run_id=run.pk,
            step=step,
            values={"eval/reward": step / 40, "eval/pass@1": step / 50, "eval/completions/mean_length": 12.0},
        )
    bobs = running_run(bob, name="bobs", reward_funcs=(), max_steps=10)
    ingest.metric_points_ingest(run_id=bobs.pk, step=1, values={"rollout/concurrency": 1.0})

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
            _login(page, base, "alice", run.pk)
            page.wait_for_selector(
                f'{_card("sample/advantage_min")}[data-points="{STEPS}"] canvas', timeout=30_000
            )

            # Pinned first: the default pins that exist, in pin order, before every namespace.
            page.wait_for_selector(f'section[data-group="pinned"] {_card("reward")}')
            pinned = page.eval_on_selector_all(
                'section[data-group="pinned"] .chart', "els => els.map(e => e.dataset.metric)"
            )
            # ... then the run's headline eval charts (a user who never saved pins), not its other eval ones.
            assert pinned == ["reward", "loss", "perf/step_s", "eval/pass@1", "eval/reward"]
            assert (
                page.locator(f'section[data-group="eval"] {_card("eval/completions/mean_length")}').count()
                == 1
            )
            groups = page.eval_on_selector_all("#charts > section", "els => els.map(e => e.dataset.group)")
            assert groups[0] == "pinned"
            assert page.get_attribute(f"{_card('reward')} .chart-name", "title")  # catalogue help kept

            # Hover one chart: the readouts of it and of another chart show the same step.
            box = page.locator(f"{_card('reward')} .u-over").bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] / 2)
            page.wait_for_function(
                "() => document.querySelector('.chart[data-metric=\"rollout/concurrency\"]').dataset.hoverStep"
            )
            hovered = _data(page, "reward", "hover-step")
            assert hovered and _data(page, "rollout/concurrency", "hover-step") == hovered
            readout = page.inner_text(f"{_card('rollout/concurrency')} .chart-readout")
            assert readout.startswith(f"step {hovered}: {hovered}"), readout  # its own value at that step
            # Past the resume: the readout names the attempt.
            page.mouse.move(box["x"] + box["width"] * 0.97, box["y"] + box["height"] / 2)
            page.wait_for_function(
                "() => document.querySelector('.chart[data-metric=\"reward\"] .chart-readout').textContent.includes('attempt 2')"
            )

            # Zoom on one chart: every chart's x range follows; reset (button, double-click) restores.
            full = _x_range(page, "rollout/concurrency")
            assert full == (1.0, float(STEPS))
            _drag(page, "reward", 0.25, 0.6)
            page.wait_for_selector("#chart-reset-zoom:not([hidden])")
            page.wait_for_function(
                "() => Number(document.querySelector('.chart[data-metric=\"rollout/concurrency\"]').dataset.xMax) < 25"
            )
            lo, hi = _x_range(page, "rollout/concurrency")
            assert 1 < lo < hi < STEPS and _x_range(page, "loss") == (lo, hi)
            page.click("#chart-reset-zoom")
            page.wait_for_function(
                f"() => Number(document.querySelector('.chart[data-metric=\"rollout/concurrency\"]').dataset.xMax) === {STEPS}"
            )
            assert _x_range(page, "rollout/concurrency") == full
            _drag(page, "loss", 0.3, 0.5)
            page.wait_for_selector("#chart-reset-zoom:not([hidden])")
            page.dblclick(f"{_card('perf/step_s')} .u-over")
            page.wait_for_selector("#chart-reset-zoom[hidden]", state="attached")
            page.wait_for_function(
                f"() => Number(document.querySelector('.chart[data-metric=\"loss\"]').dataset.xMax) === {STEPS}"
            )

            # Smoothing: the smoothed series differs from the raw one, which stays; debiased start.
            def reward_series() -> dict:
                return page.evaluate("() => GrpoMetricPanel.series('reward')")

            raw_before = reward_series()["values"]
            page.fill("#chart-smoothing", "0.9")
            page.wait_for_function("() => document.getElementById('charts').dataset.smoothing === '0.9'")
            smoothed = reward_series()
            assert smoothed["values"] == raw_before  # raw kept
            assert smoothed["smoothed"] != raw_before
            assert smoothed["smoothed"][0] == pytest.approx(raw_before[0])  # not pulled towards 0
            page.wait_for_function(
                "() => document.querySelector('.chart[data-metric=\"reward\"] .chart-last').textContent.includes('ema')"
            )
            assert float(_data(page, "reward", "smoothed-last")) == pytest.approx(smoothed["smoothed"][-1])
            assert page.evaluate(
                "() => document.querySelector('.chart[data-metric=\"reward\"] .chart-last').textContent"
            ).startswith("0.9 (ema ")

            # Log scale per chart; a series through zero gets asinh, and the button says why.
            page.click(f"{_card('loss')} .chart-log")
            page.wait_for_selector(f'{_card("loss")}[data-scale="log"]')
            assert _data(page, "reward", "scale") == "linear"
            page.click(f"{_card('sample/advantage_min')} .chart-log")
            page.wait_for_selector(f'{_card("sample/advantage_min")}[data-scale="asinh"]')
            assert "values <= 0" in page.get_attribute(f"{_card('sample/advantage_min')} .chart-log", "title")
            page.click(f"{_card('loss')} .chart-log")
            page.wait_for_selector(f'{_card("loss")}[data-scale="linear"]')

            # x axis: wall time (clock ticks), then time since the first step; the resume marker, and
            # the curriculum's level change (a metric the catalogue declares with `marks`) on every chart.
            assert page.get_attribute("#charts", "data-markers") == "12:level 1,21:attempt 2"
            assert _data(page, "reward", "markers") == "12:level 1,21:attempt 2"
            assert _data(page, "loss", "markers") == "12:level 1,21:attempt 2"
            page.select_option("#chart-x", "wall")
            page.wait_for_function(
                "() => /\\d\\d:\\d\\d/.test(document.querySelector('.chart[data-metric=\"rollout/concurrency\"]').dataset.xTicks || '')"
            )
            lo, hi = _x_range(page, "rollout/concurrency")
            # A step's time is when it was last logged: steps 21.. by attempt 2, an hour later.
            assert lo == pytest.approx(T0 + 10, abs=1) and hi == pytest.approx(T0 + 3600 + 300, abs=1)
            page.select_option("#chart-x", "relative")
            page.wait_for_function(
                "() => /^[0-9hms]+$/.test((document.querySelector('.chart[data-metric=\"rollout/concurrency\"]').dataset.xTicks || '').split('|')[1])"
            )
            assert _x_range(page, "rollout/concurrency")[0] == pytest.approx(0, abs=1)
            page.select_option("#chart-x", "step")
            page.wait_for_function(
                "() => document.querySelector('.chart[data-metric=\"rollout/concurrency\"]').dataset.xMin === '1'"
            )

            # Filters: a regex, a glob, an invalid regex (error, nothing hidden), then none.
            def shown() -> list[str]:
                return sorted(
                    page.eval_on_selector_all(".chart:not([hidden])", "els => els.map(e => e.dataset.metric)")
                )

            page.fill("#metric-filter", "/^(reward|loss)$/")
            page.wait_for_function("() => document.querySelectorAll('.chart:not([hidden])').length === 2")
            assert shown() == ["loss", "reward"]
            page.fill("#metric-filter", "*/*_s*")
            page.wait_for_function("() => document.querySelectorAll('.chart:not([hidden])').length === 1")
            assert shown() == ["perf/step_s"]
            page.fill("#metric-filter", "/[/")
            page.wait_for_selector("#metric-filter-error:not([hidden])")
            assert "invalid regular expression" in page.inner_text("#metric-filter-error")
            assert len(shown()) == 9  # an invalid filter hides nothing: every metric written above
            page.fill("#metric-filter", "")
            page.wait_for_selector("#metric-filter-error[hidden]", state="attached")

            # Collapse a namespace (remembered in this browser).
            page.click('section[data-group="rollout"] h3')
            assert not page.is_visible(_card("rollout/concurrency"))

            # Pin a chart: it moves to Pinned, the server keeps it across a reload. Unpinning a default
            # eval chart first: the user's saved pins win over the defaults from then on.
            page.click('section[data-group="rollout"] h3')  # expand again
            page.click(f"{_card('eval/reward')} .chart-pin")
            page.wait_for_selector('#charts[data-pins-saved="1"]')
            page.click(f"{_card('rollout/concurrency')} .chart-pin")
            page.wait_for_selector('#charts[data-pins-saved="2"]')
            page.reload()
            page.wait_for_selector(
                f'section[data-group="pinned"] {_card("rollout/concurrency")}', timeout=30_000
            )
            assert _data(page, "rollout/concurrency", "pinned") == "true"
            assert (
                _data(page, "eval/pass@1", "pinned") == "true"
                and _data(page, "eval/reward", "pinned") == "false"
            )

            # A live step over the socket brings its time and attempt: the wall axis extends to it.
            page.wait_for_selector("#conn.live")
            db(
                ingest.metric_points_ingest,
                run_id=run.pk,
                step=STEPS + 1,
                values={"reward": 1.0, "timestamp": T0 + 4000},
            )
            page.wait_for_selector(f'{_card("reward")}[data-points="{STEPS + 1}"]', timeout=15_000)
            page.select_option("#chart-x", "wall")
            page.wait_for_function(
                f"() => Number(document.querySelector('.chart[data-metric=\"reward\"]').dataset.xMax) === {T0 + 4000}"
            )
            page.select_option("#chart-x", "step")

            # An eval line for step 30, after step 31's line: its points join the eval charts at step
            # 30; the latest step, the progress and the ETA stay where step 31 put them.
            page.wait_for_function(
                "() => document.getElementById('run-step').textContent.startsWith('step 31')"
            )
            progress = page.inner_text("#run-step"), page.inner_text("#run-eta")
            db(
                ingest.metric_points_ingest,
                run_id=run.pk,
                step=STEPS,
                values={"eval/reward": 0.9, "eval/pass@1": 0.8, "timestamp": T0 + 3600 + 10 * STEPS},
            )
            page.wait_for_selector(f'{_card("eval/reward")}[data-points="3"]', timeout=15_000)
            assert page.evaluate("() => GrpoMetricPanel.series('eval/reward').steps") == [10, 20, STEPS]
            assert page.evaluate("() => GrpoMetricPanel.series('eval/pass@1').values")[-1] == 0.8
            assert page.evaluate("() => GrpoMetricPanel.lastStep()") == STEPS + 1
            assert (page.inner_text("#run-step"), page.inner_text("#run-eta")) == progress
            assert _data(page, "reward", "points") == str(STEPS + 1)  # the step's training points kept

            # A phone: the metrics card and its charts fit 390 px (nothing in it scrolls the page
            # sideways; the site header is not the charts' to fix).
            page.set_viewport_size({"width": 390, "height": 800})
            # (The x-axis switch above rebuilds the charts on the next frame: the canvas may be absent.)
            page.wait_for_function(
                "() => document.querySelector('.chart[data-metric=\"reward\"] canvas')?.getBoundingClientRect().right <= 390"
            )
            wide = page.evaluate(
                "() => [...document.querySelector('#charts').closest('.card').querySelectorAll('*')]"
                ".filter(e => e.getBoundingClientRect().right > 390)"
                ".map(e => `${e.tagName}.${e.className} ${Math.round(e.getBoundingClientRect().right)}`)"
            )
            assert wide == [], wide
            assert not errors, errors

            # A pin the server refuses (sent here without the CSRF token: a real 403) is put back, and
            # the page says why (static/runs/chart_pins.js).
            page.set_viewport_size({"width": 1400, "height": 1000})
            page.evaluate(
                "() => document.querySelectorAll('[name=csrfmiddlewaretoken]').forEach(e => e.remove())"
            )
            page.click(f"{_card('reward')} .chart-pin")  # an unpin
            page.wait_for_selector("#charts-message:not([hidden])")
            assert "could not save the pin: CSRF" in page.inner_text("#charts-message")
            assert _data(page, "reward", "pinned") == "true"
            assert page.locator(f'section[data-group="pinned"] {_card("reward")}').count() == 1

            # Bob's pins are his own: his page shows the same metric unpinned.
            other = browser.new_page(viewport={"width": 1400, "height": 1000})
            _login(other, base, "bob", bobs.pk)
            other.wait_for_selector(
                f'{_card("rollout/concurrency")}[data-pinned="false"] canvas', timeout=30_000
            )
            assert other.locator('section[data-group="pinned"] .chart').count() == 0
        finally:
            browser.close()


def test_step_axis_ticks_are_whole_steps_on_a_short_run(tmp_path):
    """Issue 28 item 7c: steps are integers, so the step axis's ticks are too. uPlot's default
    spacings for a number axis (…, 0.5, 1, 2, 2.5, 5, …) put a 3-step run's ticks at 1, 1.5, 2, …
    and a 10-step run's at 2.5, 7.5; zoomed in between two steps, the ticks stay whole steps."""
    import re

    from playwright.sync_api import sync_playwright

    alice = get_user_model().objects.create_user(username="alice", password=PASSWORD)
    run = running_run(alice, name="short", reward_funcs=(), max_steps=10)
    for step in (1, 2, 3):
        values = {"reward": step / 4, "loss": 1 / step, "timestamp": T0 + 10 * step}
        ingest.metric_points_ingest(run_id=run.pk, step=step, values=values)

    def ticks(page) -> list[str]:
        return [t for t in (_data(page, "reward", "x-ticks") or "").split("|") if t]

    with (
        daphne_on_test_db(tmp_path / "daphne.log", queue="unused") as base,
        sync_playwright() as pw,
        chromium_page(pw) as (page, errors),
    ):
        _login(page, base, "alice", run.pk)
        page.wait_for_selector(f'{_card("reward")}[data-points="3"] canvas', timeout=30_000)
        page.wait_for_function(
            "() => (document.querySelector('.chart[data-metric=\"reward\"]').dataset.xTicks || '').includes('|')"
        )
        shown = ticks(page)
        assert len(shown) >= 2 and all(re.fullmatch(r"\d+", t) for t in shown), shown
        assert set(shown) <= {"1", "2", "3"}, shown
        # Zoomed in to less than two steps: whole steps still (uPlot would offer 1.5, 2.5 ...).
        page.evaluate("() => GrpoMetricPanel.setZoom([1.1, 2.9])")
        page.wait_for_function(
            "() => document.querySelector('.chart[data-metric=\"reward\"]').dataset.xMax === '2.9'"
        )
        shown = ticks(page)
        assert shown == ["2"], shown
        # The time axes keep their own spacings (fractions of a second are times, not steps).
        page.evaluate("() => GrpoMetricPanel.setXMode('relative')")
        page.wait_for_function(
            "() => /s$/.test((document.querySelector('.chart[data-metric=\"reward\"]').dataset.xTicks || '').split('|').filter(Boolean)[0] || '')"
        )
        assert not errors, errors
