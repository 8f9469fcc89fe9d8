"""The Celery application (broker: Redis; settings: Django's ``CELERY_*``).

Start a worker with ``celery -A worker worker -Q default,gpu``; ``manage.py runstack`` does it for you.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import worker_init, worker_ready, worker_shutdown

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("worker")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["worker"])


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


@worker_shutdown.connect
def _retire(sender=None, **_: object) -> None:
    from worker.inventory import worker_retire

    if sender is not None:
        worker_retire(name=sender.hostname)
