"""Reads of what a run wrote: its checkpoints (owned, by step, by path) and the offsets of its
files the ingest has read."""

from __future__ import annotations

from typing import Any

from django.db.models import (
    QuerySet,
)
from django.http import Http404

from controlplane.runs.models import (
    Checkpoint,
    Run,
    RunFileCursor,
)


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


def run_file_cursors(*, run_id: int) -> dict[str, tuple[int, int | None, int, int | None, int]]:
    """How far each of the run's output files was ingested: name -> (byte offset, training
    completions block step or None, its rows so far, eval block step or None, its rows so far); a
    file never read is absent."""
    return {
        c.name: (c.offset, c.step, c.count, c.eval_step, c.eval_count)
        for c in RunFileCursor.objects.filter(run_id=run_id)
    }
