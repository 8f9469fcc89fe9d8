"""The run page stays connected: a real browser (headless Debian Chromium through Playwright) on the
run page served by daphne, with the real Redis channel layer and the real ingest services as the
producer (what the supervisor's tailer calls).

* soak: uneven gaps between 10 steps (~48 s: five silences longer than the channel layer's 5 s
  blocking pop, which is what used to drop the socket, and the whole longer than its 30 s message
  expiry): one websocket for the whole time, no reconnect, and every step received exactly once. The
  budget is counted in steps, not seconds;
* reconnect: daphne is restarted while steps and events land in the database; the page reconnects
  once and fetches what it missed, events included, each exactly once.
"""

from __future__ import annotations

import json
import os

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.runs import services
from controlplane.runs.models import Run, RunEventKind, RunStatus
from controlplane.runs.services import ingest
from tests.conftest import CHROMIUM, DbThread, browser_login, daphne_on_test_db, free_port

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "s3cret-pass"
# Seconds between steps, cycled: bursts and silences, several longer than brpop_timeout (5 s).
GAPS_S = (0.5, 7.0, 1.0, 12.0, 2.0, 0.2, 9.0, 3.0, 6.0)
SOAK_STEPS = len(GAPS_S) + 1  # ~48 s of gaps: longer than the channel layer's 30 s message expiry


def running_run(
    owner,
    *,
    name: str = "soak",
    reward_funcs: tuple[str, ...] = ("trainer.rewards.accuracy_reward",),
    max_steps: int = 1000,
) -> Run:
    """A run of ``owner``'s stored as ``running`` (the page treats it as live), never enqueued."""
    config = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": list(reward_funcs),
        "args": {"max_steps": max_steps},
    }
    # Stored directly (run_create would enqueue it); "running" so the page treats it as live.
    now = timezone.now()
    return Run.objects.create(
        owner=owner,
        name=name,
        config=config,
        config_sha256="0" * 64,
        status=RunStatus.RUNNING,
        launched_at=now,
        heartbeat_at=now,
        attempt=1,
        worker_host=f"{name}-test",
    )


def _open_run_page(pw, base: str, run: Run):
    """A logged-in page on the run, with every websocket it opens and every frame it receives
    recorded; returns (browser, page, sockets, frames)."""
    browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
    page = browser.new_page()
    sockets: list[str] = []
    frames: list[dict] = []

    def on_socket(ws):
        sockets.append(ws.url)
        ws.on("framereceived", lambda payload: frames.append(json.loads(payload)))

    page.on("websocket", on_socket)
    browser_login(page, base, "watcher", PASSWORD, f"/runs/{run.pk}/")
    page.wait_for_url(f"**/runs/{run.pk}/")
    page.wait_for_selector("#conn.live", timeout=30_000)
    return browser, page, sockets, frames


def _metric_steps(frames: list[dict]) -> list[int]:
    return [f["step"] for f in frames if f.get("type") == "metrics"]


@pytest.mark.slow
def test_page_stays_connected_through_silences_and_gets_every_step_once(tmp_path):
    from playwright.sync_api import sync_playwright

    owner = get_user_model().objects.create_user(username="watcher", password=PASSWORD)
    run = running_run(owner)
    with (
        DbThread() as db,
        daphne_on_test_db(tmp_path / "daphne.log", queue=f"nobody-{os.getpid()}") as base,
        sync_playwright() as pw,
    ):
        browser, page, sockets, frames = _open_run_page(pw, base, run)
        try:
            for step in range(1, SOAK_STEPS + 1):
                db(ingest.metric_points_ingest, run_id=run.pk, step=step, values={"reward": step / 100})
                if step % 5 == 0:
                    db(
                        services.run_event_create,
                        run_id=run.pk,
                        kind=RunEventKind.LOG,
                        message=f"soak {step}",
                    )
                page.wait_for_timeout(GAPS_S[step % len(GAPS_S)] * 1000)
            page.wait_for_function(
                f"() => document.querySelector('.chart[data-metric=\"reward\"]')?.dataset.points === '{step}'",
                timeout=15_000,
            )
            assert len(sockets) == 1, f"the page opened {len(sockets)} websockets (reconnects): {sockets}"
            assert page.get_attribute("#run", "data-reconnects") is None
            assert page.text_content("#conn") == "live"
            assert _metric_steps(frames) == list(range(1, step + 1))
            events = [f["message"] for f in frames if f.get("type") == "event"]
            assert events == [f"soak {s}" for s in range(5, step + 1, 5)]
        finally:
            browser.close()


@pytest.mark.slow
def test_reconnect_fetches_missed_steps_and_events_once(tmp_path):
    from playwright.sync_api import sync_playwright

    owner = get_user_model().objects.create_user(username="watcher", password=PASSWORD)
    run = running_run(owner)
    port = free_port()
    queue = f"nobody-{os.getpid()}"
    with DbThread() as db, sync_playwright() as pw:
        with daphne_on_test_db(tmp_path / "daphne1.log", queue=queue, port=port) as base:
            browser, page, sockets, frames = _open_run_page(pw, base, run)
            for step in (1, 2):
                db(ingest.metric_points_ingest, run_id=run.pk, step=step, values={"reward": 0.1 * step})
            db(services.run_event_create, run_id=run.pk, kind=RunEventKind.LOG, message="before the drop")
            page.wait_for_function(
                "() => document.querySelectorAll('#events tr').length >= 1", timeout=10_000
            )
        try:
            # The web is gone: what happens now reaches the database only.
            page.wait_for_function(
                "() => document.getElementById('conn').textContent.startsWith('reconnecting')"
            )
            for step in (3, 4, 5):
                db(ingest.metric_points_ingest, run_id=run.pk, step=step, values={"reward": 0.1 * step})
            db(services.run_event_create, run_id=run.pk, kind=RunEventKind.LOG, message="missed while down")
            with daphne_on_test_db(tmp_path / "daphne2.log", queue=queue, port=port):
                page.wait_for_selector("#conn.live", timeout=30_000)
                page.wait_for_function(
                    "() => document.querySelector('.chart[data-metric=\"reward\"]')?.dataset.points === '5'",
                    timeout=15_000,
                )
                page.wait_for_function(
                    "() => [...document.querySelectorAll('#events pre')].some(p => p.textContent === 'missed while down')",
                    timeout=15_000,
                )
                db(
                    services.run_event_create,
                    run_id=run.pk,
                    kind=RunEventKind.LOG,
                    message="after the return",
                )
                page.wait_for_function(
                    "() => [...document.querySelectorAll('#events pre')].some(p => p.textContent === 'after the return')",
                    timeout=15_000,
                )
                assert page.get_attribute("#run", "data-reconnects") == "1"
                shown = page.eval_on_selector_all("#events pre", "els => els.map(e => e.textContent)")
                for message in ("before the drop", "missed while down", "after the return"):
                    assert shown.count(message) == 1, (message, shown)
        finally:
            browser.close()
