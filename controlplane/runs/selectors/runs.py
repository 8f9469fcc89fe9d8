"""Reads of runs: which runs a user may see, their list with progress and search, one run's
status and events."""

from __future__ import annotations

from typing import Any

from django.db.models import (
    F,
    Func,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    TextField,
    Value,
)
from django.db.models.fields.json import KeyTextTransform
from django.http import Http404

from controlplane.runs.models import (
    MetricPoint,
    Run,
    RunEvent,
)
from trainer.reporting.metrics import REWARD


def run_list(*, user: Any) -> QuerySet[Run]:
    """Runs ``user`` may see: their own; staff see everyone's. Newest first."""
    runs = Run.objects.select_related("owner")
    return runs if user.is_staff else runs.filter(owner=user)


def run_list_with_progress(*, user: Any) -> QuerySet[Run]:
    """:func:`run_list` annotated with ``last_step`` (highest logged step) and ``last_reward``."""
    points = MetricPoint.objects.filter(run=OuterRef("pk"))
    return run_list(user=user).annotate(
        last_step=Subquery(points.order_by("-step").values("step")[:1]),
        last_reward=Subquery(points.filter(name=REWARD).order_by("-step").values("value")[:1]),
    )


# ?ordering= keys of the run list (a leading "-" reverses) -> what they sort by; ties by newest id.
RUN_LIST_ORDERINGS = {
    "id": F("id"),
    "name": F("name"),
    "status": F("status"),
    "owner": F("owner__username"),
    "model": KeyTextTransform("model", "config"),
    "dataset": KeyTextTransform("train_dataset", "config"),
    "created": F("created_at"),
    "finished": F("finished_at"),
    "step": F("last_step"),
}


def run_list_search(
    *,
    user: Any,
    ids: list[int] | None = None,
    statuses: list[str] | None = None,
    owner: str | None = None,
    model: str | None = None,
    dataset: str | None = None,
    tags: list[str] | None = None,
    q: str | None = None,
    ordering: str = "-created",
) -> QuerySet[Run]:
    """:func:`run_list_with_progress` filtered and sorted on the server (the run list page and
    ``GET /api/v1/runs/`` take the same parameters, so a filtered list is a link).

    ``ids``: only these runs; ``statuses``: any of them; ``owner``: exact username; ``model`` / ``dataset``: substring of the
    config's ``model`` / ``train_dataset`` (case-insensitive); ``tags``: every one of them; ``q``:
    substring of the name, note, model, dataset, owner or a tag; ``ordering``: a key of
    :data:`RUN_LIST_ORDERINGS`, ``-`` first for descending (missing values last)."""
    runs = run_list_with_progress(user=user)
    if ids:
        runs = runs.filter(pk__in=ids)
    if statuses:
        runs = runs.filter(status__in=statuses)
    if owner:
        runs = runs.filter(owner__username=owner)
    if model:
        runs = runs.filter(config__model__icontains=model)
    if dataset:
        runs = runs.filter(config__train_dataset__icontains=dataset)
    if tags:
        runs = runs.filter(tags__contains=tags)
    if q:
        tag_text = Func(F("tags"), Value(" "), function="array_to_string", output_field=TextField())
        runs = runs.annotate(tag_text=tag_text).filter(
            Q(name__icontains=q)
            | Q(note__icontains=q)
            | Q(owner__username__icontains=q)
            | Q(config__model__icontains=q)
            | Q(config__train_dataset__icontains=q)
            | Q(tag_text__icontains=q)
        )
    key = ordering.removeprefix("-")
    expr = RUN_LIST_ORDERINGS[key]
    order = expr.desc(nulls_last=True) if ordering.startswith("-") else expr.asc(nulls_last=True)
    return runs.order_by(order, "-id")


def run_max_steps(*, run: Run) -> int | None:
    """The run's ``args.max_steps`` when it sets a positive one (else its length is in epochs)."""
    value = (run.config.get("args") or {}).get("max_steps") if isinstance(run.config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def run_status_snapshot(*, run: Run) -> dict[str, Any]:
    """What a dashboard needs to show where a run stands (the websocket's first message)."""
    last_step = MetricPoint.objects.filter(run=run).aggregate(step=Max("step"))["step"]
    return {
        "run_id": run.pk,
        "status": run.status,
        "step": last_step,
        "max_steps": run_max_steps(run=run),
        "attempt": run.attempt,
        "failure_reason": run.failure_reason,
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
    }


def run_get(*, user: Any, run_id: int) -> Run:
    """One visible run; ``Http404`` for a run that does not exist or belongs to someone else."""
    run = run_list(user=user).filter(pk=run_id).first()
    if run is None:
        raise Http404(f"run {run_id} not found")
    return run


def run_event_list(
    *,
    run: Run,
    limit: int = 200,
    after_id: int | None = None,
    kind: str | None = None,
    q: str | None = None,
) -> list[RunEvent]:
    """The run's latest ``limit`` events, oldest first; with ``after_id``, only events with a larger id
    (what a reconnecting page missed); with ``kind``, only that kind; with ``q``, only events whose
    message contains ``q`` in any case (the latest ``limit`` matches, not matches among the latest)."""
    events = RunEvent.objects.filter(run=run)
    if after_id is not None:
        events = events.filter(id__gt=after_id)
    if kind:
        events = events.filter(kind=kind)
    if q:
        events = events.filter(message__icontains=q)
    return list(events.order_by("-created_at", "-id")[:limit])[::-1]
