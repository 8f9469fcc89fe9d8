"""The Celery application the control plane and the workers share (broker: Redis; settings: Django's
``CELERY_*``).

The web only sends tasks by name (``services.SUPERVISE_TASK``): it needs this configured app, not the
worker's task code. The worker (:mod:`worker.celery`) takes the same app and registers its tasks on it.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("worker")
app.config_from_object("django.conf:settings", namespace="CELERY")
