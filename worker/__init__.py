"""Celery worker: launches and supervises vLLM servers and trainer processes for runs."""

from worker.celery import app as celery_app

__all__ = ["celery_app"]
