"""The worker's side of the Celery application (:mod:`controlplane.celery`): its tasks
(:mod:`worker.celery_tasks`) and its start-up and shutdown signals.

Start a worker with ``celery -A worker worker -Q default,gpu``; ``manage.py runstack`` does it for you.
"""

from __future__ import annotations

from celery.signals import worker_init, worker_ready, worker_shutdown

from controlplane.celery import app

app.autodiscover_tasks(["worker"], related_name="celery_tasks")


@worker_init.connect
def _check_services(**_: object) -> None:
    """Refuse to start, with one line, when Postgres or Redis is unreachable."""
    import django

    django.setup()
    from controlplane.preflight import require_services

    require_services()


@worker_ready.connect
def _announce(sender=None, **_: object) -> None:
    """Tell the control plane this worker's pools (queues) and GPUs (worker/inventory.py)."""
    from worker.inventory import worker_announce

    queues = sorted(sender.app.amqp.queues.consume_from or {}) if sender is not None else []
    worker_announce(name=sender.hostname, queues=queues)
    _resume_interrupted(queues)


def _resume_interrupted(queues: list[str]) -> None:
    """Resume the runs a shutdown of this host's worker interrupted (``GRPO_RESUME_INTERRUPTED``)."""
    import logging

    from django.conf import settings

    from controlplane.runs.services import runs_resume_interrupted

    if not settings.GRPO_RESUME_INTERRUPTED:
        return
    resumed = runs_resume_interrupted(worker_host=settings.GRPO_WORKER_HOST, queues=queues)
    if resumed:
        logging.getLogger(__name__).info("resumed interrupted runs %s", resumed)


@worker_shutdown.connect
def _retire(sender=None, **_: object) -> None:
    from worker.inventory import worker_retire

    if sender is not None:
        worker_retire(name=sender.hostname)
