"""Reads: which runs a user may see, metric series, completions, events, the registry."""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.contrib.postgres.aggregates import ArrayAgg
from django.db.models import (
    Avg,
    BooleanField,
    Case,
    Count,
    Exists,
    ExpressionWrapper,
    F,
    FloatField,
    Func,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    TextField,
    Value,
    When,
)
from django.db.models.fields.json import KeyTextTransform
from django.http import Http404

from controlplane.runs.json_values import finite_or_none
from controlplane.runs.models import (
    COMPLETION_FIELDS,
    ChartPreference,
    Checkpoint,
    CompletionSample,
    MetricPoint,
    MetricStep,
    Run,
    RunEvent,
    RunFileCursor,
)
from trainer import metrics as metric_catalogue
from trainer import registry, run_schema
from trainer.metrics import ENTROPY, LOSS, NAMESPACES, PERF_STEP_S, REWARD, catalogue_payload

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


def run_metric_series(
    *, run: Run, names: list[str] | None = None, since_step: int | None = None
) -> dict[str, list[dict[str, Any]]]:
    """``{name: [{"step", "value"}, ...]}`` ordered by step; only steps > ``since_step``.

    Built from :func:`run_metric_columns` (arrays aggregated in Postgres). Non-finite values are None.
    """
    columns = run_metric_columns(run=run, names=names, since_step=since_step)
    return {
        name: [
            {"step": step, "value": value} for step, value in zip(col["steps"], col["values"], strict=True)
        ]
        for name, col in columns.items()
    }


def run_metric_columns(
    *, run: Run, names: list[str] | None = None, since_step: int | None = None
) -> dict[str, dict[str, list]]:
    """``{name: {"steps": [...], "values": [...]}}``: the series of :func:`run_metric_series` as
    parallel arrays, about 3x smaller as JSON and what chart libraries take as they are.

    Postgres builds the arrays (one ``array_agg`` per name over the (run, name, step) index) and turns
    NaN/inf into NULL, so 50 metrics x 5,000 steps cost no Python loop over 250k rows.
    """
    points = MetricPoint.objects.filter(run=run)
    if names:
        points = points.filter(name__in=names)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    finite = Case(
        When(value__in=[math.nan, math.inf, -math.inf], then=Value(None)),
        default=F("value"),
        output_field=FloatField(),
    )
    rows = (
        points.values("name")
        .annotate(steps=ArrayAgg("step", order_by="step"), values=ArrayAgg(finite, order_by="step"))
        .order_by("name")
        .values_list("name", "steps", "values")
    )
    columns = {name: {"steps": steps, "values": values} for name, steps, values in rows}
    for name in names or ():
        columns.setdefault(name, {"steps": [], "values": []})
    return columns


def run_metric_step_columns(*, run: Run, since_step: int | None = None) -> dict[str, list]:
    """When each logging step was logged and by which attempt, as parallel arrays by step:
    ``{"step": [...], "time": [unix seconds, ...], "attempt": [...]}`` (only steps > ``since_step``;
    steps stored before timestamps were kept have no entry)."""
    steps = MetricStep.objects.filter(run=run)
    if since_step is not None:
        steps = steps.filter(step__gt=since_step)
    rows = steps.order_by("step").values_list("step", "time", "attempt")
    columns: dict[str, list] = {"step": [], "time": [], "attempt": []}
    for step, time, attempt in rows:
        columns["step"].append(step)
        columns["time"].append(round(time.timestamp(), 3))
        columns["attempt"].append(attempt)
    return columns


# A user who never pinned a chart sees these first (the spec's headline numbers).
DEFAULT_PINNED_CHARTS = (REWARD, LOSS, ENTROPY, PERF_STEP_S)


def chart_preference_get(*, user: Any) -> dict[str, Any]:
    """``{"pinned": [metric names, in order], "default": bool}``: the user's pinned charts, or
    :data:`DEFAULT_PINNED_CHARTS` (``default`` true) while they never saved any."""
    pinned = ChartPreference.objects.filter(user=user).values_list("pinned", flat=True).first()
    if pinned is None:
        return {"pinned": list(DEFAULT_PINNED_CHARTS), "default": True}
    return {"pinned": list(pinned), "default": False}


def run_diagnosis(*, run: Run, window: int | None = None) -> list[dict[str, Any]]:
    """The spec's diagnosis tables (:mod:`trainer.diagnosis`) applied to the run's latest steps."""
    from trainer import diagnosis
    from trainer.diagnosis_words import evidence_labels

    window = window or diagnosis.DEFAULT_WINDOW_STEPS
    last_step = MetricPoint.objects.filter(run=run).aggregate(step=Max("step"))["step"]
    if last_step is None:
        return []
    points = MetricPoint.objects.filter(run=run, step__gt=max(0, last_step - window)).order_by("name", "step")
    series: dict[str, list[tuple[int, float | None]]] = defaultdict(list)
    for name, step, value in points.values_list("name", "step", "value"):
        series[name].append((step, finite_or_none(value)))
    config = (run.config.get("args") or {}) if isinstance(run.config, dict) else {}
    verdicts = [d.as_dict() for d in diagnosis.diagnose(series, config=config, window=window)]
    for verdict in verdicts:  # JSON has no NaN/inf
        verdict["evidence"] = {k: finite_or_none(v) for k, v in verdict["evidence"].items()}
        verdict["labels"] = evidence_labels(verdict["evidence"])
    return verdicts


def metric_names(*, runs: list[Run]) -> list[str]:
    """Every metric name any of ``runs`` logged, sorted."""
    names = MetricPoint.objects.filter(run__in=runs).values_list("name", flat=True).distinct()
    return sorted(names)


def compare_runs_get(*, user: Any, ids: list[int]) -> tuple[list[Run], list[int]]:
    """The runs of ``ids`` that ``user`` may see, in the order asked (duplicates once), and the ids
    that are not among them (absent or someone else's: the same answer, so nothing leaks)."""
    unique = list(dict.fromkeys(ids))
    found = {run.pk: run for run in run_list(user=user).filter(pk__in=unique)}
    return [found[i] for i in unique if i in found], [i for i in unique if i not in found]


def compare_default_metrics(*, names: list[str]) -> list[str]:
    """What the comparison charts when no metric is chosen: ``reward`` and ``loss`` (those of them
    logged, once any is); else the first two names logged; with nothing logged yet, both (a live
    run's first points then land on them)."""
    preferred = [name for name in (REWARD, LOSS) if name in names]
    return preferred or names[:2] or [REWARD, LOSS]


def metric_info(name: str) -> dict[str, str]:
    """``{"name", "namespace", "help"}`` of a concrete metric name from the catalogue; a name it does
    not declare (a plugin's) gets its prefix before the first ``/`` as namespace (``train`` without
    one) and no help."""
    try:
        declared = metric_catalogue.metric(name)
    except metric_catalogue.UnknownMetricError:
        return {"name": name, "namespace": name.split("/", 1)[0] if "/" in name else "train", "help": ""}
    return {"name": name, "namespace": declared.namespace, "help": declared.help}


def compare_metric_choices(*, runs: list[Run]) -> list[dict[str, Any]]:
    """Every metric any of ``runs`` logged, grouped for a picker:
    ``[{"namespace": "train", "metrics": [{"name", "namespace", "help"}, ...]}, ...]``, the
    namespaces in the catalogue's reading order (unknown ones after, alphabetically), names sorted."""
    groups: dict[str, list[dict[str, str]]] = defaultdict(list)
    for name in metric_names(runs=runs):
        info = metric_info(name)
        groups[info["namespace"]].append(info)
    order = {namespace: i for i, namespace in enumerate(NAMESPACES)}
    keys = sorted(groups, key=lambda ns: (order.get(ns, len(order)), ns))
    return [{"namespace": ns, "metrics": groups[ns]} for ns in keys]


_MISSING = object()


def config_flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A run document as ``{dotted path: leaf value}``: mappings are walked (``args.learning_rate``);
    lists holding mappings or lists are walked by index (``tools[0].name``); a list of plain values
    (``reward_funcs``), an empty mapping and a scalar are leaves."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(config_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        out = {}
        for index, item in enumerate(value):
            out.update(config_flatten(item, f"{prefix}[{index}]"))
        return out
    return {prefix or "(config)": value}


def _config_value_key(value: Any) -> str:
    """What two leaves are compared by: their JSON, so ``true`` and ``1`` differ while ``1`` and
    ``1.0`` (one number, as YAML and the trainer read it) do not."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True, default=str)


def run_config_diff(*, runs: list[Run]) -> list[dict[str, Any]]:
    """The compared runs' documents key by key: one row per flattened path (:func:`config_flatten`)
    any of them has, sorted by path: ``{"key": "args.learning_rate", "values": [v_run0, v_run1, ...],
    "present": [bool, ...], "differs": bool}``; ``values`` follows ``runs``' order (None where a run
    lacks the key: ``present`` tells that from a null). A key is ``differs`` when the runs do not
    all have it with one value; with fewer than two runs nothing differs."""
    flat = [config_flatten(run.config) for run in runs]
    keys = sorted({key for doc in flat for key in doc})
    rows = []
    for key in keys:
        leaves = [doc.get(key, _MISSING) for doc in flat]
        # None stands for "absent" (a JSON text is never None), so absent differs from null
        distinct = {None if v is _MISSING else _config_value_key(v) for v in leaves}
        rows.append(
            {
                "key": key,
                "values": [None if v is _MISSING else v for v in leaves],
                "present": [v is not _MISSING for v in leaves],
                "differs": len(distinct) > 1,
            }
        )
    return rows


def run_metric_latest(*, run: Run) -> dict[str, dict[str, Any]]:
    """The last logged value of every metric: ``{name: {"step", "value"}}`` (one DISTINCT ON query)."""
    rows = (
        MetricPoint.objects.filter(run=run)
        .order_by("name", "-step")
        .distinct("name")
        .values_list("name", "step", "value")
    )
    return {name: {"step": step, "value": finite_or_none(value)} for name, step, value in rows}


def run_metric_rows(
    *, run: Run, names: list[str] | None = None, since_step: int | None = None, chunk_rows: int = 2000
) -> tuple[list[str], Iterator[dict[str, Any]]]:
    """The run's metrics one step at a time, as ``metrics.jsonl`` has them: the metric names
    (sorted; the columns of a CSV) and an iterator of ``{"step": N, name: value, ...}`` by step
    (a name not logged at that step is absent; NaN/inf as stored).

    Streams: the points come through a server-side cursor ``chunk_rows`` at a time and one step is
    assembled at once, so a download of millions of points holds a chunk, not the run."""
    points = MetricPoint.objects.filter(run=run)
    if names:
        points = points.filter(name__in=names)
    if since_step is not None:
        points = points.filter(step__gt=since_step)
    columns = sorted(set(points.values_list("name", flat=True).distinct()))
    rows = (
        points.order_by("step", "name").values_list("step", "name", "value").iterator(chunk_size=chunk_rows)
    )

    def by_step() -> Iterator[dict[str, Any]]:
        for step, group in itertools.groupby(rows, key=lambda row: row[0]):
            yield {"step": step} | {name: value for _, name, value in group}

    return columns, by_step()


# ?ordering= of the completions (a leading "-" is descending): samples by their own value, groups
# (?by=group) by their mean reward / largest advantage; ties newest step first, then index / group.
COMPLETION_ORDERINGS = ("step", "-step", "reward", "-reward", "advantage", "-advantage")
# ?groups=: "mixed" keeps groups whose rollouts' rewards are not all equal (the ones that carry a
# GRPO signal); "zero_advantage" keeps groups whose every advantage is within this of 0.
COMPLETION_GROUP_FILTERS = ("mixed", "zero_advantage")
ZERO_ADVANTAGE_EPS = 1e-9


@dataclass(frozen=True)
class CompletionFilter:
    """Which sampled completions a query keeps (the completions API's and the downloads' filters):
    steps after ``since_step``, or only ``step``; only ``group_id``; ``q`` in the prompt or the
    completion (any case); the reward within [``reward_min``, ``reward_max``] (a sample without one
    is out); only the groups ``groups`` keeps (:data:`COMPLETION_GROUP_FILTERS`, decided per whole
    group in SQL)."""

    since_step: int | None = None
    step: int | None = None
    q: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    group_id: int | None = None
    groups: str | None = None

    def scope(self, run: Run) -> QuerySet[CompletionSample]:
        """The run's samples within the step and group bounds (the whole groups ``match`` looks in)."""
        samples = CompletionSample.objects.filter(run=run)
        if self.since_step is not None:
            samples = samples.filter(step__gt=self.since_step)
        if self.step is not None:
            samples = samples.filter(step=self.step)
        if self.group_id is not None:
            samples = samples.filter(group_id=self.group_id)
        return samples

    def match(self) -> Q | None:
        """The sample-level filters (``q``, the reward range) as one condition; None: no filter."""
        match = Q()
        if self.q:
            match &= Q(prompt__icontains=self.q) | Q(completion__icontains=self.q)
        if self.reward_min is not None:
            match &= Q(reward__gte=self.reward_min)
        if self.reward_max is not None:
            match &= Q(reward__lte=self.reward_max)
        return match or None


def run_completion_rows(
    *, run: Run, filters: CompletionFilter = CompletionFilter(), chunk_rows: int = 500
) -> Iterator[dict[str, Any]]:
    """Sampled completions oldest step first (``{field: value}`` for :data:`COMPLETION_FIELDS`),
    kept by ``filters``, through a server-side cursor ``chunk_rows`` at a time (texts can be long)."""
    samples = run_completion_list(run=run, filters=filters).order_by("step", "index")
    for values in samples.values_list(*COMPLETION_FIELDS).iterator(chunk_size=chunk_rows):
        yield dict(zip(COMPLETION_FIELDS, values, strict=True))


def _group_stats(samples: QuerySet[CompletionSample], groups: str | None) -> QuerySet:
    """``samples`` aggregated per (step, group_id) in SQL: size, reward min/mean/max, advantage
    max and largest magnitude; with ``groups``, only mixed or only zero-advantage groups (HAVING)."""
    stats = samples.values("step", "group_id").annotate(
        size=Count("id"),
        reward_min=Min("reward"),
        reward_max=Max("reward"),
        reward_mean=Avg("reward"),
        advantage_max=Max("advantage"),
        advantage_abs=Max(Func(F("advantage"), function="ABS", output_field=FloatField())),
    )
    if groups:
        stats = stats.filter(group_id__isnull=False)  # samples without a group form no group here
    if groups == "mixed":
        stats = stats.filter(reward_min__lt=F("reward_max"))
    elif groups == "zero_advantage":
        stats = stats.filter(advantage_abs__lte=ZERO_ADVANTAGE_EPS)
    return stats


def _ordered(field: str, ordering: str) -> Any:
    expr = F(field)
    return expr.desc(nulls_last=True) if ordering.startswith("-") else expr.asc(nulls_last=True)


def run_completion_list(
    *, run: Run, filters: CompletionFilter = CompletionFilter(), ordering: str = "-step"
) -> QuerySet[CompletionSample]:
    """Sampled completions kept by ``filters``. ``ordering``: one of :data:`COMPLETION_ORDERINGS`;
    default newest step first."""
    samples = filters.scope(run)
    match = filters.match()
    if match is not None:
        samples = samples.filter(match)
    if filters.groups:
        kept = _group_stats(filters.scope(run), filters.groups).filter(
            step=OuterRef("step"), group_id=OuterRef("group_id")
        )
        samples = samples.filter(Exists(kept))
    key = ordering.removeprefix("-")
    if key == "step":
        return samples.order_by(ordering, "index")
    return samples.order_by(_ordered(key, ordering), "-step", "index")


def run_completion_groups(
    *, run: Run, filters: CompletionFilter = CompletionFilter(), ordering: str = "-step"
) -> QuerySet:
    """The groups (step, group_id) of :func:`run_completion_list`'s samples, one dict each
    (``step``, ``group_id``, ``size``, ``reward_min`` / ``reward_mean`` / ``reward_max``,
    ``advantage_max``, ``matches``: its rollouts that pass ``q`` and the reward range), aggregated
    and paged in SQL so that a page never cuts a group. A group is kept when one of its rollouts
    matches; :func:`run_completion_group_rollouts` fills in every rollout. ``ordering``: ``step``
    (then group id, the same way: "-step" is newest group first), ``reward`` (the group's mean),
    ``advantage`` (its largest); ties newest first."""
    match = filters.match()
    stats = _group_stats(filters.scope(run), filters.groups).annotate(
        matches=Count("id", filter=match) if match is not None else Count("id")
    )
    if match is not None:
        stats = stats.filter(matches__gt=0)
    key = ordering.removeprefix("-")
    if key == "step":  # (step, group id) both one way, nulls as the index has them: its order
        direction = "desc" if ordering.startswith("-") else "asc"
        order = [getattr(F("step"), direction)(), getattr(F("group_id"), direction)()]
    else:
        field = "reward_mean" if key == "reward" else "advantage_max"
        order = [_ordered(field, ordering), F("step").desc(), F("group_id").desc(nulls_last=True)]
    return stats.order_by(*order)


def run_completion_group_rollouts(
    *,
    run: Run,
    groups: list[dict[str, Any]],
    filters: CompletionFilter = CompletionFilter(),
    ordering: str = "-step",
) -> list[dict[str, Any]]:
    """``groups`` (a page of :func:`run_completion_groups`) each with ``mixed`` (its rewards differ),
    ``prompt`` and ``reference`` (its first rollout's) and ``rollouts``: every one of the group's
    samples (:data:`COMPLETION_FIELDS` and ``match``: it passes ``filters.match()``), by
    reward or advantage when ``ordering`` sorts by one (same direction), else by index. One query."""
    if not groups:
        return []
    where = Q()
    for g in groups:
        where |= (
            Q(step=g["step"], group_id=g["group_id"])
            if g["group_id"] is not None
            else Q(step=g["step"], group_id__isnull=True)
        )
    samples = CompletionSample.objects.filter(run=run).filter(where)
    match = filters.match()
    samples = samples.annotate(
        match=ExpressionWrapper(match, output_field=BooleanField()) if match is not None else Value(True)
    )
    key = ordering.removeprefix("-")
    order = [_ordered(key, ordering), "index"] if key in ("reward", "advantage") else ["index"]
    by_group: dict[tuple[int, int | None], list[dict[str, Any]]] = defaultdict(list)
    for row in samples.order_by(*order).values(*COMPLETION_FIELDS, "match"):
        row["reward"], row["advantage"] = finite_or_none(row["reward"]), finite_or_none(row["advantage"])
        by_group[(row["step"], row["group_id"])].append(row)
    out = []
    for g in groups:
        rollouts = by_group.get((g["step"], g["group_id"]), [])
        first = min(rollouts, key=lambda r: r["index"]) if rollouts else {}
        out.append(
            {
                "step": g["step"],
                "group_id": g["group_id"],
                "size": g["size"],
                "matches": g["matches"],
                "reward_min": finite_or_none(g["reward_min"]),
                "reward_mean": finite_or_none(g["reward_mean"]),
                "reward_max": finite_or_none(g["reward_max"]),
                "mixed": g["reward_min"] is not None and g["reward_min"] < g["reward_max"],
                "prompt": first.get("prompt", ""),
                "reference": first.get("reference", ""),
                "rollouts": rollouts,
            }
        )
    return out


def run_completion_steps(*, run: Run) -> list[dict[str, int]]:
    """Every step that has sampled completions, newest first: ``{"step", "samples"}`` (one GROUP
    BY over the (run, step, index) index)."""
    rows = (
        CompletionSample.objects.filter(run=run)
        .values("step")
        .annotate(samples=Count("id"))
        .order_by("-step")
    )
    return [{"step": r["step"], "samples": r["samples"]} for r in rows]


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


def run_checkpoint_list(*, run: Run) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(run=run).order_by("step")


def run_checkpoint_get(*, run_id: int, step: int) -> Checkpoint | None:
    return Checkpoint.objects.filter(run_id=run_id, step=step).first()


def run_checkpoint_owned_get(*, user: Any, run_id: int, step: int) -> Checkpoint:
    """The checkpoint at ``step`` of ``user``'s own run ``run_id`` (with its run): its files go to
    the run's owner only, staff included. ``Http404`` for any other run, or no such checkpoint."""
    checkpoint = (
        Checkpoint.objects.select_related("run")
        .filter(run_id=run_id, run__owner_id=user.pk, step=step)
        .first()
    )
    if checkpoint is None:
        raise Http404(f"checkpoint {step} of run {run_id} not found")
    return checkpoint


def checkpoint_owned_by_path(*, user: Any, path: str) -> Checkpoint | None:
    """The checkpoint of one of ``user``'s own runs whose folder is ``path`` (as recorded), with its
    run; None for any other path, another user's checkpoint included."""
    if not getattr(user, "pk", None) or not isinstance(path, str) or not path:
        return None
    return Checkpoint.objects.select_related("run").filter(run__owner_id=user.pk, path=path).first()


def run_checkpoint_steps(*, run_id: int) -> set[int]:
    """The steps of the run's recorded checkpoints."""
    return set(Checkpoint.objects.filter(run_id=run_id).values_list("step", flat=True))


def run_file_cursors(*, run_id: int) -> dict[str, tuple[int, int | None, int]]:
    """How far each of the run's output files was ingested: name -> (byte offset, completions
    block step or None, its rows so far); a file never read is absent."""
    return {c.name: (c.offset, c.step, c.count) for c in RunFileCursor.objects.filter(run_id=run_id)}


REGISTRY_KEYS = {
    "model": "models",
    "dataset": "datasets",
    "reward_func": "reward_funcs",
    "tool": "tools",
    "environment": "environments",
    "rollout_loop": "rollout_loops",
}


def metric_catalogue_get() -> dict[str, Any]:
    """``GET /api/v1/metrics/catalogue/``: the namespaces in reading order and every declared metric
    (name or ``{pattern}``, reduction, unit, namespace, help, when it is logged), from
    :mod:`trainer.metrics`."""
    return catalogue_payload()


def registry_get() -> dict[str, Any]:
    """What the form and ``GET /api/v1/registry/`` offer: every name of every kind with its origin,
    target, first docstring line (rewards: the dataset columns they read), broken ones with their
    error; plugin modules that could not register; the main hyper-parameters' defaults."""
    out: dict[str, Any] = {
        key: {name: entry.as_dict() for name, entry in registry.entries(kind, include_broken=True).items()}
        for kind, key in REGISTRY_KEYS.items()
    }
    out["plugin_errors"] = dict(registry.current().module_errors)
    out["main_args"] = main_arg_defaults()
    return out


def main_arg_defaults() -> dict[str, Any]:
    """AsyncGRPOConfig's defaults (the spec's, from the run schema) for the form's main hyper-parameters."""
    return {name: run_schema.DEFAULTS[name] for name in MAIN_ARGS}


PREVIEW_ROWS = 3
PREVIEW_TEXT_CHARS = 300


def dataset_summary(*, name: str) -> dict[str, Any]:
    """``{"columns": [...], "rows": [first PREVIEW_ROWS rows], "num_rows": N}`` of a registered dataset
    or an allowed local path (the caller validated it). Loaded once per process for registered names
    and per modification time for files. Raises ``ValueError`` when it cannot be loaded."""
    path = Path(name)
    stamp = path.stat().st_mtime_ns if path.is_absolute() and path.exists() else None
    return _dataset_summary(name, stamp)


@functools.lru_cache(maxsize=64)
def _dataset_summary(name: str, stamp: int | None) -> dict[str, Any]:
    try:
        dataset = registry.load_dataset_by_name(name)
    except Exception as exc:  # a loader's failure is the dataset's, reported in words
        raise ValueError(f"could not be loaded: {type(exc).__name__}: {exc}") from exc
    rows = [dataset[i] for i in range(min(PREVIEW_ROWS, len(dataset)))]
    return {
        "columns": list(dataset.column_names),
        "rows": [_preview_value(row) for row in rows],
        "num_rows": len(dataset),
    }


def _preview_value(value: Any) -> Any:
    """JSON-safe, with long strings cut (a preview, not the data)."""
    if isinstance(value, str):
        return value if len(value) <= PREVIEW_TEXT_CHARS else value[:PREVIEW_TEXT_CHARS] + "…"
    if isinstance(value, dict):
        return {str(k): _preview_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_preview_value(v) for v in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)
