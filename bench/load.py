"""Control-plane load, on loopback, bounded in time:

1. metric ingestion sustained for ``--ingest-s`` seconds (default 60) through the service the trainer's
   supervisor's tailer calls (``metric_steps_ingest``: one upsert statement per batch of steps), from
   ``--writers`` concurrent writers (threads, each its own connection, each its own run);
2. the metrics query of a run with ``--query-points`` points (default 100,000 = 50 metrics x 2,000
   steps): the selector alone and the whole HTTP request through daphne, both layouts;
3. websocket delivery to ``--viewers`` concurrent viewers of one run (reuses bench/dashboard.py's
   measurement);
4. database connections under concurrent requests: ``--requests`` (2,000) GETs of a run's metrics
   from ``--clients`` (20) clients through daphne, with the most connections daphne held at once.

    .venv/bin/python bench/load.py [--ingest-s 60] [--writers 2] [--steps-per-batch 20]

Uses the configured database and Redis; its user and runs are deleted afterwards. Prints one JSON
object and writes it to bench/results/load-cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from bench.dashboard import _bench_latency, _setup_django, _start_daphne  # noqa: E402
from worker.processes import free_port  # noqa: E402

METRICS_PER_STEP = 50


def _run(user, name: str):
    from controlplane.runs.models import Run

    return Run.objects.create(
        owner=user, name=name, config={"model": "tiny", "args": {}}, config_sha256="0" * 64
    )


def bench_ingest(user, *, seconds: float, writers: int, steps_per_batch: int) -> dict:
    """Each writer upserts batches of ``steps_per_batch`` steps x 50 metrics into its own run."""
    from django.db import connection

    from controlplane.runs.services import ingest

    names = [f"ns{i % 6}/metric_{i}" for i in range(METRICS_PER_STEP)]
    runs = [_run(user, f"ingest {i}") for i in range(writers)]
    counts = [0] * writers
    batch_s: list[float] = []
    deadline = time.monotonic() + seconds

    def write(i: int) -> None:
        step = 0
        try:
            while time.monotonic() < deadline:
                steps = []
                for _ in range(steps_per_batch):
                    step += 1
                    steps.append((step, {n: step * 0.001 + j for j, n in enumerate(names)}))
                t0 = time.monotonic()
                counts[i] += ingest.metric_steps_ingest(run_id=runs[i].pk, steps=steps)
                batch_s.append(time.monotonic() - t0)
        finally:
            connection.close()

    started = time.monotonic()
    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    total = sum(counts)
    ms = sorted(1000 * s for s in batch_s)
    return {
        "seconds": round(elapsed, 1),
        "writers": writers,
        "points_per_batch": steps_per_batch * METRICS_PER_STEP,
        "points": total,
        "points_per_s": round(total / elapsed),
        "batch_ms_p50": round(ms[len(ms) // 2], 1),
        "batch_ms_p95": round(ms[int(len(ms) * 0.95)], 1),
    }


def bench_query(user, base: str, token: str, *, points: int) -> dict:
    from controlplane.runs import selectors
    from controlplane.runs.services import ingest

    steps = points // METRICS_PER_STEP
    run = _run(user, f"query {points}")
    names = [f"ns{i % 6}/metric_{i}" for i in range(METRICS_PER_STEP)]
    for start in range(1, steps + 1, 100):
        ingest.metric_steps_ingest(
            run_id=run.pk,
            steps=[
                (s, {n: s * 0.001 + j for j, n in enumerate(names)})
                for s in range(start, min(start + 100, steps + 1))
            ],
        )

    def timed(fn, repeat: int = 5) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(1000 * statistics.median(times), 1)

    def http(layout: str) -> None:
        request = urllib.request.Request(
            f"{base}/api/v1/runs/{run.pk}/metrics/?layout={layout}",
            headers={"Authorization": f"Token {token}"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()

    return {
        "points": steps * METRICS_PER_STEP,
        "selector_points_ms": timed(lambda: selectors.run_metric_series(run=run)),
        "selector_columns_ms": timed(lambda: selectors.run_metric_columns(run=run)),
        "http_points_ms": timed(lambda: http("points")),
        "http_columns_ms": timed(lambda: http("columns")),
        "http_one_metric_since_step_ms": timed(
            lambda: urllib.request.urlopen(
                urllib.request.Request(
                    f"{base}/api/v1/runs/{run.pk}/metrics/?names=ns0/metric_0&since_step={steps - 100}",
                    headers={"Authorization": f"Token {token}"},
                ),
                timeout=60,
            ).read()
        ),
    }


def connections_held(app_name: str) -> int:
    """Postgres connections open now whose ``application_name`` is ``app_name`` (libpq's PGAPPNAME)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [app_name])
        return int(cursor.fetchone()[0])


def bench_connections(
    base: str, path: str, token: str, *, requests: int, clients: int, app_name: str
) -> dict:
    """``requests`` GETs of ``path`` from ``clients`` concurrent clients (threads, keep-alive off);
    status counts, latency p50/p95 and the most connections the server (``app_name``) held at once,
    sampled every 20 ms while the load runs."""
    from concurrent.futures import ThreadPoolExecutor
    from urllib.error import HTTPError

    from django.db import close_old_connections

    statuses: dict[int, int] = {}
    latencies: list[float] = []
    lock = threading.Lock()
    peak = [connections_held(app_name)]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], connections_held(app_name))
            done.wait(0.02)
        close_old_connections()

    def one(_: int) -> None:
        request = urllib.request.Request(base + path, headers={"Authorization": f"Token {token}"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
                code = response.status
        except HTTPError as exc:
            code = exc.code
        except OSError:
            code = 599  # connection refused / reset: the server failed the client
        with lock:
            latencies.append(time.perf_counter() - started)
            statuses[code] = statuses.get(code, 0) + 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    latencies.sort()
    return {
        "requests": requests,
        "clients": clients,
        "path": path,
        "status_counts": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": sum(v for k, v in statuses.items() if k >= 500),
        "p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
        "p95_ms": round(latencies[int(len(latencies) * 0.95)] * 1000, 1),
        "requests_per_s": round(requests / wall, 1),
        "max_connections_held": peak[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ingest-s", type=float, default=60.0)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--steps-per-batch", type=int, default=20)
    parser.add_argument("--query-points", type=int, default=100_000)
    parser.add_argument("--viewers", type=int, default=50)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument(
        "--only",
        choices=("connections", "ingest", "query", "websocket"),
        default=None,
        help="run one part; its result is merged into the results file (the others are kept)",
    )
    args = parser.parse_args()
    wanted = {args.only} if args.only else {"connections", "ingest", "query", "websocket"}

    _setup_django()
    from django.contrib.auth import get_user_model

    from controlplane.access.services import token_issue

    user_model = get_user_model()
    user_model.objects.filter(username="bench-load").delete()
    user = user_model.objects.create_user(username="bench-load")
    token = token_issue(username="bench-load")
    port = free_port()
    app_name = f"grpo-load-{os.getpid()}"
    daphne = _start_daphne(port, env={"PGAPPNAME": app_name})
    base = f"http://127.0.0.1:{port}"
    parts: dict = {}
    try:
        if "connections" in wanted:
            small = _run(user, "connections")
            from controlplane.runs.services import ingest as run_ingest

            run_ingest.metric_steps_ingest(
                run_id=small.pk, steps=[(s, {"reward": s / 100}) for s in range(1, 201)]
            )
            parts["connections"] = bench_connections(
                base,
                f"/api/v1/runs/{small.pk}/metrics/",
                token,
                requests=args.requests,
                clients=args.clients,
                app_name=app_name,
            )
        if "ingest" in wanted:
            parts["ingest"] = bench_ingest(
                user, seconds=args.ingest_s, writers=args.writers, steps_per_batch=args.steps_per_batch
            )
        if "query" in wanted:
            parts["metrics_query"] = bench_query(user, base, token, points=args.query_points)
        if "websocket" in wanted:
            live = _run(user, "viewers")
            parts["websocket_latency"] = asyncio.run(
                _bench_latency(base, live.pk, token, args.viewers, args.messages, 10.0)
            )
    finally:
        daphne.terminate()
        daphne.wait(timeout=10)
        user.delete()
    out = REPO / "bench" / "results" / "load-cpu.json"
    command = "python bench/load.py " + " ".join(sys.argv[1:])
    for part in parts.values():
        if isinstance(part, dict):
            part["command"] = command
    result = json.loads(out.read_text()) if args.only and out.exists() else {}
    result.update(
        {
            "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
            **parts,
        }
    )
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
