"""The login page, rate-limited: after ``GRPO_LOGIN_MAX_FAILURES`` failed attempts for one username
from one address (or five times as many from one address) within ``GRPO_LOGIN_WINDOW_S`` seconds,
further attempts get 429 until the window passes."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse

from controlplane.access import services


def client_ip(request: HttpRequest) -> str:
    return request.META.get("REMOTE_ADDR") or "unknown"


class RateLimitedLoginView(auth_views.LoginView):
    template_name = "runs/login.html"

    def post(self, request: HttpRequest, *args, **kwargs) -> HttpResponse:
        username = str(request.POST.get("username", ""))[:150]
        ip = client_ip(request)
        wait_s = services.login_blocked_for(username=username, ip=ip)
        if wait_s:
            # The password is not even checked: a blocked guess costs the attacker nothing but time.
            message = f"Too many failed logins; try again in {wait_s // 60 or 1} minute(s)."
            form = self.get_form_class()(request)
            response = self.render_to_response(
                self.get_context_data(form=form, blocked_message=message), status=429
            )
            response["Retry-After"] = str(wait_s)
            return response
        response = super().post(request, *args, **kwargs)
        if response.status_code == 302:
            services.login_success_record(username=username, ip=ip)
        else:
            services.login_failure_record(username=username, ip=ip)
        return response


def admin_login_view(request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
    """``/admin/login/`` under the same limit as the run pages' login (the admin's own view, wrapped):
    a superuser's password is the most valuable one to guess."""
    from django.contrib import admin

    if request.method != "POST":
        return admin.site.login(request, extra_context)
    username = str(request.POST.get("username", ""))[:150]
    ip = client_ip(request)
    wait_s = services.login_blocked_for(username=username, ip=ip)
    if wait_s:
        response = HttpResponse(
            f"Too many failed logins; try again in {wait_s // 60 or 1} minute(s).\n",
            status=429,
            content_type="text/plain",
        )
        response["Retry-After"] = str(wait_s)
        return response
    response = admin.site.login(request, extra_context)
    if response.status_code == 302:
        services.login_success_record(username=username, ip=ip)
    else:
        services.login_failure_record(username=username, ip=ip)
    return response
