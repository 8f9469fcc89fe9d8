"""Dashboard benchmark: first paint of a big run, websocket delivery latency under many viewers, and
a logged step's delivery from the trainer's file to the browser's socket.

    .venv/bin/python bench/dashboard.py [--metrics 50] [--steps 5000] [--viewers 50] [--messages 200]
    .venv/bin/python bench/dashboard.py --only delivery [--delivery-viewers 5] [--messages 200]
    .venv/bin/python bench/dashboard.py --only paint [--metrics 50] [--steps 5000]   (1. alone)

1. First paint: a run with ``--metrics`` metrics x ``--steps`` steps is written to Postgres; headless
   Chromium (Playwright, Debian's chromium) logs in and opens the run page served by daphne. Reported:
   the time from navigation start until every chart has drawn all its points (``data-points``), the
   REST history request's time and size, and the time to the first chart.
2. Delivery latency: ``--viewers`` websocket clients (token auth) follow one run while the real ingest
   service publishes ``--messages`` logging steps (50 metrics each, at ``--rate`` per second). Latency is
   the publish-to-receive time of every (viewer, message) pair: p50 / p95 / max.
3. File delivery (what a live run does; target p95 <= 500 ms): a fake trainer appends ``--messages``
   steps (50 metrics each, at ``--rate`` per second) to a real ``metrics.jsonl`` through the trainer's
   ``JsonlSink``; the supervisor's ``RunOutputTailer`` polls it every ``INGEST_POLL_S`` (as
   ``RunSupervisor._watch`` does) and stores + publishes; ``--delivery-viewers`` websocket clients
   through daphne receive it. Latency: the line's write time to each client's receive time.

Uses the configured database (DATABASE_URL) and Redis; the bench run and user are deleted afterwards.
Prints one JSON object and writes it to bench/results/dashboard-cpu.json (``--only delivery``:
bench/results/dashboard-delivery-cpu.json; ``--only paint``: bench/results/dashboard-paint-cpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from worker.processes import free_port

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")


def _setup_django() -> None:
    import django

    django.setup()
    from controlplane.preflight import require_services

    require_services()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _make_run(user, *, metrics: int, steps: int):
    """A finished run with ``metrics`` x ``steps`` points, written with COPY-sized bulk inserts."""
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.runs.models import MetricPoint, MetricStep, Run

    now = timezone.now()
    run = Run.objects.create(
        owner=user,
        name=f"bench {metrics}x{steps}",
        config={"model": "tiny", "args": {"max_steps": steps}},
        config_sha256="0" * 64,
        status="completed",
        finished_at=now,
    )
    namespaces = ("rollout", "sample", "batch", "perf", "sampling", "completions", "tools")
    names = ["reward", "loss"] + [f"{namespaces[i % len(namespaces)]}/metric_{i}" for i in range(metrics - 2)]
    batch: list[MetricPoint] = []
    for step in range(1, steps + 1):
        for i, name in enumerate(names):
            batch.append(MetricPoint(run=run, step=step, name=name, value=(step % 97) / 97 + i))
        if len(batch) >= 50_000:
            MetricPoint.objects.bulk_create(batch)
            batch = []
    MetricPoint.objects.bulk_create(batch)
    # One step a second, ending now (what the page's time axes read).
    MetricStep.objects.bulk_create(
        MetricStep(run=run, step=step, time=now - timedelta(seconds=steps - step), attempt=1)
        for step in range(1, steps + 1)
    )
    return run


def _start_daphne(port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    import urllib.request

    from controlplane.core.web_server import daphne_args

    proc = subprocess.Popen(
        [sys.executable, *daphne_args(host="127.0.0.1", port=port)],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("daphne did not start")


def bench_first_paint(base: str, run_id: int, metrics: int, steps: int, password: str) -> dict:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        # bypass_csp: the wait below is a JS predicate (eval), which the page's CSP refuses to page scripts.
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
        page.goto(base + "/runs/login/")
        page.fill("input[name=username]", "bench-viewer")
        page.fill("input[name=password]", password)
        page.click("button[type=submit], input[type=submit]")
        page.wait_for_url("**/runs/")
        results = []
        for _ in range(3):  # the first load also warms caches; report each
            page.goto(f"{base}/runs/{run_id}/")
            page.wait_for_function(
                # A function, not an expression: the page's CSP allows no eval of a string.
                f"() => document.querySelectorAll('.chart[data-points=\"{steps}\"]').length === {metrics}",
                timeout=120_000,
                polling=50,
            )
            done_ms = page.evaluate("performance.now()")
            timing = page.evaluate(
                """() => {
                  const nav = performance.getEntriesByType('navigation')[0];
                  const hist = performance.getEntriesByType('resource').find(r => r.name.includes('/metrics/?layout=columns'));
                  return {dom_content_loaded_ms: nav.domContentLoadedEventEnd,
                          history_request_ms: hist ? hist.responseEnd - hist.startTime : null,
                          history_bytes: hist ? hist.encodedBodySize : null};
                }"""
            )
            results.append({"all_charts_drawn_ms": round(done_ms, 1), **timing})
        browser.close()
    return {
        "loads": results,
        "median_all_charts_drawn_ms": statistics.median(r["all_charts_drawn_ms"] for r in results),
    }


async def _viewer(url: str, expected: int, latencies: list[float], ready: asyncio.Event, counter: list[int]):
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        first = json.loads((await ws.receive()).data)
        assert first["type"] == "status", first
        counter[0] += 1
        if counter[0] == counter[1]:
            ready.set()
        got = 0
        while got < expected:
            msg = await ws.receive(timeout=60)
            data = json.loads(msg.data)
            if data.get("type") != "metrics":
                continue
            latencies.append(time.time() - data["values"]["bench/sent_at"])
            got += 1


async def _start_viewers(
    base: str, run_id: int, token: str, viewers: int, messages: int, latencies: list[float]
) -> list[asyncio.Task]:
    """``viewers`` websocket clients of the run, each collecting ``messages`` latencies (seconds);
    returns their tasks once every one is connected."""
    url = base.replace("http", "ws") + f"/ws/runs/{run_id}/?token={token}"
    ready = asyncio.Event()
    counter = [0, viewers]
    tasks = [asyncio.create_task(_viewer(url, messages, latencies, ready, counter)) for _ in range(viewers)]
    await asyncio.wait_for(ready.wait(), timeout=60)
    return tasks


def _latency_summary(latencies: list[float]) -> dict:
    """Deliveries and p50 / p95 / max in milliseconds of ``latencies`` (seconds)."""
    ms = sorted(1000 * x for x in latencies)
    return {
        "deliveries": len(ms),
        "p50_ms": round(ms[len(ms) // 2], 2),
        "p95_ms": round(ms[int(len(ms) * 0.95)], 2),
        "max_ms": round(ms[-1], 2),
    }


async def _bench_latency(
    base: str, run_id: int, token: str, viewers: int, messages: int, rate: float
) -> dict:
    from asgiref.sync import sync_to_async

    from controlplane.runs.services import ingest

    latencies: list[float] = []
    tasks = await _start_viewers(base, run_id, token, viewers, messages, latencies)
    values = {f"bench/metric_{i}": float(i) for i in range(49)}

    def publish(step: int) -> None:
        ingest.metric_points_ingest(run_id=run_id, step=step, values={**values, "bench/sent_at": time.time()})

    started = time.monotonic()
    for step in range(1, messages + 1):
        await sync_to_async(publish)(step)
        await asyncio.sleep(max(0.0, started + step / rate - time.monotonic()))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    return {"viewers": viewers, "messages": messages, "rate_per_s": rate, **_latency_summary(latencies)}


async def _bench_file_delivery(
    base: str, run_id: int, token: str, out_dir: Path, viewers: int, messages: int, rate: float
) -> dict:
    from trainer.reporting.sinks import JsonlSink
    from worker.tailer import INGEST_POLL_S, RunOutputTailer

    latencies: list[float] = []
    tasks = await _start_viewers(base, run_id, token, viewers, messages, latencies)
    stop = threading.Event()

    def supervise() -> None:  # RunSupervisor._watch's ingest, on its own thread and connection
        from django.db import connection

        tailer = RunOutputTailer(run_id=run_id, output_dir=out_dir)
        try:
            while not stop.is_set():
                tailer.poll(now=time.monotonic())
                time.sleep(INGEST_POLL_S)
            tailer.drain()
        finally:
            connection.close()

    supervisor = threading.Thread(target=supervise, name="bench-tailer")
    supervisor.start()
    sink = JsonlSink(out_dir)  # the fake trainer: real appends to metrics.jsonl
    values = {f"bench/metric_{i}": float(i) for i in range(49)}
    started = time.monotonic()
    try:
        for step in range(1, messages + 1):
            sink.metrics(step, {**values, "bench/sent_at": time.time()})
            await asyncio.sleep(max(0.0, started + step / rate - time.monotonic()))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    finally:
        stop.set()
        supervisor.join(timeout=30)
    return {
        "viewers": viewers,
        "messages": messages,
        "rate_per_s": rate,
        "poll_s": INGEST_POLL_S,
        **_latency_summary(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--metrics", type=int, default=50)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--viewers", type=int, default=50)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--rate", type=float, default=10.0, help="logging steps published per second")
    parser.add_argument("--delivery-viewers", type=int, default=5)
    parser.add_argument("--only", choices=["all", "delivery", "paint"], default="all")
    args = parser.parse_args()

    _setup_django()
    from django.contrib.auth import get_user_model

    from controlplane.runs import services

    password = "bench-pass-" + str(os.getpid())
    user_model = get_user_model()
    user_model.objects.filter(username="bench-viewer").delete()
    user = user_model.objects.create_user(username="bench-viewer", password=password)
    port = free_port()
    daphne = _start_daphne(port)
    base = f"http://127.0.0.1:{port}"
    result: dict = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "command": "python bench/dashboard.py " + " ".join(sys.argv[1:]),
    }
    try:
        token = services.token_issue(username="bench-viewer")
        if args.only in ("all", "paint"):
            t0 = time.monotonic()
            big = _make_run(user, metrics=args.metrics, steps=args.steps)
            write_s = time.monotonic() - t0
            paint = bench_first_paint(base, big.pk, args.metrics, args.steps, password)
            result["first_paint"] = {
                "metrics": args.metrics,
                "steps": args.steps,
                "db_write_s": round(write_s, 1),
                **paint,
            }
        if args.only == "all":
            live = _make_run(user, metrics=2, steps=1)
            result["websocket_latency"] = asyncio.run(
                _bench_latency(base, live.pk, token, args.viewers, args.messages, args.rate)
            )
        elif args.only == "delivery":  # the same viewers fed by direct publishes, at the same moment
            direct = _make_run(user, metrics=2, steps=1)
            result["direct_publish_same_load"] = asyncio.run(
                _bench_latency(base, direct.pk, token, args.delivery_viewers, args.messages, args.rate)
            )
        if args.only != "paint":
            followed = _make_run(user, metrics=2, steps=1)
            with tempfile.TemporaryDirectory(prefix="bench-delivery-") as out_dir:
                result["file_to_socket_delivery"] = asyncio.run(
                    _bench_file_delivery(
                        base,
                        followed.pk,
                        token,
                        Path(out_dir),
                        args.delivery_viewers,
                        args.messages,
                        args.rate,
                    )
                )
    finally:
        daphne.terminate()
        daphne.wait(timeout=10)
        user.delete()  # cascades to the bench runs and their points
    name = {"all": "dashboard-cpu.json", "delivery": "dashboard-delivery-cpu.json"}.get(
        args.only, "dashboard-paint-cpu.json"
    )
    out = REPO / "bench" / "results" / name
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
