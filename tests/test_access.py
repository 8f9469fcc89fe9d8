"""Access control: hashed and revocable API tokens, authentication on every write, ownership, CSRF,
the rate-limited login, and the production settings (``check --deploy``). Real Postgres and Redis."""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import subprocess
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient
from rest_framework.views import APIView

from controlplane.access import services as access
from controlplane.access.models import ApiToken
from controlplane.runs.models import Run
from tests.conftest import PYTHON, REPO

pytestmark = pytest.mark.django_db

CONFIG = {
    "model": "tiny",
    "train_dataset": "arithmetic-small",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {"max_steps": 4},
}


def make_user(name: str, password: str | None = None):
    return get_user_model().objects.create_user(username=name, password=password)


def make_run(owner) -> Run:
    return Run.objects.create(owner=owner, name="r", config=CONFIG, config_sha256="0" * 64)


def token_client(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + key)
    return client


def issue(*args: str) -> str:
    out = io.StringIO()
    call_command("issue_token", *args, stdout=out)
    return out.getvalue().strip()


def test_tokens_are_stored_hashed_and_shown_once():
    key = issue("ci-bot", "--name", "github")
    token = ApiToken.objects.get(user__username="ci-bot")
    assert token.key_sha256 == hashlib.sha256(key.encode()).hexdigest()
    assert token.prefix == key[:8] and token.name == "github"
    with connection.cursor() as cursor:  # the key is nowhere in the table
        cursor.execute(
            "SELECT count(*) FROM access_apitoken WHERE key_sha256 = %s OR prefix = %s", [key, key]
        )
        assert cursor.fetchone()[0] == 0
    assert token_client(key).get("/api/v1/runs/").status_code == 200
    token.refresh_from_db()
    assert token.last_used_at is not None


def test_tokens_are_revocable_one_by_one_or_by_rotation():
    first = issue("ci-bot")
    second = issue("ci-bot")  # a second token does not end the first
    assert token_client(first).get("/api/v1/runs/").status_code == 200
    out = io.StringIO()
    call_command("revoke_token", "ci-bot", "--prefix", first[:8], stdout=out)
    assert "revoked 1 token" in out.getvalue()
    assert token_client(first).get("/api/v1/runs/").status_code == 401
    assert token_client(second).get("/api/v1/runs/").status_code == 200
    third = issue("ci-bot", "--revoke-others")
    assert token_client(second).get("/api/v1/runs/").status_code == 401
    assert token_client(third).get("/api/v1/runs/").status_code == 200
    get_user_model().objects.filter(username="ci-bot").update(is_active=False)
    assert token_client(third).get("/api/v1/runs/").status_code == 401  # inactive users are out too


def test_malformed_token_headers_are_401_not_500():
    for header in ("Token", "Token a b", "Token " + "x" * 5000, "Token \u00e9\u00e9"):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=header)
        assert client.get("/api/v1/runs/").status_code == 401, header


def _api_views() -> list[tuple[str, type[APIView]]]:
    """Every DRF view under /api/v1/ with its route."""
    found = []

    def walk(patterns, prefix=""):
        for p in patterns:
            if isinstance(p, URLResolver):
                walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern):
                view = getattr(p.callback, "view_class", None) or getattr(p.callback, "cls", None)
                if (
                    view is not None
                    and issubclass(view, APIView)
                    and (prefix + str(p.pattern)).startswith("api/v1")
                ):
                    found.append((prefix + str(p.pattern), view))

    walk(get_resolver().url_patterns)
    return found


def test_every_api_endpoint_refuses_anonymous_callers():
    alice = make_user("alice")
    run = make_run(alice)
    views = _api_views()
    assert len(views) >= 9
    anonymous = APIClient()
    checked = 0
    for route, view in views:
        if "schema" in route or route == "api/v1/docs/":
            continue  # the schema and its rendered page follow SERVE_PERMISSIONS (production probe below)
        url = "/" + route.replace("<int:run_id>", str(run.pk)).replace("<int:step>", "1")
        url = url.replace("<str:name>", "arithmetic")
        assert "<" not in url, f"{route}: a placeholder this test does not fill"
        for method in ("get", "post", "put", "patch", "delete"):
            if hasattr(view, method):
                response = getattr(anonymous, method)(url, {}, format="json")
                assert response.status_code in (401, 403), (method, url, response.status_code)
                checked += 1
    assert checked >= 10
    assert Run.objects.count() == 1


def test_users_act_only_on_their_own_runs():
    alice, bob = make_user("alice"), make_user("bob")
    run = make_run(alice)
    bob_api = token_client(access.token_issue(username="bob"))
    for url in (f"/api/v1/runs/{run.pk}/stop/", f"/api/v1/runs/{run.pk}/resume/"):
        assert bob_api.post(url).status_code == 404
    for url in (
        f"/api/v1/runs/{run.pk}/",
        f"/api/v1/runs/{run.pk}/metrics/",
        f"/api/v1/runs/{run.pk}/diagnosis/",
    ):
        assert bob_api.get(url).status_code == 404
    web = Client()
    web.force_login(bob)
    assert web.post(f"/runs/{run.pk}/stop/").status_code == 404
    assert web.get(f"/runs/{run.pk}/").status_code == 404
    run.refresh_from_db()
    assert run.status == "queued"


def test_forms_and_session_api_calls_need_csrf():
    alice = make_user("alice")
    run = make_run(alice)
    web = Client(enforce_csrf_checks=True)
    web.force_login(alice)
    assert web.post("/runs/new/", {"model": "tiny"}).status_code == 403
    assert web.post(f"/runs/{run.pk}/stop/").status_code == 403
    session_api = APIClient(enforce_csrf_checks=True)
    session_api.force_login(alice)
    assert session_api.post(f"/api/v1/runs/{run.pk}/stop/").status_code == 403
    run.refresh_from_db()
    assert run.status == "queued" and Run.objects.count() == 1


def test_login_is_rate_limited_per_username_and_address(settings):
    settings.GRPO_LOGIN_MAX_FAILURES = 3
    name = f"victim-{uuid.uuid4().hex[:8]}"
    make_user(name, password="right-password")
    browser = Client(REMOTE_ADDR=f"10.9.{secrets.randbelow(250)}.{secrets.randbelow(250)}")
    for _ in range(3):
        response = browser.post("/runs/login/", {"username": name, "password": "wrong"})
        assert response.status_code == 200  # the form again, with its error
    blocked = browser.post("/runs/login/", {"username": name, "password": "right-password"})
    assert blocked.status_code == 429 and int(blocked["Retry-After"]) > 0
    assert "Too many failed logins" in blocked.content.decode()
    assert "_auth_user_id" not in browser.session  # even the right password does not log in now
    # /accounts/login/ is the same limited view, not a way around it
    assert (
        browser.post("/accounts/login/", {"username": name, "password": "right-password"}).status_code == 429
    )
    # another address is not blocked
    other = Client(REMOTE_ADDR="10.200.0.1")
    assert other.post("/runs/login/", {"username": name, "password": "right-password"}).status_code == 302


def test_admin_login_is_rate_limited_and_password_reset_is_off(settings, django_user_model):
    settings.GRPO_LOGIN_MAX_FAILURES = 3
    name = f"root-{uuid.uuid4().hex[:8]}"
    django_user_model.objects.create_superuser(name, password="right-password")
    browser = Client(REMOTE_ADDR=f"10.8.{secrets.randbelow(250)}.{secrets.randbelow(250)}")
    for _ in range(3):
        response = browser.post("/admin/login/", {"username": name, "password": "wrong"})
        assert response.status_code == 200
    blocked = browser.post("/admin/login/", {"username": name, "password": "right-password"})
    assert blocked.status_code == 429 and int(blocked["Retry-After"]) > 0
    assert "_auth_user_id" not in browser.session
    # the admin's own login still works from another address, and its page still renders
    other = Client(REMOTE_ADDR="10.201.0.1")
    assert other.get("/admin/login/").status_code == 200
    assert other.post("/admin/login/", {"username": name, "password": "right-password"}).status_code == 302
    # no mail backend: the reset pages do not exist (an unthrottled mail cannon otherwise)
    for path in ("/accounts/password_reset/", "/accounts/password_reset/done/", "/accounts/reset/x/y/"):
        assert Client().get(path).status_code == 404, path


def test_production_settings_pass_check_deploy_and_require_a_secret_key():
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings_production",
        "SECRET_KEY": secrets.token_urlsafe(64),
    }
    result = subprocess.run(
        [PYTHON, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout
    env["SECRET_KEY"] = "short"
    result = subprocess.run(
        [PYTHON, "manage.py", "check"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "SECRET_KEY" in result.stderr


PRODUCTION_PROBE = """
from django.test import Client
c = Client(HTTP_HOST="localhost")
schema = c.get("/api/v1/schema/")
docs = c.get("/api/v1/docs/")
api = c.get("/api/v1/runs/", HTTP_ACCEPT="text/html")
page = c.get("/runs/login/")
print("schema", schema.status_code)
print("docs", docs.status_code)
print("api", api.status_code, api["Content-Type"])
print("csp", page["Content-Security-Policy"])
"""


def test_production_closes_the_browsable_api_and_the_schema_and_refuses_any_host():
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings_production",
        "SECRET_KEY": secrets.token_urlsafe(64),
        "SECURE_SSL_REDIRECT": "false",
    }

    def probe(**extra) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PYTHON, "manage.py", "shell", "-c", PRODUCTION_PROBE],
            cwd=REPO,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )

    result = probe()
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["schema"] in ("401", "403"), result.stdout  # logged-in users only
    assert lines["docs"] in ("401", "403"), result.stdout  # the rendered reference too
    status, content_type = lines["api"].split(" ", 1)
    # No HTML API: a browser's Accept gets JSON (406: HTML is not on offer), never the browsable page.
    assert status in ("401", "406") and content_type.startswith("application/json"), lines["api"]
    assert (
        "script-src 'self'" in lines["csp"]
        and "unsafe-inline" not in lines["csp"].split("script-src")[1].split(";")[0]
    )
    reopened = probe(GRPO_PUBLIC_SCHEMA="true")
    assert "schema 200" in reopened.stdout, reopened.stdout + reopened.stderr
    assert "docs 200" in reopened.stdout, reopened.stdout + reopened.stderr
    star = subprocess.run(
        [PYTHON, "manage.py", "check"],
        cwd=REPO,
        env={**env, "ALLOWED_HOSTS": "*"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert star.returncode != 0 and "ALLOWED_HOSTS: '*' is refused" in star.stderr


def test_plaintext_tokens_from_before_hashing_are_imported(django_db_blocker):
    """The data migration: a DRF ``authtoken_token`` row becomes a hashed token that still works."""
    from importlib import import_module

    from django.apps import apps

    migration = import_module("controlplane.access.migrations.0002_import_plaintext_tokens")
    alice = make_user("alice")
    key = secrets.token_hex(20)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamptz, user_id bigint)"
        )
        cursor.execute("INSERT INTO authtoken_token VALUES (%s, now(), %s)", [key, alice.pk])
    with connection.schema_editor() as editor:
        migration.import_plaintext_tokens(apps, editor)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM authtoken_token")
        assert cursor.fetchone()[0] == 0  # the plaintext copy is gone
    assert token_client(key).get("/api/v1/runs/").status_code == 200
