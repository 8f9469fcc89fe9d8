"""The demo run ``make run`` starts (the tiny model on arithmetic), reused while it is live."""

from __future__ import annotations

import contextlib

from django.conf import settings
from django.contrib.auth import get_user_model

from controlplane.access.services import token_issue  # noqa: F401  (the runs API's callers issue tokens here)
from controlplane.runs.models import (
    ACTIVE_STATUSES,
    Run,
    RunStatus,
)
from controlplane.runs.services.lifecycle import RunStateError, run_create, run_resume


def demo_run_start() -> Run:
    """The demo run ``make run`` starts: the tiny model on arithmetic, ~200 steps, owner ``demo``.

    Reuses the demo user's run that is still queued or live, so restarting the stack does not pile
    up demo runs; with ``GRPO_RESUME_INTERRUPTED`` on, the demo run a Ctrl-C interrupted is resumed
    from its checkpoint instead (here rather than only by the worker's start, which may come later).
    """
    user, created = get_user_model().objects.get_or_create(username="demo")
    if created:
        user.set_password(settings.GRPO_DEMO_PASSWORD)
        user.save(update_fields=["password"])
    live = Run.objects.filter(owner=user, status__in=(RunStatus.QUEUED, *ACTIVE_STATUSES)).first()
    if live is not None:
        return live
    interrupted = Run.objects.filter(owner=user, status=RunStatus.INTERRUPTED).order_by("-pk").first()
    if interrupted is not None and settings.GRPO_RESUME_INTERRUPTED:
        with contextlib.suppress(RunStateError):  # the starting worker resumed it first
            run_resume(run=interrupted)
        interrupted.refresh_from_db()
        return interrupted
    run, _ = run_create(owner=user, name="demo: tiny model on arithmetic", config=demo_config())
    return run


def demo_config() -> dict:
    """The demo RUN.yaml document (registry names only, so it passes the web's validation).

    Defined with its task (:func:`trainer.tasks.demo.demo_run_document`), where
    ``bench/demo_learning.py`` measures the reward curve it gives; ``GRPO_DEMO_SERVER`` names a
    registered vLLM server for it to train on.
    """
    from trainer.tasks.demo import demo_run_document

    document = demo_run_document()
    if settings.GRPO_DEMO_SERVER:  # an operator's server instead of a per-run one
        document["resources"] = {**document.get("resources", {}), "server": settings.GRPO_DEMO_SERVER}
    return document
