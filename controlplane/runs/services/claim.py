"""Claiming a queued run for a worker: its placement (GPUs, named server, vLLM port) planned and
leased under a per-host (or per-server) advisory lock; a run that does not fit waits queued
(:class:`PlacementWait`, the task retries) and one that can never fit fails with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Sequence
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.access.services import token_issue  # noqa: F401  (the runs API's callers issue tokens here)
from controlplane.runs.models import (
    ACTIVE_STATUSES,
    Run,
    RunEventKind,
    RunStatus,
    WorkerHost,
)
from controlplane.runs.placement import Unplaceable, Waiting, node_plan, placement_plan
from controlplane.runs.services.lifecycle import run_event_create, run_status_transition
from controlplane.runs.services.stream import run_status_publish
from trainer.config.resources import parse_resources

logger = logging.getLogger(__name__)


class PlacementWait(Exception):
    """The run fits its worker but not now (GPUs or its named server busy): it stays queued and the
    task retries; ``reason`` is on the run as ``waiting_reason``."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def run_claim(
    *, run_id: int, task_id: str, worker_host: str, worker_name: str = "", gpus: Sequence[str] = ()
) -> Run | None:
    """Take a queued run for this attempt: placed on ``gpus`` (the worker's inventory, empty on a
    CPU worker) beside the host's other live runs, ``starting``, a vLLM port free on
    ``worker_host`` (unless it uses a named server), the output directory.

    Returns None when the run is not this task's to take (stopped meanwhile, resumed by a newer
    task, or already claimed by a redelivered copy of this one), or when it can never be placed
    here (then it is failed with the reason). Raises :class:`PlacementWait` when its GPUs or its
    named server are busy now.
    """
    for _ in range(5):
        try:
            with transaction.atomic():
                run = Run.objects.select_for_update().get(pk=run_id)
                if run.status != RunStatus.QUEUED or (task_id and run.celery_task_id not in ("", task_id)):
                    return None
                plan = _placement_for(
                    run, worker_host=worker_host, worker_name=worker_name or worker_host, gpus=gpus
                )
                if plan is None:
                    return None
                if isinstance(plan, Waiting):
                    waiting = plan.reason
                    break
                now = timezone.now()
                run.status = RunStatus.STARTING
                run.attempt += 1
                run.worker_host = worker_host
                run.placement = plan
                run.waiting_reason = ""
                run.vllm_port = None
                if plan["server"] is None:
                    try:
                        run.vllm_port = _free_port(worker_host)
                    except RuntimeError as exc:
                        _fail_unclaimed(run_id=run.pk, reason=str(exc))
                        return None
                run.heartbeat_at = now
                run.started_at = None
                run.output_dir = run.output_dir or str(
                    Path(settings.GRPO_RUNS_DIR) / f"run-{run.pk}-{run.uid.hex[:8]}"
                )
                run.save()
                run_event_create(
                    run_id=run.pk,
                    kind=RunEventKind.STATUS,
                    message=f"starting (attempt {run.attempt} on {worker_host})",
                )
                run_event_create(
                    run_id=run.pk, kind=RunEventKind.INFO, message="placement: " + placement_text(plan)
                )
                run_status_publish(run_id=run.pk, status=RunStatus.STARTING)
                return run
        except IntegrityError as exc:
            if "run_port_unique_while_active" not in str(exc):
                raise
            continue  # another run on this host took the same port between our check and save
    else:
        _fail_unclaimed(run_id=run_id, reason=f"could not reserve a vLLM port on {worker_host}")
        return None
    # Recorded after the claim's transaction (rolled back by nothing, seen by the page at once).
    _run_wait(run_id, waiting)


def _placement_for(
    run: Run, *, worker_host: str, worker_name: str, gpus: Sequence[str]
) -> dict | Waiting | None:
    """The run's placement on this worker (inside the claim's transaction, under the host's lock),
    a :class:`Waiting` when it must wait, or None after failing a run that can never be placed here."""
    from controlplane.runs import worker_hosts

    resources = parse_resources(run.config.get("resources"))
    unknown = [name for name in resources.servers if name not in settings.GRPO_VLLM_SERVERS]
    if unknown:
        _fail_unclaimed(
            run_id=run.pk,
            reason=f"{resources.servers_field}: {', '.join(map(repr, unknown))} not registered on worker {worker_name} "
            f"(GRPO_VLLM_SERVERS has {', '.join(sorted(settings.GRPO_VLLM_SERVERS)) or 'none'})",
        )
        return None
    for name in sorted(resources.servers):  # one order for every claim: no two wait on each other
        _advisory_lock(f"grpo-server:{name}")
    for name in resources.servers:
        holder = (
            Run.objects.filter(status__in=ACTIVE_STATUSES)
            .filter(Q(placement__server=name) | Q(placement__servers__contains=[name]))
            .exclude(pk=run.pk)
            .values_list("pk", flat=True)
            .first()
        )
        if holder is not None:
            return Waiting(f"waiting for vLLM server {name!r}: run {holder} is using it")
    pool = resources.pool or settings.GRPO_RUNS_QUEUE
    others = (
        worker_hosts.pool_live_workers(pool=pool, exclude_host=worker_host)
        if resources.trainer_nodes > 1
        else []
    )
    for host in sorted(
        {worker_host, *(w.host for w in others)}
    ):  # one order: no two claims wait on each other
        _advisory_lock(f"grpo-host:{host}")
    try:
        plan = placement_plan(
            resources=resources,
            inventory=[str(g) for g in gpus],
            busy=_busy_gpus(worker_host),
            host=worker_host,
            worker=worker_name,
        )
    except Unplaceable as exc:
        largest = worker_hosts.pool_max_gpus(pool=pool)
        if largest is not None and largest > len(gpus) and resources.gpus_on(gpu_host=True) <= largest:
            return Waiting(f"waiting for a larger worker of pool {pool!r}: {exc}")
        _fail_unclaimed(run_id=run.pk, reason=str(exc))
        return None
    if isinstance(plan, Waiting) or resources.trainer_nodes == 1:
        return plan
    nodes = _nodes_plan(run=run, resources=resources, others=others, pool=pool, host=worker_host)
    if not isinstance(nodes, list):
        return nodes
    plan["nodes"] = nodes
    plan["node_hosts"] = [node["host"] for node in nodes]
    return plan


def _busy_gpus(host: str) -> set[str]:
    """The GPUs of ``host`` that live runs hold: their own host's and, for trainers across hosts, the
    share they hold of this one."""
    busy: set[str] = set()
    held = Run.objects.filter(status__in=ACTIVE_STATUSES).filter(
        Q(worker_host=host) | Q(placement__node_hosts__contains=[host])
    )
    for run_host, placement in held.values_list("worker_host", "placement"):
        placement = placement or {}
        if run_host == host:
            busy.update(str(g) for g in placement.get("gpus", []))
        for node in placement.get("nodes") or []:
            if node.get("host") == host:
                busy.update(str(g) for g in node.get("gpus", []))
    return busy


def _nodes_plan(
    *, run: Run, resources, others: list[WorkerHost], pool: str, host: str
) -> list[dict] | Waiting | None:
    """The shares of the ``nodes - 1`` further hosts (the first that fit now, in host order); a
    :class:`Waiting` when too few fit now; None after failing a run that too few hosts could ever hold."""
    wanted = resources.trainer_nodes - 1
    nodes: list[dict] = []
    waiting: list[str] = []
    possible = 0
    for worker in others:
        try:
            share = node_plan(
                resources=resources,
                inventory=[str(g) for g in worker.gpus or []],
                busy=_busy_gpus(worker.host),
                host=worker.host,
                worker=worker.name,
            )
        except Unplaceable as exc:
            waiting.append(str(exc))
            continue
        possible += 1
        if isinstance(share, Waiting):
            waiting.append(share.reason)
        elif len(nodes) < wanted:
            nodes.append(share)
    if len(nodes) == wanted:
        return nodes
    if possible < wanted:
        _fail_unclaimed(
            run_id=run.pk,
            reason=f"resources.trainer.nodes: {resources.trainer_nodes} needs {wanted} more live host"
            f"{'s' if wanted != 1 else ''} of pool {pool!r} beside {host}, and "
            f"{possible} can hold a node" + (f" ({'; '.join(waiting)})" if waiting else ""),
        )
        return None
    return Waiting(f"waiting for {wanted - len(nodes)} more host(s) of pool {pool!r}: " + "; ".join(waiting))


def _run_wait(run_id: int, reason: str) -> None:
    """Record why the queued run waits (an event when the reason changes) and raise PlacementWait."""
    changed = (
        Run.objects.filter(pk=run_id, status=RunStatus.QUEUED)
        .exclude(waiting_reason=reason[:500])
        .update(waiting_reason=reason[:500])
    )
    if changed:
        run_event_create(run_id=run_id, kind=RunEventKind.INFO, message=reason)
    raise PlacementWait(reason)


def _advisory_lock(key: str) -> None:
    """A transaction-scoped Postgres lock on ``key`` (claims on one host, or one server, take turns)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [key])


def placement_text(placement: dict) -> str:
    """One line for people: ``host-a (worker gpu@host-a): vLLM on GPUs 0 (TP 1 × DP 1), trainer on GPUs 1,2 (2 processes)``."""
    where = f"{placement.get('host')} (worker {placement.get('worker')})"
    vllm = placement.get("vllm")
    if len(placement.get("servers") or []) > 1:
        served = "vLLM servers " + ", ".join(repr(name) for name in placement["servers"])
    elif placement.get("server"):
        served = f"vLLM server {placement['server']!r}"
    elif vllm and vllm.get("gpus"):
        served = (
            f"vLLM on GPUs {','.join(vllm['gpus'])} (TP {vllm['tensor_parallel_size']} × DP "
            f"{vllm['data_parallel_size']})"
        )
    else:
        served = "vLLM on CPU"
    trainer = placement.get("trainer") or {}
    n = trainer.get("processes", 1)
    devices = f"GPUs {','.join(trainer['gpus'])}" if trainer.get("gpus") else "CPU"
    text = f"{where}: {served}, trainer on {devices} ({n} process{'es' if n != 1 else ''})"
    for node in placement.get("nodes") or []:
        devices = f"GPUs {','.join(node['gpus'])}" if node.get("gpus") else "CPU"
        k = node.get("processes", 1)
        text += f"; and on {node['host']} (worker {node['worker']}): {devices} ({k} process{'es' if k != 1 else ''})"
    return text


def _fail_unclaimed(*, run_id: int, reason: str) -> None:
    run_status_transition(
        run_id=run_id,
        allowed_from=(RunStatus.QUEUED,),
        to=RunStatus.FAILED,
        message=reason,
        failure_reason=reason,
    )


def _free_port(worker_host: str) -> int:
    """A port of ``GRPO_VLLM_PORTS`` no live run on this host holds and nothing listens on now."""
    low, high = settings.GRPO_VLLM_PORTS
    taken = set(
        Run.objects.filter(worker_host=worker_host, status__in=ACTIVE_STATUSES).values_list(
            "vllm_port", flat=True
        )
    )
    for port in range(low, high + 1):
        if port in taken:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free vLLM port in GRPO_VLLM_PORTS={low}-{high} on {worker_host}")
