"""Everything that writes runs: their life cycle and placement (HackSoft style: keyword-only, typed).

Status changes are conditional ``UPDATE ... WHERE status IN (...)`` statements, so the API, the
supervisor and the staleness check can race without corrupting the life cycle (see models.py);
each successful change records a :class:`RunEvent` and is published to the run's channel-layer
group ``run-<id>`` after the transaction commits.

What a run produces (metrics, completions, checkpoints) is written by :mod:`controlplane.runs.ingest`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import socket
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.access.services import token_issue  # noqa: F401  (the runs API's callers issue tokens here)
from controlplane.runs.models import (
    ACTIVE_STATUSES,
    RESUMABLE_STATUSES,
    TERMINAL_STATUSES,
    Checkpoint,
    Run,
    RunEvent,
    RunEventKind,
    RunStatus,
)
from controlplane.runs.placement import Unplaceable, Waiting, placement_plan
from controlplane.runs.validation import run_document_validate
from trainer.resources import parse_resources

logger = logging.getLogger(__name__)

SUPERVISE_TASK = "worker.run_supervise"
MAX_EVENT_CHARS = 20_000
MAX_PUBLISHED_TEXT_CHARS = 8_000


class RunStateError(Exception):
    """The run's current status does not allow the action (the API answers 409)."""


class IdempotencyKeyReused(RunStateError):
    """An ``Idempotency-Key`` already created a run with a different document."""


class QueuedRunsLimit(RunStateError):
    """The owner already has ``GRPO_MAX_QUEUED_RUNS_PER_USER`` runs waiting (the API answers 429)."""


# ------------------------------------------------------------------------------------ creation
def run_create(
    *, owner: Any, config: dict, name: str = "", idempotency_key: str = "", launch: bool = True
) -> tuple[Run, bool]:
    """Validate ``config`` (a RUN.yaml document), store it as a queued run and launch it.

    The one place the web validates a document (:func:`run_config_validate`; the API's serializer
    and the form only parse it and place these errors beside their fields). Returns ``(run,
    created)``; with an ``idempotency_key`` already used by ``owner`` the existing run comes back
    with ``created=False`` (a retried POST never makes a second run). Raises
    :class:`~trainer.run_config.RunConfigError` (field path -> message) for an invalid document.
    """
    run_config_validate(config=config)
    key = idempotency_key.strip()[:255]
    digest = _config_sha256(config) if isinstance(config, dict) else ""
    if key:
        existing = Run.objects.filter(owner=owner, idempotency_key=key).first()
        if existing is not None:
            return _idempotent_replay(existing, digest), False
    queued = Run.objects.filter(owner=owner, status=RunStatus.QUEUED).count()
    if queued >= settings.GRPO_MAX_QUEUED_RUNS_PER_USER:
        raise QueuedRunsLimit(
            f"you have {queued} queued runs (GRPO_MAX_QUEUED_RUNS_PER_USER = "
            f"{settings.GRPO_MAX_QUEUED_RUNS_PER_USER}); stop some or wait for them to start"
        )
    try:
        with transaction.atomic():
            run = Run.objects.create(
                owner=owner,
                name=(name.strip() or _default_name(config))[:200],
                config=config,
                config_sha256=digest,
                idempotency_key=key,
            )
            _event(run.pk, RunEventKind.STATUS, "queued")
            if launch:
                run_launch(run=run)
    except IntegrityError:
        if not key:
            raise
        # A concurrent request with the same key won the race.
        existing = Run.objects.get(owner=owner, idempotency_key=key)
        return _idempotent_replay(existing, digest), False
    return run, True


def run_config_validate(*, config: Any) -> dict:
    """Check an untrusted RUN.yaml document against the run schema and the control plane's rules
    (:func:`~controlplane.runs.validation.run_document_validate`, no transformers import); return it.

    Raises :class:`~trainer.run_config.RunConfigError` with every problem, ``{field path: message}``.
    :func:`run_create` calls it; the run form calls it alone when some of its own fields did not
    clean (nothing is created then), so that every error shows at once.
    """
    return run_document_validate(document=config)


def run_launch(*, run: Run) -> Run:
    """Enqueue the supervisor task for the run's next attempt (the run must be ``queued``).

    The first launch freezes the config (``launched_at``; a database trigger refuses later changes).
    The task goes to the run's pool (:func:`run_queue`) once the surrounding transaction commits.
    """
    if run.status != RunStatus.QUEUED:
        raise RunStateError(f"run {run.pk} is {run.status}; only a queued run can be launched")
    task_id = str(uuid.uuid4())
    Run.objects.filter(pk=run.pk).update(
        celery_task_id=task_id, launched_at=Coalesce(F("launched_at"), timezone.now())
    )
    run.refresh_from_db()
    queue = run_queue(run=run)
    transaction.on_commit(lambda: _enqueue(run_id=run.pk, task_id=task_id, queue=queue))
    return run


def run_queue(*, run: Run) -> str:
    """The Celery queue of the run's pool: ``resources.pool``, else ``GRPO_RUNS_QUEUE``."""
    pool = (run.config.get("resources") or {}).get("pool") if isinstance(run.config, dict) else None
    return pool if isinstance(pool, str) and pool else settings.GRPO_RUNS_QUEUE


def _enqueue(*, run_id: int, task_id: str, queue: str) -> None:
    from worker.celery import app

    try:
        app.send_task(SUPERVISE_TASK, args=[run_id], task_id=task_id, queue=queue)
    except Exception as exc:  # the broker is down: say so on the run instead of leaving it queued
        logger.exception("could not enqueue run %s", run_id)
        _transition(
            run_id=run_id,
            allowed_from=(RunStatus.QUEUED,),
            to=RunStatus.FAILED,
            message=f"could not enqueue the run on queue {queue!r}: {exc}",
            failure_reason=f"could not enqueue the run on queue {queue!r}: {exc}",
        )
    else:
        _event(run_id, RunEventKind.INFO, f"enqueued on {queue!r} (task {task_id})")


def demo_run_start() -> Run:
    """The demo run ``make run`` starts: the tiny model on arithmetic, ~200 steps, owner ``demo``.

    Reuses the demo user's run that is still queued or live, so restarting the stack does not pile
    up demo runs.
    """
    user, created = get_user_model().objects.get_or_create(username="demo")
    if created:
        user.set_password(settings.GRPO_DEMO_PASSWORD)
        user.save(update_fields=["password"])
    live = Run.objects.filter(owner=user, status__in=(RunStatus.QUEUED, *ACTIVE_STATUSES)).first()
    if live is not None:
        return live
    run, _ = run_create(owner=user, name="demo: tiny model on arithmetic", config=demo_config())
    return run


def demo_config() -> dict:
    """The demo RUN.yaml document (registry names only, so it passes the web's validation).

    Defined with its task (:func:`trainer.tasks.demo.demo_run_document`), where
    ``bench/demo_learning.py`` measures the reward curve it gives.
    """
    from trainer.tasks.demo import demo_run_document

    return demo_run_document()


# ------------------------------------------------------------------------------ user actions
def run_stop(*, run: Run) -> Run:
    """Ask a run to stop. Cooperative: the supervisor sees ``stopping``, ends both processes
    (SIGTERM, then SIGKILL after ``GRPO_STOP_GRACE_S``) and records ``stopped``.

    A queued run (no supervisor yet) and a run whose supervisor is gone (stale heartbeat) are marked
    ``stopped`` at once. Raises :class:`RunStateError` for a finished run.
    """
    if run.status in TERMINAL_STATUSES:
        raise RunStateError(f"run {run.pk} is already {run.status}")
    if run.status == RunStatus.QUEUED:
        _transition(
            run_id=run.pk,
            allowed_from=(RunStatus.QUEUED,),
            to=RunStatus.STOPPED,
            message="stopped before a worker picked it up",
        )
    elif _heartbeat_stale(run.heartbeat_at):
        _transition(
            run_id=run.pk,
            allowed_from=ACTIVE_STATUSES,
            to=RunStatus.STOPPED,
            message=f"stopped; no live supervisor (last heartbeat {run.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC)",
        )
    else:
        _transition(
            run_id=run.pk,
            allowed_from=(RunStatus.STARTING, RunStatus.RUNNING),
            to=RunStatus.STOPPING,
            message="stop requested",
        )
    run.refresh_from_db()
    return run


def run_resume(*, run: Run) -> Run:
    """Start a new attempt of a failed or stopped run; the supervisor resumes from the latest
    checkpoint in the run's output directory (or starts over when there is none)."""
    if run.status not in RESUMABLE_STATUSES:
        raise RunStateError(f"run {run.pk} is {run.status}; only failed or stopped runs can be resumed")
    with transaction.atomic():
        changed = _transition(
            run_id=run.pk,
            allowed_from=RESUMABLE_STATUSES,
            to=RunStatus.QUEUED,
            message=f"resume requested (attempt {run.attempt + 1})",
            finished_at=None,
            failure_reason="",
            heartbeat_at=None,
            vllm_port=None,
            vllm_pid=None,
            trainer_pid=None,
            vllm_exit_code=None,
            trainer_exit_code=None,
            placement={},  # the previous attempt's stays in its events; the next claim places anew
            waiting_reason="",
        )
        if not changed:
            run.refresh_from_db()
            raise RunStateError(f"run {run.pk} is {run.status}; only failed or stopped runs can be resumed")
        run.refresh_from_db()
        run_launch(run=run)
    return run


# ------------------------------------------------------------------------- supervisor's side
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
                _event(run.pk, RunEventKind.STATUS, f"starting (attempt {run.attempt} on {worker_host})")
                _event(run.pk, RunEventKind.INFO, "placement: " + placement_text(plan))
                _publish_status(run.pk, RunStatus.STARTING)
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
    if resources.server is not None:
        if resources.server not in settings.GRPO_VLLM_SERVERS:
            _fail_unclaimed(
                run_id=run.pk,
                reason=f"resources.server: {resources.server!r} is not registered on worker {worker_name} "
                f"(GRPO_VLLM_SERVERS has {', '.join(sorted(settings.GRPO_VLLM_SERVERS)) or 'none'})",
            )
            return None
        _advisory_lock(f"grpo-server:{resources.server}")
        holder = (
            Run.objects.filter(status__in=ACTIVE_STATUSES, placement__server=resources.server)
            .exclude(pk=run.pk)
            .values_list("pk", flat=True)
            .first()
        )
        if holder is not None:
            return Waiting(f"waiting for vLLM server {resources.server!r}: run {holder} is using it")
    _advisory_lock(f"grpo-host:{worker_host}")
    busy: set[str] = set()
    for held in Run.objects.filter(worker_host=worker_host, status__in=ACTIVE_STATUSES).values_list(
        "placement", flat=True
    ):
        busy.update(str(g) for g in (held or {}).get("gpus", []))
    try:
        plan = placement_plan(
            resources=resources,
            inventory=[str(g) for g in gpus],
            busy=busy,
            host=worker_host,
            worker=worker_name,
        )
    except Unplaceable as exc:
        pool = resources.pool or settings.GRPO_RUNS_QUEUE
        largest = worker_hosts.pool_max_gpus(pool=pool)
        if largest is not None and largest > len(gpus) and resources.gpus_on(gpu_host=True) <= largest:
            return Waiting(f"waiting for a larger worker of pool {pool!r}: {exc}")
        _fail_unclaimed(run_id=run.pk, reason=str(exc))
        return None
    return plan


def _run_wait(run_id: int, reason: str) -> None:
    """Record why the queued run waits (an event when the reason changes) and raise PlacementWait."""
    changed = (
        Run.objects.filter(pk=run_id, status=RunStatus.QUEUED)
        .exclude(waiting_reason=reason[:500])
        .update(waiting_reason=reason[:500])
    )
    if changed:
        _event(run_id, RunEventKind.INFO, reason)
    raise PlacementWait(reason)


def _advisory_lock(key: str) -> None:
    """A transaction-scoped Postgres lock on ``key`` (claims on one host, or one server, take turns)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [key])


def placement_text(placement: dict) -> str:
    """One line for people: ``host-a (worker gpu@host-a): vLLM on GPUs 0 (TP 1 × DP 1), trainer on GPUs 1,2 (2 processes)``."""
    where = f"{placement.get('host')} (worker {placement.get('worker')})"
    vllm = placement.get("vllm")
    if placement.get("server"):
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
    return f"{where}: {served}, trainer on {devices} ({n} process{'es' if n != 1 else ''})"


def _fail_unclaimed(*, run_id: int, reason: str) -> None:
    _transition(
        run_id=run_id,
        allowed_from=(RunStatus.QUEUED,),
        to=RunStatus.FAILED,
        message=reason,
        failure_reason=reason,
    )


def run_processes_record(*, run_id: int, vllm_pid: int | None = None, trainer_pid: int | None = None) -> None:
    """Record the process-group ids the supervisor started (for the UI and for tests)."""
    fields = {k: v for k, v in (("vllm_pid", vllm_pid), ("trainer_pid", trainer_pid)) if v is not None}
    if fields:
        Run.objects.filter(pk=run_id).update(**fields)


def run_placement_record(*, run_id: int, placement: dict, message: str = "") -> None:
    """Store what the supervisor adds to the run's placement (each child's environment, the trainer's
    ranks) and say so as an event when ``message`` is given."""
    Run.objects.filter(pk=run_id).update(placement=placement)
    if message:
        _event(run_id, RunEventKind.INFO, message)


def run_sources_record(*, run_id: int, sources: dict[str, dict]) -> None:
    """Record what the worker resolved the run's hub ids to (commit hashes), and say so as an event."""
    Run.objects.filter(pk=run_id).update(sources=sources)
    for key, source in sources.items():
        _event(
            run_id,
            RunEventKind.INFO,
            f"{key} {source['id']}@{source['revision']} is commit {source['commit']}",
        )


def run_mark_running(*, run_id: int, resumed_from: Checkpoint | None = None) -> bool:
    """``starting`` -> ``running`` once the trainer process is up."""
    return _transition(
        run_id=run_id,
        allowed_from=(RunStatus.STARTING,),
        to=RunStatus.RUNNING,
        message="running" + (f" (resumed from checkpoint-{resumed_from.step})" if resumed_from else ""),
        started_at=timezone.now(),
        resumed_from=resumed_from,
    )


def run_heartbeat(*, run_id: int) -> str | None:
    """Refresh the heartbeat; returns the run's status (how the supervisor learns of ``stopping``),
    or None when the run is no longer active (e.g. marked failed as stale)."""
    updated = Run.objects.filter(pk=run_id, status__in=ACTIVE_STATUSES).update(heartbeat_at=timezone.now())
    if not updated:
        return None
    return Run.objects.filter(pk=run_id).values_list("status", flat=True).first()


def run_finish(
    *,
    run_id: int,
    status: str,
    failure_reason: str = "",
    trainer_exit_code: int | None = None,
    vllm_exit_code: int | None = None,
) -> bool:
    """Record the end of an attempt: ``completed``, ``failed`` (with a reason) or ``stopped``."""
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"{status!r} is not a terminal status")
    if status == RunStatus.FAILED and not failure_reason:
        failure_reason = "failed (no reason recorded)"
    message = status + (f": {failure_reason}" if failure_reason else "")
    return _transition(
        run_id=run_id,
        allowed_from=ACTIVE_STATUSES,
        to=status,
        message=message,
        failure_reason=failure_reason if status == RunStatus.FAILED else "",
        trainer_exit_code=trainer_exit_code,
        vllm_exit_code=vllm_exit_code,
    )


def runs_fail_stale(*, now: datetime | None = None) -> list[int]:
    """Mark failed every live run whose supervisor stopped sending heartbeats (its worker vanished).

    Called periodically (Celery beat ``worker.runs_check_stale``) and before reads (API, pages).
    Returns the ids marked.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.GRPO_RUN_STALE_AFTER_S)
    marked = []
    stale = Run.objects.filter(status__in=ACTIVE_STATUSES, heartbeat_at__lt=cutoff)
    for run_id, host, beat in stale.values_list("pk", "worker_host", "heartbeat_at"):
        reason = (
            f"worker lost: no heartbeat from the supervisor on {host or '?'} since "
            f"{beat:%Y-%m-%d %H:%M:%S} UTC (more than {settings.GRPO_RUN_STALE_AFTER_S:.0f} s)"
        )
        if _transition(
            run_id=run_id,
            allowed_from=ACTIVE_STATUSES,
            to=RunStatus.FAILED,
            message=reason,
            failure_reason=reason,
            extra_filter={"heartbeat_at__lt": cutoff},
        ):
            marked.append(run_id)
    return marked


def run_event_create(*, run_id: int, kind: str, message: str) -> RunEvent:
    """Append an event (process start/exit, log tail, error) to the run's history."""
    return _event(run_id, kind, message)


def _transition(
    *,
    run_id: int,
    allowed_from: Sequence[str],
    to: str,
    message: str,
    extra_filter: Mapping[str, Any] | None = None,
    **fields: Any,
) -> bool:
    """Move a run to ``to`` if its status is in ``allowed_from``; event + publish on success."""
    if to in TERMINAL_STATUSES:
        fields.setdefault("finished_at", timezone.now())
    updated = Run.objects.filter(pk=run_id, status__in=allowed_from, **(extra_filter or {})).update(
        status=to, **fields
    )
    if not updated:
        return False
    _event(run_id, RunEventKind.STATUS, message)
    _publish_status(run_id, to, failure_reason=fields.get("failure_reason", ""))
    return True


def _event(run_id: int, kind: str, message: str) -> RunEvent:
    message = message.replace("\x00", "")  # Postgres text cannot hold NUL (log tails may)
    if len(message) > MAX_EVENT_CHARS:
        message = "...\n" + message[-MAX_EVENT_CHARS:]
    event = RunEvent.objects.create(run_id=run_id, kind=kind, message=message)
    published = {
        "type": "run.event",
        "id": event.id,
        "kind": event.kind,
        "message": event.message[-MAX_PUBLISHED_TEXT_CHARS:],
        "created_at": event.created_at.isoformat(),
    }
    transaction.on_commit(lambda: _publish(run_id, published))
    return event


def _publish_status(run_id: int, status: str, *, failure_reason: str = "") -> None:
    message = {"type": "run.status", "status": str(status)}
    if failure_reason:
        message["failure_reason"] = failure_reason
    transaction.on_commit(lambda: _publish(run_id, message))


def run_message_publish(*, run_id: int, message: dict) -> None:
    """Send ``message`` to the run's channel-layer group once the current transaction commits."""
    _publish(run_id, message)


def _publish(run_id: int, message: dict) -> None:
    """``group_send`` to ``run-<id>``; the channel layer is best effort (Postgres has the data)."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(f"run-{run_id}", message)
    except Exception:
        logger.warning("could not publish %s for run %s", message.get("type"), run_id, exc_info=True)


def _heartbeat_stale(beat: datetime | None) -> bool:
    return beat is None or beat < timezone.now() - timedelta(seconds=settings.GRPO_RUN_STALE_AFTER_S)


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


def _config_sha256(config: dict) -> str:
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _idempotent_replay(run: Run, digest: str) -> Run:
    if digest and run.config_sha256 != digest:
        raise IdempotencyKeyReused(
            f"Idempotency-Key already created run {run.pk} with a different config; use a new key"
        )
    return run


def _default_name(config: Any) -> str:
    if not isinstance(config, dict):
        return "run"
    return f"{config.get('model') or '?'} on {config.get('train_dataset') or config.get('environment_factory') or '?'}"
