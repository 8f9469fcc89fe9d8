"""What every page response gets: the Content-Security-Policy header, and our own 404 page."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string


class ContentSecurityPolicyMiddleware:
    """Adds ``Content-Security-Policy: GRPO_CONTENT_SECURITY_POLICY`` (empty: no header).

    The default allows scripts only from this origin (the dashboard has no inline script; uPlot is
    vendored), styles from this origin plus inline ``<style>`` blocks and attributes, and connections
    (REST and the run websocket) to this origin only."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        policy = settings.GRPO_CONTENT_SECURITY_POLICY
        if policy and "Content-Security-Policy" not in response:
            response["Content-Security-Policy"] = policy
        return response


# Paths whose 404s are for programs, not people: they keep their JSON (or plain) bodies.
MACHINE_PATH_PREFIXES = ("/api/", "/ws/", "/static/", "/healthz")


class NotFoundPageMiddleware:
    """A 404 for a page gets ``templates/404.html``, in development too.

    Django shows its debug page (the URL patterns, the settings module) for a 404 when ``DEBUG`` is
    on, and ``404.html`` only when it is off. A person following a stale link should see the same
    page either way, and the debug page tells a stranger how the site is routed. API, websocket and
    static paths keep their own 404 bodies."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if response.status_code != 404 or request.path.startswith(MACHINE_PATH_PREFIXES):
            return response
        if not response.get("Content-Type", "").startswith("text/html"):
            return response
        body = render_to_string("404.html", {"request_path": request.path}, request=request)
        return HttpResponse(body, status=404, content_type="text/html; charset=utf-8")
