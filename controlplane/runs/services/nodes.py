"""A trainer across hosts (``resources.trainer.nodes``): what the first host's supervisor and the
further hosts' workers write about each further host's part.

The claim (:mod:`.claim`) leases every host's share in the run's placement (``placement["nodes"]``).
The first host's supervisor, which owns the run, asks each further host's worker to start its part
(:func:`run_nodes_ask`: one :class:`~controlplane.runs.models.RunNode` row per host and attempt, and
a ``worker.run_node`` task on that worker's own queue). That worker reports its part's life on the
row (:func:`run_node_begin`, :func:`run_node_heartbeat`, :func:`run_node_end`); the first host's
supervisor reads the rows (:func:`run_node_problem`) and fails the run naming a host that failed, that
went silent for ``GRPO_NODE_LOST_AFTER_S`` or that never started within ``GRPO_NODE_JOIN_TIMEOUT_S``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.runs.models import ACTIVE_STATUSES, Run, RunEventKind, RunNode, RunNodeStatus
from controlplane.runs.services.lifecycle import run_event_create

NODE_TASK = "worker.run_node"


def run_nodes_ask(*, run_id: int, attempt: int, nodes: list[dict]) -> list[RunNode]:
    """Record that attempt ``attempt`` asked each further host of ``nodes`` (the placement's
    ``nodes``: host, worker, ...) to start its part, and send each worker its ``worker.run_node``
    task on its own queue (Celery's per-worker direct queue) once this is committed."""
    from celery.utils.nodenames import worker_direct

    from controlplane.celery import app

    rows = []
    with transaction.atomic():
        for index, node in enumerate(nodes, start=1):
            row, _ = RunNode.objects.update_or_create(
                run_id=run_id,
                attempt=attempt,
                index=index,
                defaults={
                    "host": node["host"],
                    "worker": node["worker"],
                    "status": RunNodeStatus.ASKED,
                    "asked_at": timezone.now(),
                },
            )
            rows.append(row)
        for row in rows:
            transaction.on_commit(
                lambda row=row: app.send_task(
                    NODE_TASK, args=[run_id, attempt, row.index], queue=worker_direct(row.worker)
                )
            )
    run_event_create(
        run_id=run_id,
        kind=RunEventKind.INFO,
        message="asked "
        + ", ".join(f"{row.host} (worker {row.worker}) for node {row.index}" for row in rows)
        + " to start its part of the trainer",
    )
    return rows


def run_node_begin(*, run_id: int, attempt: int, index: int, worker: str) -> Run | None:
    """The worker ``worker`` starts node ``index`` of attempt ``attempt``: the run, or None when
    that part is not this worker's to start (the run ended or moved on, or a redelivered task)."""
    with transaction.atomic():
        row = (
            RunNode.objects.select_for_update()
            .filter(run_id=run_id, attempt=attempt, index=index, worker=worker, status=RunNodeStatus.ASKED)
            .first()
        )
        run = Run.objects.filter(pk=run_id, attempt=attempt, status__in=ACTIVE_STATUSES).first()
        if row is None or run is None:
            return None
        row.heartbeat_at = timezone.now()
        row.status = RunNodeStatus.RUNNING
        row.save(update_fields=["heartbeat_at", "status"])
    return run


def run_node_heartbeat(*, run_id: int, attempt: int, index: int, pid: int | None = None) -> str | None:
    """Refresh node ``index``'s heartbeat (and its trainer's ``pid``); returns the run's status while
    this attempt is live, else None (the part should end)."""
    fields = {"heartbeat_at": timezone.now(), **({"pid": pid} if pid is not None else {})}
    RunNode.objects.filter(run_id=run_id, attempt=attempt, index=index).update(**fields)
    return (
        Run.objects.filter(pk=run_id, attempt=attempt, status__in=ACTIVE_STATUSES)
        .values_list("status", flat=True)
        .first()
    )


def run_node_end(*, run_id: int, attempt: int, index: int, exit_code: int | None, reason: str = "") -> None:
    """Node ``index``'s part ended: ``failed`` when there is a ``reason`` (one sentence), else
    ``exited`` (finished, or ended because the attempt ended on its first host)."""
    status = RunNodeStatus.FAILED if reason else RunNodeStatus.EXITED
    row = RunNode.objects.filter(run_id=run_id, attempt=attempt, index=index).first()
    if row is None:
        return
    row.status, row.exit_code, row.reason, row.heartbeat_at = status, exit_code, reason[:4000], timezone.now()
    row.save(update_fields=["status", "exit_code", "reason", "heartbeat_at"])
    if status == RunNodeStatus.FAILED:
        where = f"node {index} on {row.host} (worker {row.worker})"
        run_event_create(run_id=run_id, kind=RunEventKind.ERROR, message=f"{where}: {reason}")


@dataclass(frozen=True)
class NodeProblem:
    """What is wrong with a further host: ``kind`` ``failed`` (its processes ended badly), ``lost``
    (its worker went silent) or ``missing`` (it never started its part), said in ``sentence``."""

    kind: str
    sentence: str


def run_node_problem(*, run_id: int, attempt: int) -> NodeProblem | None:
    """The first further host of attempt ``attempt`` that failed, went silent or never started;
    None while every one is well (or ended well)."""
    now = timezone.now()
    lost_after = timedelta(seconds=settings.GRPO_NODE_LOST_AFTER_S)
    join_timeout = timedelta(seconds=settings.GRPO_NODE_JOIN_TIMEOUT_S)
    for row in RunNode.objects.filter(run_id=run_id, attempt=attempt).order_by("index"):
        where = f"host {row.host} (node {row.index}, worker {row.worker})"
        if row.status == RunNodeStatus.FAILED:
            return NodeProblem("failed", f"{where} failed: {row.reason or f'exit status {row.exit_code}'}")
        if row.status == RunNodeStatus.RUNNING and row.heartbeat_at and now - row.heartbeat_at > lost_after:
            silent = (now - row.heartbeat_at).total_seconds()
            return NodeProblem(
                "lost",
                f"{where} lost: its worker sent no heartbeat for {silent:.0f} s (GRPO_NODE_LOST_AFTER_S "
                f"{settings.GRPO_NODE_LOST_AFTER_S:g}); its trainer ranks are gone. Resume the run once the "
                "host is back, or on other hosts",
            )
        if row.status == RunNodeStatus.ASKED and now - row.asked_at > join_timeout:
            return NodeProblem(
                "missing",
                f"{where} did not start its part within GRPO_NODE_JOIN_TIMEOUT_S "
                f"{settings.GRPO_NODE_JOIN_TIMEOUT_S:g} s (its worker stopped, or all its slots are busy: "
                "raise its Celery concurrency)",
            )
    return None


def run_nodes_ended(*, run_id: int, attempt: int) -> bool:
    """Whether every further host of attempt ``attempt`` has reported the end of its part."""
    return not RunNode.objects.filter(
        run_id=run_id, attempt=attempt, status__in=(RunNodeStatus.ASKED, RunNodeStatus.RUNNING)
    ).exists()
