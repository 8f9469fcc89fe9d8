"""Production settings: ``DJANGO_SETTINGS_MODULE=controlplane.settings_production``.

Everything of :mod:`controlplane.settings`, hardened: DEBUG off, a real SECRET_KEY required, cookies
secure and HTTP-only where they can be, HSTS, HTTPS redirect (``SECURE_SSL_REDIRECT=false`` where a
proxy already redirects), the proxy's ``X-Forwarded-Proto`` trusted, ``ALLOWED_HOSTS='*'`` refused,
JSON-only API, the OpenAPI schema for logged-in users (``GRPO_PUBLIC_SCHEMA=true`` reopens it). ``manage.py check --deploy``
is clean with these (tests/test_access.py runs it).
"""

from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured

from controlplane.settings import *  # noqa: F403
from controlplane.settings import ALLOWED_HOSTS, REST_FRAMEWORK, SPECTACULAR_SETTINGS, env_bool

DEBUG = False
SECRET_KEY = os.environ.get("SECRET_KEY", "")
if len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5 or SECRET_KEY.startswith("django-insecure"):
    raise ImproperlyConfigured(
        "SECRET_KEY: set a random value of at least 50 characters, e.g. "
        "python -c 'import secrets; print(secrets.token_urlsafe(64))'"
    )

SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", str(365 * 24 * 3600)))
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SESSION_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_SECURE = True
X_FRAME_OPTIONS = "DENY"

# '*' would also make the websocket Origin check (controlplane/runs/ws_auth.py) accept any origin.
if "*" in ALLOWED_HOSTS:
    raise ImproperlyConfigured(
        "ALLOWED_HOSTS: '*' is refused in production (it also opens the websocket Origin check); "
        "list the host names the site is served under"
    )

# The API speaks JSON only (no browsable HTML API), and its schema is for logged-in users unless
# GRPO_PUBLIC_SCHEMA=true.
REST_FRAMEWORK = {**REST_FRAMEWORK, "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"]}
if not env_bool("GRPO_PUBLIC_SCHEMA", False):
    SPECTACULAR_SETTINGS = {
        **SPECTACULAR_SETTINGS,
        "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    }
