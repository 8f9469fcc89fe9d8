"""ASGI entry point: HTTP through Django (static files included), websockets through Channels."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from controlplane.routing import websocket_urlpatterns  # noqa: E402
from controlplane.runs.ws_auth import QueryTokenAuthMiddleware, browser_origin_validator  # noqa: E402

# One box serves its own static files (the vendored chart library, the dashboard script); a deployment
# behind a CDN or nginx sets GRPO_SERVE_STATIC=false and serves STATIC_ROOT (collectstatic) there.
http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.GRPO_SERVE_STATIC else django_asgi_app

application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": browser_origin_validator(
            AuthMiddlewareStack(QueryTokenAuthMiddleware(URLRouter(websocket_urlpatterns)))
        ),
    }
)
