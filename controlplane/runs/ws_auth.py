"""Websocket authentication by API token: ``/ws/runs/<id>/?token=<key>``.

Browsers authenticate with their session cookie (Channels' ``AuthMiddlewareStack``); scripts and CI
pass the same token the REST API takes. A token, when present, wins over the session.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from channels.security.websocket import OriginValidator


@database_sync_to_async
def _user_for_token(key: str) -> Any:
    from django.contrib.auth.models import AnonymousUser

    from controlplane.access.services import token_user

    return token_user(key=key) or AnonymousUser()


class QueryTokenAuthMiddleware(BaseMiddleware):
    """Sets ``scope["user"]`` from ``?token=``; an unknown token gives an anonymous user."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> Any:
        params = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        keys = params.get("token")
        if keys:
            scope = dict(scope, user=await _user_for_token(keys[0]))
        return await super().__call__(scope, receive, send)


class BrowserOriginValidator(OriginValidator):
    """Refuses a websocket whose ``Origin`` is not one of ALLOWED_HOSTS (cross-site socket hijacking).

    Browsers always send ``Origin`` on a websocket handshake; scripts and CI clients (aiohttp,
    ``websockets``) usually send none and authenticate with ``?token=``, which a foreign page cannot
    read. So a missing ``Origin`` is let through, and a present one must match.
    """

    def valid_origin(self, parsed_origin: Any) -> bool:
        return parsed_origin is None or super().valid_origin(parsed_origin)


def browser_origin_validator(application: Any) -> BrowserOriginValidator:
    """:class:`BrowserOriginValidator` over ALLOWED_HOSTS (as Channels' AllowedHostsOriginValidator)."""
    from django.conf import settings

    hosts = settings.ALLOWED_HOSTS or (["localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    return BrowserOriginValidator(application, hosts)
