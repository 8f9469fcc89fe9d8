"""Websocket authentication by API token: ``/ws/runs/<id>/?token=<key>``.

Browsers authenticate with their session cookie (Channels' ``AuthMiddlewareStack``); scripts and CI
pass the same token the REST API takes. A token, when present, wins over the session.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlparse

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from channels.security.websocket import OriginValidator, WebsocketDenier


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
    """Refuses a websocket whose ``Origin`` is not this site's (cross-site socket hijacking).

    Browsers always send ``Origin`` on a websocket handshake; scripts and CI clients (aiohttp,
    ``websockets``) usually send none and authenticate with ``?token=``, which a foreign page cannot
    read. So a missing ``Origin`` is let through, and a present one must be:

    * one of ``CSRF_TRUSTED_ORIGINS`` (Django's list of trusted ``scheme://host[:port]`` origins:
      a deployment behind a TLS proxy, or a second front-end, names itself there), or
    * the handshake's own origin: the scheme of the socket (``ws`` for ``http``, ``wss`` for
      ``https``; ``SECURE_PROXY_SSL_HEADER`` read as Django reads it), and the host and port of its
      ``Host`` header, with the host one of ``ALLOWED_HOSTS``. Channels' own validator compared the
      host only, so ``http://127.0.0.1:9999`` or ``https://localhost`` opened a socket with the
      session cookie of a server on ``http://127.0.0.1:8130`` (issue 29 item 8). A handshake with
      no ``Host`` header (not HTTP/1.1: in-process test clients) is held to the host rule alone.
    """

    async def __call__(self, scope: dict, receive: Any, send: Any) -> Any:
        if scope["type"] != "websocket":
            raise ValueError("BrowserOriginValidator guards websocket connections only")
        headers = dict(scope.get("headers", []))
        origin = headers.get(b"origin")
        if origin is None or self.same_site(origin.decode("latin1"), headers.get(b"host"), scope):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)

    def same_site(self, origin: str, host: bytes | None, scope: dict) -> bool:
        from django.conf import settings

        parsed = urlparse(origin)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path or parsed.query:
            return False  # "null", a file:// page, garbage
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        normalized = f"{parsed.scheme}://{parsed.hostname}:{port}"
        trusted = {_normalized_origin(o) for o in getattr(settings, "CSRF_TRUSTED_ORIGINS", [])}
        if normalized in trusted:
            return True
        if not super().valid_origin(parsed):  # the host: one of ALLOWED_HOSTS
            return False
        if host is None:
            return True
        secure = scope.get("scheme") == "wss" or _proxy_says_https(scope, settings)
        own = urlparse(f"{'https' if secure else 'http'}://{host.decode('latin1')}")
        own_port = own.port or (443 if secure else 80)
        return (parsed.scheme, parsed.hostname, port) == (own.scheme, own.hostname, own_port)


def _normalized_origin(origin: str) -> str:
    parsed = urlparse(origin)
    return f"{parsed.scheme}://{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


def _proxy_says_https(scope: dict, settings: Any) -> bool:
    """``SECURE_PROXY_SSL_HEADER`` (e.g. ``("HTTP_X_FORWARDED_PROTO", "https")``) on the handshake."""
    configured = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if not configured:
        return False
    name, value = configured
    header = name.removeprefix("HTTP_").lower().replace("_", "-").encode("latin1")
    return dict(scope.get("headers", [])).get(header, b"").decode("latin1").split(",")[0].strip() == value


def browser_origin_validator(application: Any) -> BrowserOriginValidator:
    """:class:`BrowserOriginValidator` over ALLOWED_HOSTS (as Channels' AllowedHostsOriginValidator)."""
    from django.conf import settings

    hosts = settings.ALLOWED_HOSTS or (["localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    return BrowserOriginValidator(application, hosts)
