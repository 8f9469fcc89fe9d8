"""Screenshots of the run page for the docs (issue 22): desktop (1400 px) and phone (390 px) width.

    .venv/bin/python scripts/screenshots.py [--from tests/data/demo_run] [--out docs/screenshots]

A run is stored from a recorded output folder (``metrics.jsonl``, ``completions.jsonl``; by default
``tests/data/demo_run``, 40 steps of the demo on the tiny model) by ``tests.recorded_run``, through
the supervisor's own reader, so the page shows what a live run's ingest stores. daphne serves the page on the configured database (DATABASE_URL) and Redis; headless
Chromium (Playwright) logs in and takes the shots. The user and the run are deleted afterwards.

Writes ``run-desktop.png`` and ``run-phone.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from bench.dashboard import _setup_django, _start_daphne  # noqa: E402
from worker.processes import free_port  # noqa: E402

USERNAME = "screenshots"
WIDTHS = {"desktop": (1400, 1000), "phone": (390, 844)}


def _shoot(base: str, run_id: int, password: str, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    written = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        for label, (width, height) in WIDTHS.items():
            page = browser.new_page(viewport={"width": width, "height": height}, device_scale_factor=1)
            page.goto(f"{base}/runs/login/?next=/runs/{run_id}/")
            page.fill("input[name=username]", USERNAME)
            page.fill("input[name=password]", password)
            page.click("button[type=submit], input[type=submit]")
            page.wait_for_selector(".chart[data-metric='reward'] canvas", timeout=60_000)
            page.wait_for_timeout(1500)  # the diagnosis and the completions arrive after the charts
            path = out / f"run-{label}.png"
            # The first screens a user sees (the whole page is many screens long).
            page.screenshot(
                path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": width, "height": height * 2}
            )
            written.append(path)
            page.close()
        browser.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--from", dest="source", type=Path, default=REPO / "tests" / "data" / "demo_run")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    args = parser.parse_args()
    _setup_django()
    from django.contrib.auth import get_user_model

    password = os.urandom(12).hex()
    user_model = get_user_model()
    user_model.objects.filter(username=USERNAME).delete()
    owner = user_model.objects.create_user(username=USERNAME, password=password)
    from tests.recorded_run import recorded_run

    run, output = recorded_run(owner, args.source)
    port = free_port()
    daphne = _start_daphne(port)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        for path in _shoot(f"http://127.0.0.1:{port}", run.pk, password, args.out):
            print(path)
    finally:
        daphne.terminate()
        daphne.wait(timeout=10)
        owner.delete()
        shutil.rmtree(output, ignore_errors=True)


if __name__ == "__main__":
    main()
