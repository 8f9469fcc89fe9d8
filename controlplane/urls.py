"""URL configuration: pages, REST API v1, OpenAPI schema and its rendered reference page."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from controlplane.access.views import RateLimitedLoginView, admin_login_view
from controlplane.core import views as core_views
from controlplane.core.api_reference import ApiReferenceView
from controlplane.runs.urls import api_patterns as runs_api_patterns
from controlplane.runs.urls import web_patterns as runs_web_patterns

urlpatterns = [
    path("", core_views.home, name="home"),
    path("healthz", core_views.healthz, name="healthz"),
    # Logins are rate-limited (GRPO_LOGIN_MAX_FAILURES per GRPO_LOGIN_WINDOW_S), the admin's too.
    path("admin/login/", admin_login_view),
    path("admin/", admin.site.urls),
    path("accounts/login/", RateLimitedLoginView.as_view()),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    # No password reset by mail: no mail backend is configured, and an open reset form is an
    # unthrottled mail cannon (operators reset passwords with `manage.py changepassword`).
    path("api/v1/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/v1/docs/", ApiReferenceView.as_view(), name="api-reference"),
    path("api/v1/", include((runs_api_patterns, "runs-api"))),
    path("runs/", include((runs_web_patterns, "runs"))),
]
