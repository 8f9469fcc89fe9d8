"""Websocket routes (Channels)."""

from __future__ import annotations

from django.urls import path, re_path

from controlplane.runs.consumers import NotFoundConsumer, RunStreamConsumer

websocket_urlpatterns = [
    path("ws/runs/<int:run_id>/", RunStreamConsumer.as_asgi()),
    # Anything else under /ws/ (a run id that is not a number, a typo) is closed with 4404 rather than
    # raising in the router.
    re_path(r"^ws/", NotFoundConsumer.as_asgi()),
]
