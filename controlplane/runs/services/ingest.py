"""What the supervisor stores as a run goes, read from the run's output folder (``worker/tailer.py``):
metrics (one upsert statement per batch of logging steps, on the natural keys, so a re-read or
resumed step replaces rather than duplicates), sampled completions, checkpoints, and how far each
file was read (:func:`run_output_ingest`: the lines and the new offsets in one transaction). Each is
also published to the run's channel-layer group once committed. Runs in the Celery worker; the
trainer process has no database access.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from django.conf import settings
from django.db import connection, transaction

from controlplane.runs.json_values import finite_or_none
from controlplane.runs.models import (
    COMPLETION_FIELDS,
    Checkpoint,
    CompletionSample,
    CompletionSplit,
    MetricPoint,
    MetricStep,
    Run,
    RunEventKind,
    RunFileCursor,
)
from controlplane.runs.services.lifecycle import run_event_create
from controlplane.runs.services.stream import MAX_PUBLISHED_TEXT_CHARS, run_message_publish


def _event_create(run_id: int, kind: str, message: str):
    return run_event_create(run_id=run_id, kind=kind, message=message)


def _message_publish(run_id: int, message: dict) -> None:
    run_message_publish(run_id=run_id, message=message)


def metric_points_ingest(*, run_id: int, step: int, values: Mapping[str, Any]) -> int:
    """Store one logging step's metrics (see :func:`metric_steps_ingest`). Returns the count."""
    return metric_steps_ingest(run_id=run_id, steps=[(step, values)])


# Not a metric: a metrics.jsonl row's wall time (unix seconds), stored on the step (MetricStep).
TIMESTAMP_KEY = "timestamp"
# An evaluation's metrics (issue 30): their line comes after later steps' lines and adds to a step
# that usually has its own line already, whose time and attempt it leaves as they are.
EVAL_PREFIX = "eval/"
MAX_TIMESTAMP = 32503680000.0  # 3000-01-01


def metric_steps_ingest(
    *,
    run_id: int,
    steps: Sequence[tuple[int, Mapping[str, Any]]],
    publish: bool = True,
    attempt: int | None = None,
) -> int:
    """Store several logging steps' metrics in one statement (upsert on (run, name, step)) and
    publish them in one channel-layer message: ``{"type": "run.metrics", "step", "values", "time",
    "attempt"}`` for one step, ``{"type": "run.metrics.batch", "steps": [{"step", "values", "time",
    "attempt"}, ...]}`` for several (the websocket consumer forwards each step as its own
    ``metrics`` message). Non-numeric values are skipped; a name logged twice for one step keeps the
    later value. A step's ``timestamp`` (unix seconds; absent: the time of storing) is no metric: it
    goes with ``attempt`` (None: the run's current one) to the step's :class:`MetricStep` row
    (``time``: unix seconds in the message); a step whose values are all ``eval/*`` (an eval line,
    which comes after later steps' lines) only adds points: its row, if it has one, keeps its time
    and attempt (the resume markers and time axes stay where the step's own line put them).
    Returns the count of metric points stored."""
    values_by_step: dict[int, dict[str, float]] = {}
    times: dict[int, float | None] = {}
    for step, values in steps:
        kept = values_by_step.setdefault(int(step), {})
        stamp = values.get(TIMESTAMP_KEY)
        # Out of Postgres' range or not a number: the time of storing instead (never a refused row).
        times[int(step)] = float(stamp) if _finite_number(stamp) and 0 <= stamp < MAX_TIMESTAMP else None
        for name, value in values.items():
            if isinstance(value, int | float) and name not in ("step", TIMESTAMP_KEY):
                kept[str(name)[:200]] = float(value)
    points = [(step, name, value) for step, kept in values_by_step.items() for name, value in kept.items()]
    if not points:
        return 0
    logged = {step: times[step] for step, kept in values_by_step.items() if kept}
    eval_only = {
        step for step, kept in values_by_step.items() if kept and all(n.startswith(EVAL_PREFIX) for n in kept)
    }
    stamps = _metric_steps_upsert(
        run_id, points, {s: t for s, t in logged.items() if s not in eval_only}, attempt
    )
    if eval_only:
        stamps.update(_metric_steps_keep(run_id, {s: logged[s] for s in eval_only}, attempt))
    items = [
        {
            "step": step,
            "values": {name: finite_or_none(value) for name, value in kept.items()},
            "time": stamps[step][0],
            "attempt": stamps[step][1],
        }
        for step, kept in sorted(values_by_step.items())
        if kept
    ]
    message = (
        {"type": "run.metrics", **items[0]}
        if len(items) == 1
        else {"type": "run.metrics.batch", "steps": items}
    )
    if publish:
        transaction.on_commit(lambda: _message_publish(run_id, message))
    return len(points)


def _metric_steps_upsert(
    run_id: int,
    points: list[tuple[int, str, float]],
    times: Mapping[int, float | None],
    attempt: int | None = None,
) -> dict[int, tuple[float, int]]:
    """One statement for a batch of steps: the points and each step's :class:`MetricStep`.

    ``points``: (step, name, value), upserted on (run, name, step) by ``INSERT ... SELECT FROM
    unnest(arrays)``: three array parameters instead of four placeholders per row, so a 1,000-point
    batch is one short statement (bench/load.py: about 2x ``bulk_create``). ``times``: step -> unix
    seconds, or None for "now" (the transaction's time); each step's row gets ``attempt``, or when
    None the run's current attempt (at least 1). Re-storing a step (a re-read, a resumed attempt re-doing it) replaces its
    values, time and attempt, so the same line read twice stores the same thing. The points' insert
    is a data-modifying CTE (Postgres runs it to completion whether or not it is read). Returns
    ``{step: (unix seconds, attempt)}`` as stored. The tables' constraints apply."""
    point_table = MetricPoint._meta.db_table
    steps = sorted(times)
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH points AS (INSERT INTO {point_table} (run_id, step, name, value) "
            "SELECT %s, s, n, v FROM unnest(%s::integer[], %s::varchar[], %s::double precision[]) AS t(s, n, v) "
            "ON CONFLICT (run_id, name, step) DO UPDATE SET value = EXCLUDED.value) "
            + _step_rows_insert()
            + "ON CONFLICT (run_id, step) DO UPDATE SET time = EXCLUDED.time, attempt = EXCLUDED.attempt "
            "RETURNING step, extract(epoch FROM time)::double precision, attempt",
            [
                run_id,
                [p[0] for p in points],
                [p[1] for p in points],
                [p[2] for p in points],
                run_id,
                attempt,
                run_id,
                steps,
                [times[s] for s in steps],
            ],
        )
        return {step: (stamp, attempt) for step, stamp, attempt in cursor.fetchall()}


def _step_rows_insert() -> str:
    """The :class:`MetricStep` rows of a batch (both statements below): ``INSERT ... SELECT`` over
    the parameters run id, attempt (None: the run's current one, at least 1), run id, steps (integer
    array) and unix times (array; NULL: now), before its ``ON CONFLICT`` clause."""
    return (
        f"INSERT INTO {MetricStep._meta.db_table} (run_id, step, time, attempt) "
        "SELECT %s, s, COALESCE(to_timestamp(t), now()), "
        f"COALESCE(%s::integer, (SELECT GREATEST(attempt, 1) FROM {Run._meta.db_table} WHERE id = %s)) "
        "FROM unnest(%s::integer[], %s::double precision[]) AS x(s, t) "
    )


def _metric_steps_keep(
    run_id: int, times: Mapping[int, float | None], attempt: int | None = None
) -> dict[int, tuple[float, int]]:
    """The :class:`MetricStep` rows of steps that only gained eval points: inserted as
    :func:`_metric_steps_upsert` would for a step without one (an eval before any training line,
    e.g. ``eval_on_start``), left as they are otherwise. Returns ``{step: (unix seconds, attempt)}``
    as stored (one statement: the rows inserted, then the ones that were there)."""
    step_table = MetricStep._meta.db_table
    steps = sorted(times)
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH added AS ("
            + _step_rows_insert()
            + "ON CONFLICT (run_id, step) DO NOTHING RETURNING step, time, attempt) "
            "SELECT step, extract(epoch FROM time)::double precision, attempt FROM added "
            f"UNION ALL SELECT step, extract(epoch FROM time)::double precision, attempt FROM {step_table} "
            "WHERE run_id = %s AND step = ANY(%s::integer[]) AND step NOT IN (SELECT step FROM added)",
            [run_id, attempt, run_id, steps, [times[s] for s in steps], run_id, steps],
        )
        return {step: (stamp, attempt) for step, stamp, attempt in cursor.fetchall()}


def completion_samples_ingest(
    *,
    run_id: int,
    step: int,
    items: Sequence[Mapping[str, Any]],
    first_index: int = 0,
    split: str = CompletionSplit.TRAIN,
) -> int:
    """Store sampled completions of one step and ``split`` (train, or eval: scored on ``eval_dataset``
    with the weights of ``step``) in one statement (upsert on (run, split, step, index), the items at
    indices ``first_index``, ``first_index + 1``, ...; none past ``GRPO_COMPLETIONS_PER_STEP``, counted
    per split) and publish ``{"type": "run.completions", "step", "split", "items"}``. ``reference``
    (the dataset row's reference answer) is stored as "" when absent. Returns the count stored."""
    split = CompletionSplit(split)
    items = list(items)[: max(0, settings.GRPO_COMPLETIONS_PER_STEP - first_index)]
    rows = [
        CompletionSample(
            run_id=run_id,
            split=split,
            step=step,
            index=first_index + i,
            prompt=_text(item.get("prompt")),
            completion=_text(item.get("completion")),
            reward=_float_or_none(item.get("reward")),
            rewards={str(k): finite_or_none(float(v)) for k, v in (item.get("rewards") or {}).items()},
            advantage=_float_or_none(item.get("advantage")),
            group_id=_int_or_none(item.get("group_id")),
            row_index=_int_or_none(item.get("row_index")),
            reference=_text(item.get("reference")),
        )
        for i, item in enumerate(items)
    ]
    if not rows:
        return 0
    CompletionSample.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["run", "split", "step", "index"],
        update_fields=[f for f in COMPLETION_FIELDS if f not in ("step", "index", "split")],
    )
    message = {
        "type": "run.completions",
        "step": step,
        "split": str(split),
        "items": [
            {
                "index": r.index,
                "prompt": r.prompt[:MAX_PUBLISHED_TEXT_CHARS],
                "completion": r.completion[:MAX_PUBLISHED_TEXT_CHARS],
                # Long texts are cut in the live message; REST (/completions/) has them whole.
                "truncated": max(len(r.prompt), len(r.completion), len(r.reference))
                > MAX_PUBLISHED_TEXT_CHARS,
                "reward": finite_or_none(r.reward),
                "rewards": r.rewards,
                "advantage": finite_or_none(r.advantage),
                "group_id": r.group_id,
                "row_index": r.row_index,
                "reference": r.reference[:MAX_PUBLISHED_TEXT_CHARS],
            }
            for r in rows
        ],
    }
    transaction.on_commit(lambda: _message_publish(run_id, message))
    return len(rows)


def checkpoint_record(*, run_id: int, step: int, path: str) -> Checkpoint:
    """Record (or re-record, after a resume) the checkpoint the trainer saved at ``step``, and
    publish ``{"type": "run.checkpoint", "step", "path", "created_at"}`` once committed (the run
    page adds or replaces its row)."""
    checkpoint, _ = Checkpoint.objects.update_or_create(run_id=run_id, step=step, defaults={"path": path})
    _event_create(run_id, RunEventKind.INFO, f"checkpoint saved at step {step}: {path}")
    message = {
        "type": "run.checkpoint",
        "step": checkpoint.step,
        "path": checkpoint.path,
        "created_at": checkpoint.created_at.isoformat(),
    }
    transaction.on_commit(lambda: _message_publish(run_id, message))
    return checkpoint


def run_output_ingest(
    *,
    run_id: int,
    metrics: Sequence[tuple[int, Mapping[str, Any]]] = (),
    completions: Sequence[tuple[str, int, int, Sequence[Mapping[str, Any]]]] = (),
    checkpoints: Sequence[tuple[int, str]] = (),
    cursors: Mapping[str, tuple[int, int | None, int, int | None, int]],
    attempt: int | None = None,
) -> None:
    """Store what was read from a run's output files, and how far, in one transaction: either all of
    it is stored and the offsets move, or nothing is (the same bytes are read again), so a worker
    killed at any point neither loses nor doubles a line.

    ``metrics``: (step, values), in file order (an eval line for an earlier step adds its names to
    that step; the step's training points stay); ``completions``: (split, step, first_index, items),
    consecutive blocks in file order; ``checkpoints``: (step, folder) not recorded yet; ``cursors``:
    file name -> (byte offset past the last line read, the training completions block's step or
    None, its rows so far, the eval block's step or None, its rows so far).
    ``attempt``: the attempt whose trainer wrote the lines (None: the run's current one; a new
    attempt's catch-up of its predecessor's unread lines names the predecessor). Messages are
    published after the commit.
    """
    with transaction.atomic():
        if metrics:
            metric_steps_ingest(run_id=run_id, steps=metrics, attempt=attempt)
        for split, step, first_index, items in completions:
            completion_samples_ingest(
                run_id=run_id, step=step, items=items, first_index=first_index, split=split
            )
        for step, path in checkpoints:
            checkpoint_record(run_id=run_id, step=step, path=path)
        if cursors:  # one upsert statement for every file read
            RunFileCursor.objects.bulk_create(
                [
                    RunFileCursor(
                        run_id=run_id,
                        name=name,
                        offset=offset,
                        step=step,
                        count=count,
                        eval_step=eval_step,
                        eval_count=eval_count,
                    )
                    for name, (offset, step, count, eval_step, eval_count) in cursors.items()
                ],
                update_conflicts=True,
                unique_fields=["run", "name"],
                update_fields=["offset", "step", "count", "eval_step", "eval_count"],
            )


# ---------------------------------------------------------------------------------- helpers
def _text(value: Any) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text.replace("\x00", "")  # Postgres text cannot hold NUL; a sampled byte token can be one


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
