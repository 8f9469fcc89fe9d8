"""The run's live stream: the channel-layer group every message of one run goes to (``run-<id>``,
joined by :class:`controlplane.runs.consumers.RunConsumer`), and the messages the services publish.

The channel layer is best effort: Postgres holds everything, and a page that reconnects backfills
from the API. Publishing never raises.
"""

from __future__ import annotations

import logging

from django.db import transaction

logger = logging.getLogger(__name__)

MAX_PUBLISHED_TEXT_CHARS = 8_000


def run_group(run_id: int) -> str:
    """The channel-layer group of run ``run_id``'s stream."""
    return f"run-{run_id}"


def run_message_publish(*, run_id: int, message: dict) -> None:
    """Send ``message`` to the run's group now (callers publish after their transaction commits)."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(run_group(run_id), message)
    except Exception:
        logger.warning("could not publish %s for run %s", message.get("type"), run_id, exc_info=True)


def run_message_publish_on_commit(*, run_id: int, message: dict) -> None:
    """Send ``message`` to the run's group once the current transaction commits (now, outside one)."""
    transaction.on_commit(lambda: run_message_publish(run_id=run_id, message=message))


def run_status_publish(*, run_id: int, status: str, failure_reason: str = "") -> None:
    """Publish ``{"type": "run.status", "status", ["failure_reason"]}`` once the transaction commits."""
    message = {"type": "run.status", "status": str(status)}
    if failure_reason:
        message["failure_reason"] = failure_reason
    run_message_publish_on_commit(run_id=run_id, message=message)
