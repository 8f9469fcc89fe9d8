"""Websocket routes (Channels)."""

from __future__ import annotations

from django.urls import path

from controlplane.runs.consumers import RunStreamConsumer

websocket_urlpatterns = [
    path("ws/runs/<int:run_id>/", RunStreamConsumer.as_asgi()),
]
