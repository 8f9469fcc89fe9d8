"""Websocket routes (Channels). Run streams are added by the runs app."""

from __future__ import annotations

websocket_urlpatterns: list = []
