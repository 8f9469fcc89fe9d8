"""Thin views for the home page and the health probe."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render


def home(request: HttpRequest) -> HttpResponse:
    """Landing page: what this is and where to go (the runs list once the runs app is installed)."""
    return render(request, "core/home.html", {})


def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness + database reachability, for `make run` and container health checks."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok"})
