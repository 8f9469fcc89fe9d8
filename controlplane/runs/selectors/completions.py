"""Reads of a run's sampled completions: filtered lists, groups and their rollouts, the steps
that have any, the rows a download streams."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.db.models import (
    Avg,
    BooleanField,
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
    Value,
)

from controlplane.runs.json_values import finite_or_none
from controlplane.runs.models import (
    COMPLETION_FIELDS,
    CompletionSample,
    CompletionSplit,
    Run,
)

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
    one ``split`` (training rows by default, or the eval rows); steps after ``since_step``, or only ``step``; only ``group_id``; ``q`` in the prompt or the
    completion (any case); the reward within [``reward_min``, ``reward_max``] (a sample without one
    is out); only the groups ``groups`` keeps (:data:`COMPLETION_GROUP_FILTERS`, decided per whole
    group in SQL)."""

    split: str = CompletionSplit.TRAIN
    since_step: int | None = None
    step: int | None = None
    q: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    group_id: int | None = None
    groups: str | None = None

    def scope(self, run: Run) -> QuerySet[CompletionSample]:
        """The run's samples within the step and group bounds (the whole groups ``match`` looks in)."""
        samples = CompletionSample.objects.filter(run=run, split=self.split)
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


def run_has_eval(*, run: Run) -> bool:
    """Whether the run evaluates: its document names an ``eval_dataset``, or it has eval completions
    (the run page's Training/Eval switch and its eval charts pinned by default)."""
    config = run.config if isinstance(run.config, dict) else {}
    if config.get("eval_dataset"):
        return True
    return CompletionSample.objects.filter(run=run, split=CompletionSplit.EVAL).exists()


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
    samples = CompletionSample.objects.filter(run=run, split=filters.split).filter(where)
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
                "split": filters.split,
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


def run_completion_steps(*, run: Run, split: str = CompletionSplit.TRAIN) -> list[dict[str, int]]:
    """Every step that has sampled completions of ``split``, newest first: ``{"step", "samples"}``
    (one GROUP BY over the (run, split, step, index) index)."""
    rows = (
        CompletionSample.objects.filter(run=run, split=split)
        .values("step")
        .annotate(samples=Count("id"))
        .order_by("-step")
    )
    return [{"step": r["step"], "samples": r["samples"]} for r in rows]
