"""A newcomer's first minutes: ``make run`` (venv already installed) until the dashboard URL is printed,
and until the demo run's first metric is drawn on its page in a real browser.

Starts ``make run`` with a fresh database and runs queue (so it measures a first start, not a resumed
demo), reads the dashboard URL and the demo run's id from its output, logs in as ``demo`` in headless
Chromium and waits for the first chart on the run page. Also reports the run's own phase events
(model ready, vLLM server healthy, first step) as seconds since ``make run`` started, then stops the
stack with SIGINT to make's pid (as a user's Ctrl-C would, minus the terminal) and times the stop.

    .venv/bin/python -m bench.first_chart --out bench/results/first-chart-cpu.json

``--cold-vllm-cache`` points vLLM's compile cache at an empty folder (a machine's very first start).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _events(base: str, run_id: int, token: str) -> list[dict]:
    req = urllib.request.Request(
        f"{base}/api/v1/runs/{run_id}/events/", headers={"Authorization": f"Token {token}"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--cold-vllm-cache", action="store_true")
    opts = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    from worker.processes import free_port

    port = free_port()
    db = f"grpo_firstchart_{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{db}",
        "GRPO_RUNS_QUEUE": f"firstchart-{uuid.uuid4().hex[:8]}",
        "GRPO_RUNS_DIR": tempfile.mkdtemp(prefix="first-chart-runs-"),
    }
    if opts.cold_vllm_cache:
        env["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="first-chart-vllm-cache-")
    started = time.monotonic()
    proc = subprocess.Popen(
        ["make", "run", f"PORT={port}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    result: dict = {"cold_vllm_cache": opts.cold_vllm_cache}
    lines: list[str] = []
    try:
        run_id = None
        while run_id is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("make run ended early:\n" + "".join(lines))
            lines.append(line)
            if "dashboard:" in line:
                result["dashboard_url_s"] = round(time.monotonic() - started, 1)
            if m := re.search(r"demo run #(\d+)", line):
                run_id = int(m.group(1))
        base = f"http://127.0.0.1:{port}"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(f"{base}/runs/login/?next=/runs/{run_id}/")
            page.fill("input[name=username]", "demo")
            page.fill("input[name=password]", os.environ.get("GRPO_DEMO_PASSWORD", "demo"))
            page.click("button[type=submit], input[type=submit]")
            page.wait_for_url(f"**/runs/{run_id}/")
            result["run_page_s"] = round(time.monotonic() - started, 1)
            page.wait_for_selector(".chart[data-metric]", timeout=opts.timeout * 1000)
            result["first_metric_on_page_s"] = round(time.monotonic() - started, 1)
            page.wait_for_selector('.chart[data-metric="reward"]', timeout=120_000)
            result["first_reward_on_page_s"] = round(time.monotonic() - started, 1)
            browser.close()
        token = subprocess.run(
            [sys.executable, "manage.py", "issue_token", "demo"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        ).stdout.split()[-1]
        result["run_events"] = [
            {"kind": e["kind"], "message": e["message"][:160], "created_at": e["created_at"]}
            for e in _events(base, run_id, token)
        ]
        # Stop as a user would: SIGINT to make (the terminal would also signal runstack itself).
        stop_started = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        result["stop_s"] = round(time.monotonic() - stop_started, 1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(
            [
                "psql",
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-c",
                f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)',
            ],
            capture_output=True,
        )
    if opts.out:  # first: a reader that closes the pipe early must not lose the result
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "run_events"}))
    for event in result.get("run_events", []):
        print(f"  {event['created_at']}  {event['kind']:6s} {event['message'][:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
