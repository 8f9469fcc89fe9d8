"""The run form's model presets and the Stop confirmation in a real browser: headless Debian Chromium
driven by Playwright, against daphne serving the ASGI app on the test database.

No Celery worker: the run these tests stop is stored queued and never enqueued (as in
tests/test_dashboard_pages.py), so stopping it is immediate and nothing trains.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from controlplane.runs import services
from controlplane.runs.models import Run, RunStatus
from controlplane.runs.selectors import MAIN_ARGS, main_arg_defaults
from tests.conftest import CHROMIUM, DbThread, browser_login, daphne_on_test_db

PASSWORD = "s3cret-pass"


@pytest.fixture
def web_server(transactional_db, tmp_path):
    """daphne on the test database; runs would go to a queue nobody consumes (none is enqueued)."""
    with daphne_on_test_db(tmp_path / "daphne.log", queue=f"nobody-{os.getpid()}") as base:
        yield base


@pytest.fixture
def viewer(transactional_db):
    return get_user_model().objects.create_user(username="viewer", password=PASSWORD)


@pytest.fixture
def queued_run(viewer) -> Run:
    """A run of ``viewer``'s, stored queued and never enqueued."""
    config = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": [],
        "args": {"max_steps": 30},
    }
    return Run.objects.create(owner=viewer, name="queued", config=config, config_sha256="0" * 64)


@pytest.fixture
def page(web_server, viewer):
    """A logged-in Chromium page (user ``viewer``); page errors are collected in ``page.errors``.

    Playwright's sync API runs an event loop in this thread, where Django refuses ORM calls: make
    database rows in fixtures requested before this one, and read them with :func:`db_read`.
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.errors = []
        page.on("pageerror", lambda exc: page.errors.append(str(exc)))
        page.on(
            "console",
            lambda msg: page.errors.append(msg.text) if "Content Security Policy" in msg.text else None,
        )
        browser_login(page, web_server, "viewer", PASSWORD, "/runs/")
        page.wait_for_url("**/runs/")
        try:
            yield page
        finally:
            browser.close()


def db_read(read: Callable[[], Any]) -> Any:
    """Run an ORM read in a thread of its own (outside Playwright's event loop)."""
    with DbThread() as db:
        return db(read)


def shown_args(page) -> dict:
    """The main fields as the page shows them (numbers as floats, the checkbox as a bool)."""
    values = {}
    for name in MAIN_ARGS:
        selector = f"#run-form [name={name}]"
        if page.get_attribute(selector, "type") == "checkbox":
            values[name] = page.is_checked(selector)
        else:
            values[name] = float(page.input_value(selector))
    return values


def expected_args(args: dict) -> dict:
    """What :func:`shown_args` reads for a preset's ``args`` (the spec's defaults elsewhere)."""
    merged = {**main_arg_defaults(), **{k: v for k, v in args.items() if k in MAIN_ARGS}}
    return {k: v if isinstance(v, bool) else float(v) for k, v in merged.items()}


def test_choosing_a_model_prefills_its_preset_but_keeps_edited_fields(page, web_server):
    demo = services.demo_config()["args"]
    page.goto(web_server + "/runs/new/")
    assert shown_args(page) == expected_args(demo)
    demo_advanced = page.input_value("textarea[name=advanced]")
    assert json.loads(demo_advanced or "{}") == {k: v for k, v in demo.items() if k not in MAIN_ARGS}

    page.fill("input[name=num_generations]", "4")  # edited by hand: never overwritten
    # A model without a preset of its own (a hub id, typed): the page applies the generic one.
    page.fill("input[name=model]", "org/another-model")
    page.dispatch_event("input[name=model]", "change")
    generic = {"max_steps": 500, "log_completions": True, "max_completion_length": 1024, "save_steps": 100}
    assert shown_args(page) == {**expected_args(generic), "num_generations": 4.0}
    assert page.input_value("textarea[name=advanced]") == ""

    page.fill("input[name=model]", "tiny")
    page.dispatch_event("input[name=model]", "change")
    assert shown_args(page) == {**expected_args(demo), "num_generations": 4.0}
    assert page.input_value("textarea[name=advanced]") == demo_advanced
    assert not page.errors, page.errors


def test_stop_asks_first_and_cancel_sends_nothing(queued_run, page, web_server):
    run_id = queued_run.pk
    posts: list[str] = []
    page.on("request", lambda request: posts.append(request.url) if request.method == "POST" else None)
    dialogs: list[str] = []

    def answer(accept: bool):
        def handler(dialog) -> None:
            dialogs.append(dialog.message)
            if accept:
                dialog.accept()
            else:
                dialog.dismiss()

        return handler

    page.goto(f"{web_server}/runs/{run_id}/")
    page.once("dialog", answer(False))
    page.click("#stop-button")
    page.wait_for_timeout(1000)  # time for a request to leave, had one been sent
    assert len(dialogs) == 1 and dialogs[0].startswith(f"Stop run {run_id}?"), dialogs
    assert posts == []
    assert db_read(lambda: Run.objects.get(pk=run_id).status) == RunStatus.QUEUED
    assert page.inner_text("#run-status") == "queued"

    page.once("dialog", answer(True))
    page.click("#stop-button")
    page.wait_for_function(
        "() => document.querySelector('#run-status').textContent === 'stopped'", timeout=30_000
    )
    assert len(dialogs) == 2 and posts == [f"{web_server}/api/v1/runs/{run_id}/stop/"]
    assert db_read(lambda: Run.objects.get(pk=run_id).status) == RunStatus.STOPPED
    assert not page.errors, page.errors


def test_choosing_a_dataset_previews_its_columns_and_rows(web_server, viewer):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        try:
            browser_login(page, web_server, "viewer", PASSWORD, "/runs/new/")
            page.wait_for_url("**/runs/new/")
            page.fill("input[name=train_dataset]", "arithmetic-small")
            page.dispatch_event("input[name=train_dataset]", "change")
            page.wait_for_function(
                "() => document.getElementById('dataset-preview').dataset.columns === 'prompt,solution,level'"
            )
            assert page.locator("#dataset-preview table tr").count() == 4  # header + 3 rows
            assert "256 rows" in page.text_content("#dataset-preview")
            label = page.text_content("label:has(input[value='trainer.rewards.accuracy_reward'])")
            assert "reads solution" in label and "grpo-controlplane" in label, label
        finally:
            browser.close()
