"""Completions table queries on a big run: the run page's pages of groups, filtered and sorted in SQL.

    .venv/bin/python bench/completions_query.py [--steps 1600] [--per-step 64] [--group 8] [--repeat 5]
        [--other-runs 1]

Writes a run (after ``--other-runs`` others of its size) with ``--steps`` x ``--per-step`` completion rows (about 100k by default; groups of
``--group`` rollouts, every third group with mixed rewards, texts of ~300 characters) to the configured
database (DATABASE_URL), then times what ``GET /api/v1/runs/<id>/completions/`` runs for each of the
page's views: the count and one page of groups (``?by=group``), and the step picker's list. Each query
is run ``--repeat`` times (the best and median reported) and its ``EXPLAIN ANALYZE`` plan's top line
is kept. The bench run and user are deleted afterwards. Prints one JSON object and writes it to
bench/results/completions-query-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

WORDS = [
    "the",
    "model",
    "adds",
    "seven",
    "and",
    "five",
    "then",
    "checks",
    "the",
    "carry",
    "before",
    "it",
    "writes",
    "the",
    "boxed",
    "answer",
]


def _setup_django() -> None:
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _make_run(user, *, steps: int, per_step: int, group: int):
    """A finished run whose completions are written in one unnest insert per 50k rows."""
    from django.db import connection
    from django.utils import timezone

    from controlplane.runs.models import CompletionSample, Run

    run = Run.objects.create(
        owner=user,
        name="bench completions",
        config={"model": "tiny"},
        config_sha256="0" * 64,
        status="completed",
        finished_at=timezone.now(),
    )
    cols = {k: [] for k in ("step", "index", "prompt", "completion", "reward", "advantage", "group_id")}

    def flush() -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {CompletionSample._meta.db_table} (run_id, step, index, prompt, completion, "
                "reward, rewards, advantage, group_id, row_index, reference) "
                "SELECT %s, s, i, p, c, r, '{}'::jsonb, a, g, g, '' FROM unnest(%s::integer[], %s::integer[], "
                "%s::text[], %s::text[], %s::double precision[], %s::double precision[], %s::bigint[]) "
                "AS t(s, i, p, c, r, a, g)",
                [run.pk, *cols.values()],
            )
        for v in cols.values():
            v.clear()

    for step in range(1, steps + 1):
        for i in range(per_step):
            gid = (step * per_step + i) // group
            mixed = gid % 3 == 0
            reward = float(i % 2) if mixed else 1.0
            text = " ".join(WORDS[(gid + k) % len(WORDS)] for k in range(50))
            cols["step"].append(step)
            cols["index"].append(i)
            cols["prompt"].append(f"question {gid}: " + text[:200])
            cols["completion"].append(f"answer {step}-{i}: " + text)
            cols["reward"].append(reward)
            cols["advantage"].append((reward - 0.5) * 2 if mixed else 0.0)
            cols["group_id"].append(gid)
        if len(cols["step"]) >= 50_000:
            flush()
    flush()
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {CompletionSample._meta.db_table}")  # as autovacuum leaves it
    return run


def _time(fn, repeat: int) -> dict:
    """``fn()`` ``repeat`` times: best and median wall time in ms."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return {"best_ms": round(min(times), 2), "median_ms": round(statistics.median(times), 2)}


def _plan(queryset) -> str:
    """The plan's top line and total time (``EXPLAIN ANALYZE``)."""
    lines = queryset.explain(analyze=True).splitlines()
    return f"{lines[0].strip()} | {lines[-1].strip()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--per-step", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--other-runs", type=int, default=1, help="runs of the same size stored besides")
    args = parser.parse_args()
    _setup_django()
    from django.contrib.auth import get_user_model

    from controlplane.runs import selectors
    from controlplane.runs.selectors import CompletionFilter

    user = get_user_model().objects.create_user(f"bench-completions-{os.getpid()}")
    try:
        # Another run's rows first, as in a database that holds more than one run (with one run the
        # whole table is that run's, and Postgres rightly prefers a sequential scan).
        for _ in range(args.other_runs):
            _make_run(user, steps=args.steps, per_step=args.per_step, group=args.group)
        started = time.perf_counter()
        run = _make_run(user, steps=args.steps, per_step=args.per_step, group=args.group)
        rows = args.steps * args.per_step
        write_s = time.perf_counter() - started
        page = 10
        views = {
            # (filters, ordering)
            "groups newest first": (CompletionFilter(), "-step"),
            "groups by mean reward desc": (CompletionFilter(), "-reward"),
            "mixed groups newest first": (CompletionFilter(groups="mixed"), "-step"),
            "zero-advantage groups": (CompletionFilter(groups="zero_advantage"), "-step"),
            "groups of one step": (CompletionFilter(step=args.steps // 2), "-step"),
            "groups with reward in [0.5, 1]": (CompletionFilter(reward_min=0.5, reward_max=1.0), "-step"),
            "groups searched (q=)": (CompletionFilter(q="Answer 800-"), "-step"),
        }
        results: dict = {}
        for name, (filters, ordering) in views.items():
            groups = selectors.run_completion_groups(run=run, filters=filters, ordering=ordering)

            def one_page(groups=groups, filters=filters, ordering=ordering) -> None:
                groups.count()
                chunk = list(groups[:page])
                selectors.run_completion_group_rollouts(
                    run=run, groups=chunk, filters=filters, ordering=ordering
                )

            results[name] = {**_time(one_page, args.repeat), "plan": _plan(groups[:page])}
        samples = selectors.run_completion_list(run=run, ordering="-reward")
        timing = _time(lambda: (samples.count(), list(samples[:50])), args.repeat)
        results["samples by reward desc (page of 50)"] = {**timing, "plan": _plan(samples[:50])}
        results["step picker (every step)"] = _time(
            lambda: selectors.run_completion_steps(run=run), args.repeat
        )
        out = {
            "rows": rows,
            "write_s": round(write_s, 1),
            "groups_per_page": page,
            "host": platform.node(),
            "views": results,
        }
        print(json.dumps(out, indent=2))
        target = REPO / "bench" / "results" / "completions-query-cpu.json"
        target.parent.mkdir(exist_ok=True)
        target.write_text(json.dumps(out, indent=2) + "\n")
    finally:
        user.delete()  # the run and its rows go with it (CASCADE)


if __name__ == "__main__":
    main()
