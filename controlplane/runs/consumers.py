"""The run stream: websocket ``/ws/runs/<id>/`` (Channels).

On connect the socket sends the run's status (with the last logged step), then forwards what the
run's channel-layer group ``run-<id>`` receives, in arrival order:

    {"type": "status", "status": "running", "step": 12, ...}
    {"type": "metrics", "step": 13, "values": {"reward": 0.5, ...},   one message per logging step
     "time": 1767225600.5, "attempt": 1}                               (when logged, unix s; by which attempt;
                                                                       an eval line: an earlier step's eval/* names)
    {"type": "completions", "step": 13, "split": "train", "items": [...]}   one message per logged batch
                                                                       (split "eval": scored on eval_dataset)
    {"type": "event", "id": 7, "kind": "log", "message": "...", "created_at": "..."}
    {"type": "checkpoint", "step": 50, "path": ".../checkpoint-50", "created_at": "..."}   one per saved checkpoint

History is loaded over REST (``/api/v1/runs/<id>/metrics/`` etc.); the socket carries only what is new.
Producers batch: the supervisor's tailer (``worker/tailer.py``) reads the trainer's files every
~100 ms, and :func:`controlplane.runs.services.ingest.metric_steps_ingest` publishes one channel-layer message per read
carrying every metric of every step in it (never one per metric); this consumer forwards each step
as its own ``metrics`` message, in step order.

Authentication: the Django session (browser) or ``?token=<API token>`` (scripts, CI). An anonymous
socket is closed with code 4401, a run the user may not see with 4404 (after the handshake, so a
client can tell why).
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError

from controlplane.runs.services.stream import run_group

CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404
# A frame over GRPO_WS_MAX_FRAME_BYTES: daphne, started with that limit (controlplane/core/web_server.py),
# closes with 1009 itself; this application-range code (HTTP 413 + 4000) is the consumer's own check,
# for a server started without it (an application may not send 1009: autobahn refuses it).
CLOSE_TOO_BIG = 4413
# The channel layer's pool is full: HTTP 503 + 4000, the page reconnects. Not 1013 (try again later):
# autobahn lets an application send only 1000 and 3000-4999 ("invalid close code", and the socket ends 1011).
CLOSE_TRY_AGAIN_LATER = 4503


@database_sync_to_async
def _status_snapshot(user: Any, run_id: int) -> dict[str, Any] | None:
    from controlplane.runs import selectors

    run = selectors.run_list(user=user).filter(pk=run_id).first()
    return None if run is None else selectors.run_status_snapshot(run=run)


class RunStreamConsumer(AsyncJsonWebsocketConsumer):
    """Forwards one run's group messages to one browser or script."""

    group: str | None = None

    async def connect(self) -> None:
        await self.accept()
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        # Join before reading the status: a change between the two then arrives twice, never zero times.
        try:
            await self.channel_layer.group_add(run_group(run_id), self.channel_name)
        except RedisConnectionError:  # the pool is full (GRPO_CHANNEL_MAX_CONNECTIONS) or Redis is down
            await self.close(code=CLOSE_TRY_AGAIN_LATER)
            return
        self.group = run_group(run_id)
        snapshot = await _status_snapshot(user, run_id)
        if snapshot is None:
            await self.channel_layer.group_discard(self.group, self.channel_name)
            self.group = None
            await self.close(code=CLOSE_NOT_FOUND)
            return
        await self.send_json({"type": "status", **snapshot})

    async def disconnect(self, code: int) -> None:
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        """Frames that are not JSON text (binary, garbage, nesting too deep) are ignored, not fatal; a
        frame over ``GRPO_WS_MAX_FRAME_BYTES`` closes the socket: with 1009 from daphne's protocol layer,
        else with 4413 here (:data:`CLOSE_TOO_BIG`)."""
        size = (
            len(text_data.encode("utf-8", "surrogatepass"))
            if text_data is not None
            else len(bytes_data or b"")
        )
        if size > settings.GRPO_WS_MAX_FRAME_BYTES:
            await self.close(code=CLOSE_TOO_BIG)
            return
        if text_data is None:
            return
        try:
            content = await self.decode_json(text_data)
        except (ValueError, RecursionError):
            return
        await self.receive_json(content, **kwargs)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The stream is one-way; a client's ``{"type": "ping"}`` gets a pong (keep-alive through proxies)."""
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    # Group message handlers: "run.metrics" -> run_metrics, etc. The "run." prefix is dropped.
    async def run_metrics(self, message: dict[str, Any]) -> None:
        await self.send_json(_metrics_message(message))

    async def run_metrics_batch(self, message: dict[str, Any]) -> None:
        """Several steps published together (a fast run); the socket still carries one per step."""
        for item in message["steps"]:
            await self.send_json(_metrics_message(item))

    async def run_completions(self, message: dict[str, Any]) -> None:
        await self.send_json(
            {
                "type": "completions",
                "step": message["step"],
                # train, or eval (scored on eval_dataset with the step's weights); absent: train
                "split": message.get("split", "train"),
                "items": message["items"],
            }
        )

    async def run_status(self, message: dict[str, Any]) -> None:
        await self.send_json({**message, "type": "status"})

    async def run_event(self, message: dict[str, Any]) -> None:
        await self.send_json({**message, "type": "event"})

    async def run_checkpoint(self, message: dict[str, Any]) -> None:
        await self.send_json(
            {
                "type": "checkpoint",
                "step": message["step"],
                "path": message["path"],
                "created_at": message.get("created_at"),
            }
        )


class NotFoundConsumer(AsyncJsonWebsocketConsumer):
    """Any websocket path that is not a run stream: accepted, then closed with 4404."""

    async def connect(self) -> None:
        await self.accept()
        await self.close(code=CLOSE_NOT_FOUND)


def _metrics_message(item: dict[str, Any]) -> dict[str, Any]:
    """One step's ``metrics`` message; ``time`` / ``attempt`` are null from a publisher that has
    none (a message published before they existed, during a rolling upgrade)."""
    return {
        "type": "metrics",
        "step": item["step"],
        "values": item["values"],
        "time": item.get("time"),
        "attempt": item.get("attempt"),
    }
