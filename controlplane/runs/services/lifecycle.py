"""A run's life cycle: created and validated once, launched (enqueued by task name), stopped,
resumed; what its supervisor records (processes, placement, sources, running, heartbeat, finish);
failed when its heartbeat goes stale; its events.

Status changes are conditional ``UPDATE ... WHERE status IN (...)`` statements
(:func:`run_status_transition`), so the API, the supervisor and the staleness check can race without
corrupting the life cycle (see models.py); each successful change records a :class:`RunEvent` and is
published to the run's stream (:mod:`.stream`) after the transaction commits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.access.services import token_issue  # noqa: F401  (the runs API's callers issue tokens here)
from controlplane.runs.launch_checks import run_launch_errors
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
from controlplane.runs.services.stream import (
    MAX_PUBLISHED_TEXT_CHARS,
    run_message_publish_on_commit,
    run_status_publish,
)
from controlplane.runs.validation import run_document_validate
from trainer.config.run_config import RunConfigError

logger = logging.getLogger(__name__)

SUPERVISE_TASK = "worker.run_supervise"


MAX_EVENT_CHARS = 20_000


class RunStateError(Exception):
    """The run's current status does not allow the action (the API answers 409)."""


class IdempotencyKeyReused(RunStateError):
    """An ``Idempotency-Key`` already created a run with a different document."""


class QueuedRunsLimit(RunStateError):
    """The owner already has ``GRPO_MAX_QUEUED_RUNS_PER_USER`` runs waiting (the API answers 429)."""


class RunCreateRateLimit(RunStateError):
    """The owner created ``GRPO_RUN_CREATE_RATE`` runs within its window (the API answers 429)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


_RATE_PERIODS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def create_rate() -> tuple[int, int]:
    """``GRPO_RUN_CREATE_RATE`` (DRF's syntax, ``"30/min"``) as (runs, window in seconds)."""
    count, _, period = settings.GRPO_RUN_CREATE_RATE.partition("/")
    return int(count), _RATE_PERIODS_S[period.strip()[:1]]


def run_create(
    *, owner: Any, config: dict, name: str = "", idempotency_key: str = "", launch: bool = True
) -> tuple[Run, bool]:
    """Validate ``config`` (a RUN.yaml document), store it as a queued run and launch it.

    The one place the web validates a document (:func:`run_config_validate`; the API's serializer
    and the form only parse it and place these errors beside their fields). Returns ``(run,
    created)``; with an ``idempotency_key`` already used by ``owner`` the existing run comes back
    with ``created=False`` (a retried POST never makes a second run). Raises
    :class:`~trainer.config.run_config.RunConfigError` (field path -> message) for an invalid document.
    """
    key = idempotency_key.strip()[:255]
    existing = Run.objects.filter(owner=owner, idempotency_key=key).first() if key else None
    # The document's own rules first (no transformers import; a document of aliases expanding past
    # the size limit is refused here, before anything reads it whole: the digest).
    document = run_document_validate(document=config, owner=owner)
    if existing is None:
        # Refused before the launch checks (a tokenizer load, a dataset read, a server query: about
        # a second each, one at a time per process) when the limits are already reached; the check
        # under the owner's lock below is the one that holds for parallel requests. A retried POST
        # (its key already used) is answered with its run, as always.
        _creation_limits_check(owner, locked=False)
    _launch_checks_pass(document)
    digest = _config_sha256(config) if isinstance(config, dict) else ""
    if existing is not None:
        return _idempotent_replay(existing, digest), False
    try:
        with transaction.atomic():
            _creation_limits_check(owner, locked=True)
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


def _creation_limits_check(owner: Any, *, locked: bool) -> None:
    """The per-user limits of creation: no more than ``GRPO_MAX_QUEUED_RUNS_PER_USER`` queued runs,
    no more than ``GRPO_RUN_CREATE_RATE`` created in its window. ``locked``: under a lock on the
    owner's row (inside the caller's transaction), so that they hold for any number of parallel
    requests (a read-then-write without the lock let 40 of 40 parallel creations through a 30/min
    limit, issue 29 item 1); unlocked, an early refusal that spares the launch checks."""
    if locked:
        get_user_model().objects.select_for_update().filter(pk=owner.pk).first()
    queued = Run.objects.filter(owner=owner, status=RunStatus.QUEUED).count()
    if queued >= settings.GRPO_MAX_QUEUED_RUNS_PER_USER:
        raise QueuedRunsLimit(
            f"you have {queued} queued runs (GRPO_MAX_QUEUED_RUNS_PER_USER = "
            f"{settings.GRPO_MAX_QUEUED_RUNS_PER_USER}); stop some or wait for them to start"
        )
    limit, window_s = create_rate()
    since = timezone.now() - timedelta(seconds=window_s)
    recent = list(
        Run.objects.filter(owner=owner, created_at__gte=since)
        .order_by("created_at")[:limit]
        .values_list("created_at", flat=True)
    )
    if len(recent) >= limit:
        retry_after = max(1, int((recent[0] - since).total_seconds()) + 1)
        raise RunCreateRateLimit(
            f"you created {limit} runs in the last {window_s} s (GRPO_RUN_CREATE_RATE = "
            f"{settings.GRPO_RUN_CREATE_RATE}); try again in {retry_after} s",
            retry_after,
        )


def run_config_validate(*, config: Any, owner: Any = None) -> dict:
    """Check an untrusted RUN.yaml document against the run schema and the control plane's rules
    (:func:`~controlplane.runs.validation.run_document_validate`, no transformers import), then, once
    those pass, make the checks its launch would make on the model and the vLLM server it will use
    (:func:`~controlplane.runs.launch_checks.run_launch_errors`: the trainer's config, the context
    length, the token budget, the dataset, the named server); return it.

    Raises :class:`~trainer.config.run_config.RunConfigError` with every problem, ``{field path: message}``.
    :func:`run_create` calls it; the run form calls it alone when some of its own fields did not
    clean (nothing is created then), so that every error shows at once. ``owner``, the user who
    creates the run, may name a checkpoint of their own runs as the model.
    """
    document = run_document_validate(document=config, owner=owner)
    _launch_checks_pass(document)
    return document


def _launch_checks_pass(document: dict) -> None:
    """Raise :class:`~trainer.config.run_config.RunConfigError` with what the launch checks find wrong in a
    document that passed its own rules."""
    errors = run_launch_errors(document=document)
    if errors:
        raise RunConfigError(errors)


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
    from controlplane.celery import app

    try:
        app.send_task(SUPERVISE_TASK, args=[run_id], task_id=task_id, queue=queue)
    except Exception as exc:  # the broker is down: say so on the run instead of leaving it queued
        logger.exception("could not enqueue run %s", run_id)
        run_status_transition(
            run_id=run_id,
            allowed_from=(RunStatus.QUEUED,),
            to=RunStatus.FAILED,
            message=f"could not enqueue the run on queue {queue!r}: {exc}",
            failure_reason=f"could not enqueue the run on queue {queue!r}: {exc}",
        )
    else:
        _event(run_id, RunEventKind.INFO, f"enqueued on {queue!r} (task {task_id})")


def run_stop(*, run: Run) -> Run:
    """Ask a run to stop. Cooperative: the supervisor sees ``stopping``, ends both processes
    (SIGTERM, then SIGKILL after ``GRPO_STOP_GRACE_S``) and records ``stopped``.

    A queued run (no supervisor yet) and a run whose supervisor is gone (stale heartbeat) are marked
    ``stopped`` at once. Raises :class:`RunStateError` for a finished run.
    """
    if run.status in TERMINAL_STATUSES:
        raise RunStateError(f"run {run.pk} is already {run.status}")
    if run.status == RunStatus.QUEUED:
        run_status_transition(
            run_id=run.pk,
            allowed_from=(RunStatus.QUEUED,),
            to=RunStatus.STOPPED,
            message="stopped before a worker picked it up",
        )
    elif _heartbeat_stale(run.heartbeat_at):
        run_status_transition(
            run_id=run.pk,
            allowed_from=ACTIVE_STATUSES,
            to=RunStatus.STOPPED,
            message=f"stopped; no live supervisor (last heartbeat {run.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC)",
        )
    else:
        run_status_transition(
            run_id=run.pk,
            allowed_from=(RunStatus.STARTING, RunStatus.RUNNING),
            to=RunStatus.STOPPING,
            message="stop requested",
        )
    run.refresh_from_db()
    return run


def run_resume(*, run: Run) -> Run:
    """Start a new attempt of a failed, stopped or interrupted run; the supervisor resumes from the
    latest checkpoint in the run's output directory (or starts over when there is none)."""
    if run.status not in RESUMABLE_STATUSES:
        raise RunStateError(f"run {run.pk} is {run.status}; {_RESUMABLE_TEXT}")
    with transaction.atomic():
        changed = run_status_transition(
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
            raise RunStateError(f"run {run.pk} is {run.status}; {_RESUMABLE_TEXT}")
        run.refresh_from_db()
        run_launch(run=run)
    return run


_RESUMABLE_TEXT = "only failed, stopped or interrupted runs can be resumed"


def runs_resume_interrupted(*, worker_host: str, queues: list[str]) -> list[int]:
    """Resume the runs that a shutdown of a worker on ``worker_host`` interrupted and whose pool is
    one of ``queues`` (a worker consuming them has just started); returns their ids.

    Called at a worker's start when ``GRPO_RESUME_INTERRUPTED`` is on, so that ``make run`` after a
    Ctrl-C continues its demo run from the checkpoint the shutdown saved. Each resume is its own
    transaction; a run another worker resumed first is left to it.
    """
    resumed = []
    candidates = Run.objects.filter(status=RunStatus.INTERRUPTED, worker_host=worker_host).order_by("pk")
    for run in candidates:
        if run_queue(run=run) not in queues:
            continue
        try:
            run_resume(run=run)
        except RunStateError:
            continue
        _event(run.pk, RunEventKind.INFO, f"resumed automatically: a worker on {worker_host} started")
        resumed.append(run.pk)
    return resumed


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
    return run_status_transition(
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
    """Record the end of an attempt: ``completed``, ``failed`` (with a reason), ``stopped`` or
    ``interrupted`` (its reason goes in the event only: ``failure_reason`` is for failures)."""
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"{status!r} is not a terminal status")
    if status == RunStatus.FAILED and not failure_reason:
        failure_reason = "failed (no reason recorded)"
    message = status + (f": {failure_reason}" if failure_reason else "")
    return run_status_transition(
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
        if run_status_transition(
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


def run_status_transition(
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
    run_status_publish(run_id=run_id, status=to, failure_reason=fields.get("failure_reason", ""))
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
    run_message_publish_on_commit(run_id=run_id, message=published)
    return event


def _heartbeat_stale(beat: datetime | None) -> bool:
    return beat is None or beat < timezone.now() - timedelta(seconds=settings.GRPO_RUN_STALE_AFTER_S)


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
