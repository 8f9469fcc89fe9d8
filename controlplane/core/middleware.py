"""Response headers every page gets."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse


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
