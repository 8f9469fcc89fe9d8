"""Pages around the dashboard (issue 22, polish): our own 404 page, in development too, and the API
reference rendered from the OpenAPI schema; checked with Django's client and in Chromium."""

from __future__ import annotations

import os

import pytest
from django.contrib.auth import get_user_model

from controlplane.runs.models import Run
from tests.conftest import CHROMIUM, daphne_on_test_db

PASSWORD = "s3cret-pass"


@pytest.fixture
def dev_client(client, settings):
    """The test client with ``DEBUG`` on, as ``make run`` serves (pytest-django turns it off)."""
    settings.DEBUG = True
    return client


@pytest.mark.django_db
def test_a_missing_page_is_our_404_not_the_debug_page(dev_client):
    response = dev_client.get("/no/such/page/")
    body = response.content.decode()
    assert response.status_code == 404
    assert 'id="not-found"' in body and "/no/such/page/" in body
    assert "URLconf" not in body and "DEBUG = True" not in body  # Django's debug page is not shown


@pytest.mark.django_db
def test_a_run_of_someone_else_is_the_same_404(dev_client):
    owner = get_user_model().objects.create_user(username="owner", password=PASSWORD)
    run = Run.objects.create(owner=owner, name="private", config={"model": "tiny"}, config_sha256="0" * 64)
    get_user_model().objects.create_user(username="other", password=PASSWORD)
    dev_client.login(username="other", password=PASSWORD)
    response = dev_client.get(f"/runs/{run.pk}/")
    assert response.status_code == 404
    assert 'id="not-found"' in response.content.decode()


@pytest.mark.django_db
def test_api_404s_keep_their_machine_bodies(dev_client):
    get_user_model().objects.create_user(username="viewer", password=PASSWORD)
    dev_client.login(username="viewer", password=PASSWORD)
    response = dev_client.get("/api/v1/runs/999999/")
    assert response.status_code == 404 and response["Content-Type"].startswith("application/json")


@pytest.mark.django_db
def test_api_reference_lists_every_operation_of_the_schema(client):
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    operations = {
        (method.upper(), path)
        for path, item in schema["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    }
    response = client.get("/api/v1/docs/")
    body = response.content.decode()
    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")
    shown = {
        (part.split('data-method="')[1].split('"')[0], part.split('data-path="')[1].split('"')[0])
        for part in body.split('class="endpoint"')[1:]
    }
    assert shown == operations and len(operations) >= 10
    assert "/api/v1/docs/" not in {path for _, path in operations}  # the page is not an endpoint
    assert "<code>config</code></td><td>body</td>" in body  # POST /api/v1/runs/'s request field


@pytest.mark.django_db(transaction=True)
def test_header_link_opens_the_rendered_api_reference_and_a_stale_link_our_404(tmp_path):
    from playwright.sync_api import sync_playwright

    with (
        daphne_on_test_db(tmp_path / "daphne.log", queue=f"nobody-{os.getpid()}") as base,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 390, "height": 844})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            page.goto(base + "/")
            page.click("header >> text=API reference")
            page.wait_for_url("**/api/v1/docs/")
            assert page.is_visible("#api-reference h1")
            assert page.locator("#api-reference .endpoint").count() >= 10
            assert (
                page.locator(
                    "#api-reference .endpoint[data-method='POST'][data-path='/api/v1/runs/']"
                ).count()
                == 1
            )
            response = page.goto(base + "/runs/old-link/")
            assert response.status == 404
            assert page.is_visible("#not-found") and "Using the URLconf" not in page.content()
            assert not errors, errors
        finally:
            browser.close()
