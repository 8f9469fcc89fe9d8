"""URL configuration: pages, REST API v1, OpenAPI schema."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from controlplane.access.views import RateLimitedLoginView
from controlplane.core import views as core_views
from controlplane.runs.urls import api_patterns as runs_api_patterns
from controlplane.runs.urls import web_patterns as runs_web_patterns

urlpatterns = [
    path("", core_views.home, name="home"),
    path("healthz", core_views.healthz, name="healthz"),
    path("admin/", admin.site.urls),
    # The one login view is the rate-limited one (django.contrib.auth.urls would add a second).
    path("accounts/login/", RateLimitedLoginView.as_view()),
    path("accounts/", include("django.contrib.auth.urls")),
    path("api/v1/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/v1/", include((runs_api_patterns, "runs-api"))),
    path("runs/", include((runs_web_patterns, "runs"))),
]
