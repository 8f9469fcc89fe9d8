"""Reads: which runs a user may see, metric series, completions, events, the registry."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from django.db.models import QuerySet
from django.http import Http404

from controlplane.runs.models import Checkpoint, CompletionSample, MetricPoint, Run, RunEvent
from controlplane.runs.services import finite_or_none
from trainer import registry

# The form's main hyper-parameters (the rest go in its advanced JSON box).
MAIN_ARGS = (
    "max_steps",
    "learning_rate",
    "num_generations",
    "max_completion_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "temperature",
    "max_staleness",
    "weight_sync_steps",
    "max_concurrent_rollouts",
    "save_steps",
    "seed",
    "log_completions",
)


def run_list(*, user: Any) -> QuerySet[Run]:
    """Runs ``user`` may see: their own; staff see everyone's. Newest first."""
    runs = Run.objects.select_related("owner")
    return runs if user.is_staff else runs.filter(owner=user)


def run_get(*, user: Any, run_id: int) -> Run:
    """One visible run; ``Http404`` for a run that does not exist or belongs to someone else."""
    run = run_list(user=user).filter(pk=run_id).first()
    if run is None:
        raise Http404(f"run {run_id} not found")
    return run


def run_metric_series(
    *, run: Run, names: list[str] | None = None, since_step: int | None = None
) -> dict[str, list[dict[str, Any]]]:
    """``{name: [{"step", "value"}, ...]}`` ordered by step; only steps > ``since_step``.

    Served by the (run, name, step) unique index. Non-finite values come back as None.
    """
    points = MetricPoint.objects.filter(run=run)
    if names:
        points = points.filter(name__in=names)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for name, step, value in points.order_by("name", "step").values_list("name", "step", "value"):
        series[name].append({"step": step, "value": finite_or_none(value)})
    if names:
        for name in names:
            series.setdefault(name, [])
    return dict(series)


def run_metric_latest(*, run: Run) -> dict[str, dict[str, Any]]:
    """The last logged value of every metric: ``{name: {"step", "value"}}`` (one DISTINCT ON query)."""
    rows = (
        MetricPoint.objects.filter(run=run)
        .order_by("name", "-step")
        .distinct("name")
        .values_list("name", "step", "value")
    )
    return {name: {"step": step, "value": finite_or_none(value)} for name, step, value in rows}


def run_completion_list(*, run: Run, since_step: int | None = None) -> QuerySet[CompletionSample]:
    """Sampled completions, newest step first."""
    samples = CompletionSample.objects.filter(run=run)
    if since_step is not None:
        samples = samples.filter(step__gt=since_step)
    return samples.order_by("-step", "index")


def run_event_list(*, run: Run, limit: int = 200) -> list[RunEvent]:
    """The run's latest ``limit`` events, oldest first."""
    events = list(RunEvent.objects.filter(run=run).order_by("-created_at", "-id")[:limit])
    return events[::-1]


def run_checkpoint_list(*, run: Run) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(run=run).order_by("step")


def run_checkpoint_get(*, run_id: int, step: int) -> Checkpoint | None:
    return Checkpoint.objects.filter(run_id=run_id, step=step).first()


def registry_get() -> dict[str, Any]:
    """What the form and ``GET /api/v1/registry/`` offer: registered names and the main defaults."""
    return {
        "models": dict(registry.MODELS),
        "datasets": dict(registry.DATASETS),
        "reward_funcs": dict(registry.REWARD_FUNCS),
        "tools": dict(registry.TOOLS),
        "environments": dict(registry.ENVIRONMENTS),
        "main_args": main_arg_defaults(),
    }


def main_arg_defaults() -> dict[str, Any]:
    """AsyncGRPOConfig's defaults (the spec's) for the form's main hyper-parameters."""
    from trainer.config import AsyncGRPOConfig

    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    return {name: fields[name].default for name in MAIN_ARGS}
