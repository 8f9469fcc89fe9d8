"""Celery worker: launches and supervises vLLM servers and trainer processes for runs.

The Celery app lives in :mod:`worker.celery` (``celery -A worker`` finds it there) and is not
imported here: ``python -m worker.guard``, the parent of every run process, must load neither Celery
nor Django's settings, or it would hand ``DJANGO_SETTINGS_MODULE`` on to the trainer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["celery_app"]


def __getattr__(name: str) -> Any:
    if name == "celery_app":
        from worker.celery import app

        return app
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
