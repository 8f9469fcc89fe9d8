"""The run page's completions table in a real browser (Debian Chromium driven by Playwright, daphne
on the test database; no worker, no vLLM: the samples are written with the ingest service).

Issue 22, item 2: every logged step reachable (server-side pages of whole groups, a step picker that
knows every step), sorted and filtered on the server (reward, mixed groups, search), the prompt once
per group and the reference answer, a column per reward function, no sideways scrolling at desktop or
phone width, and live samples that never move the table under a reader. Issue 30: the Training/Eval
switch (eval samples per eval step: prompt, completion, rewards per function, reference answer),
live eval samples drawn only on the eval view.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from controlplane.runs.services import ingest
from tests.conftest import CHROMIUM, DbThread, browser_login, daphne_on_test_db
from tests.test_dashboard_soak import running_run

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "s3cret-pass"
STEPS = 30  # x 8 samples: two groups of 4 per step, 60 groups (6 pages of 10)


def _items(step: int) -> list[dict]:
    """Group 2s mixed rewards (0, 0, 1, 1), group 2s+1 all equal (step 7's: all 1.0, the others 0.5);
    a five-line prompt per group; the word "needle" in one completion of step 4."""
    items = []
    for g in (0, 1):
        gid = step * 2 + g
        rewards = (0.0, 0.0, 1.0, 1.0) if g == 0 else ((1.0,) * 4 if step == 7 else (0.5,) * 4)
        mean = sum(rewards) / 4
        for k, reward in enumerate(rewards):
            needle = (step, g, k) == (4, 0, 2)
            items.append(
                {
                    "prompt": f"user: question {gid}\nline two\nline three\nline four\nline five of {gid}",
                    "completion": "the needle is here " * 3
                    if needle
                    else f"step {step} rollout {k} " + "word " * 60,
                    "reward": reward,
                    "rewards": {"accuracy": reward, "format_ok": 0.25},
                    "advantage": reward - mean,
                    "group_id": gid,
                    "row_index": gid,
                    "reference": f"answer {gid}",
                }
            )
    return items


def _eval_items(step: int) -> list[dict]:
    """Two eval prompts, two samples each, as the trainer logs an eval pass of ``step``'s weights."""
    return [
        {
            "eval": True,
            "prompt": f"eval question {p} at {step}",
            "completion": f"eval answer {k}",
            "reward": float(k),
            "rewards": {"accuracy": float(k), "format_ok": 1.0},
            "advantage": None,
            "group_id": p,
            "row_index": 500 + p,
            "reference": f"held-out {p}",
        }
        for p in (0, 1)
        for k in (0, 1)
    ]


def _eval_ingest(run_id: int, step: int) -> None:
    ingest.completion_samples_ingest(run_id=run_id, step=step, items=_eval_items(step), split="eval")


def test_completions_table_pages_sorts_filters_searches_and_follows_live_samples(tmp_path):
    from playwright.sync_api import sync_playwright

    owner = get_user_model().objects.create_user(username="watcher", password=PASSWORD)
    run = running_run(owner, name="completions", max_steps=100)
    for step in range(1, STEPS + 1):
        ingest.completion_samples_ingest(run_id=run.pk, step=step, items=_items(step))
    for step in (10, 20):
        _eval_ingest(run.pk, step)
    with (
        DbThread() as db,
        daphne_on_test_db(tmp_path / "daphne.log", queue="unused") as base,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))

        def groups() -> list[dict]:
            return page.eval_on_selector_all(
                "#completions .cgroup",
                "els => els.map(e => ({step: +e.dataset.step, group: +e.dataset.group, "
                "mixed: e.dataset.mixed === 'true', mean: +e.dataset.mean}))",
            )

        def no_sideways_scroll() -> bool:
            return page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")

        def choose(selector: str, value: str) -> None:
            with page.expect_response(lambda r: "by=group" in r.url):
                page.select_option(selector, value)

        try:
            browser_login(page, base, "watcher", PASSWORD, f"/runs/{run.pk}/")
            page.wait_for_selector("#conn.live", timeout=30_000)

            # First page: the ten newest groups, whole (4 rollouts each), of 60.
            page.wait_for_function("() => document.querySelectorAll('#completions .cgroup').length === 10")
            shown = groups()
            assert [(g["step"], g["group"]) for g in shown[:3]] == [(30, 61), (30, 60), (29, 59)]
            assert page.locator("#completions .cgroup >> nth=0").locator("tr.rollout").count() == 4
            assert "page 1 of 6 · 60 group(s)" in page.inner_text("#completion-page")

            # A column per reward function, the scores in it; the prompt once, clamped to its first
            # lines and expandable; the dataset's reference answer.
            first = page.locator("#completions .cgroup >> nth=0")
            heads = first.locator("th.cfunc").all_inner_texts()
            assert heads == ["accuracy", "format_ok"]
            assert first.locator("td.cfunc[data-func='format_ok']").all_inner_texts() == ["0.25"] * 4
            assert first.locator(".cprompt").count() == 1
            prompt = first.locator(".cprompt-text")
            assert "question 61" in prompt.inner_text()
            clamped = prompt.bounding_box()["height"]
            first.locator(".cprompt-more").click()
            assert (
                prompt.bounding_box()["height"] > clamped * 1.3 and "line five of 61" in prompt.inner_text()
            )
            assert first.locator(".creference code").inner_text() == "answer 61"
            assert no_sideways_scroll()

            # The picker knows every step, so a step far past the first page is one choice away.
            steps = page.eval_on_selector_all("#completion-step option", "els => els.map(e => e.value)")
            assert steps == [""] + [str(s) for s in range(STEPS, 0, -1)]
            choose("#completion-step", "3")
            page.wait_for_function(
                "() => [...document.querySelectorAll('#completions .cgroup')].every(e => e.dataset.step === '3')"
            )
            assert [(g["step"], g["group"]) for g in groups()] == [(3, 7), (3, 6)]
            choose("#completion-step", "")

            # Sort by reward, high to low (the group's mean): step 7's all-1.0 group leads.
            choose("#completion-ordering", "-reward")
            page.wait_for_function(
                "() => document.querySelector('#completions .cgroup').dataset.step === '7'"
            )
            means = [g["mean"] for g in groups()]
            assert means == sorted(means, reverse=True) and means[0] == 1.0
            choose("#completion-ordering", "-step")

            # Only groups with mixed rewards: every shown group is mixed, 30 of them.
            choose("#completion-groups", "mixed")
            page.wait_for_function(
                "() => document.getElementById('completion-page').textContent.includes('30 group(s)')"
            )
            assert all(g["mixed"] for g in groups()) and len(groups()) == 10

            # A bad range is the server's 400, shown naming the field; cleared, the page comes back.
            page.fill("#completion-reward-min", "1")
            page.fill("#completion-reward-max", "0")
            page.wait_for_selector("#completion-errors:not([hidden])")
            assert "reward_min" in page.inner_text("#completion-errors")
            page.fill("#completion-reward-min", "")
            page.fill("#completion-reward-max", "")
            page.wait_for_selector("#completion-errors[hidden]", state="attached")

            # The search asks the server, and the downloads follow the filters.
            with page.expect_request(lambda r: "q=needle" in r.url and "by=group" in r.url):
                page.fill("#completion-search", "needle")
            page.wait_for_function("() => document.querySelectorAll('#completions .cgroup').length === 1")
            assert [(g["step"], g["group"]) for g in groups()] == [(4, 8)]
            hit = page.locator("#completions tr.rollout:not(.nomatch)")
            assert hit.count() == 1 and "needle" in hit.inner_text()
            assert "q=needle" in page.get_attribute("#download-completions-csv", "href")

            # A live step while filtered: a notice, not a redraw.
            db(ingest.completion_samples_ingest, run_id=run.pk, step=31, items=_items(31))
            page.wait_for_selector("#completion-new:not([hidden])", timeout=15_000)
            assert page.inner_text("#completion-new").startswith("8 new samples")
            assert [(g["step"], g["group"]) for g in groups()] == [(4, 8)]
            with page.expect_response(lambda r: "by=group" in r.url):
                page.click("#completion-new")
            page.wait_for_function(
                "() => document.querySelector('#completions .cgroup').dataset.step === '31'"
            )
            assert (
                page.input_value("#completion-search") == "" and page.input_value("#completion-groups") == ""
            )
            assert page.is_hidden("#completion-new")

            # On the default view live samples are drawn at the top, and the page keeps its size.
            db(ingest.completion_samples_ingest, run_id=run.pk, step=32, items=_items(32))
            page.wait_for_function(
                "() => document.querySelector('#completions .cgroup').dataset.step === '32'"
            )
            assert [(g["step"], g["group"]) for g in groups()][:3] == [(32, 65), (32, 64), (31, 63)]
            assert len(groups()) == 10 and page.is_hidden("#completion-new")
            assert page.locator("#completion-step option[value='32']").count() == 1

            # Eval samples live while the training view is shown: not drawn there, no notice.
            assert page.is_visible("#completion-split")  # the run has eval samples
            db(_eval_ingest, run.pk, 32)
            page.wait_for_timeout(1500)
            assert [(g["step"], g["group"]) for g in groups()][:2] == [(32, 65), (32, 64)]
            assert (
                page.is_hidden("#completion-new") and page.locator(".cgroup[data-split='eval']").count() == 0
            )

            # The Eval view: per eval step, each prompt once with its samples, rewards per function
            # and the reference answer; its own steps in the picker; the downloads ask for eval.
            with page.expect_response(lambda r: "by=group" in r.url and "split=eval" in r.url):
                page.click("#completion-split button[data-split='eval']")
            page.wait_for_function(
                "() => document.querySelectorAll('#completions .cgroup[data-split=\"eval\"]').length === 6"
            )
            assert [(g["step"], g["group"]) for g in groups()] == [
                (32, 1),
                (32, 0),
                (20, 1),
                (20, 0),
                (10, 1),
                (10, 0),
            ]
            first = page.locator("#completions .cgroup >> nth=0")
            assert "eval of step 32 · eval prompt 1" in first.locator(".cgroup-head").inner_text()
            assert "eval question 1 at 32" in first.locator(".cprompt-text").inner_text()
            assert first.locator(".creference code").inner_text() == "held-out 1"
            assert first.locator("th.cfunc").all_inner_texts() == ["accuracy", "format_ok"]
            assert first.locator("td.cfunc[data-func='accuracy']").all_inner_texts() == ["0", "1"]
            page.wait_for_function("() => document.querySelectorAll('#completion-step option').length === 4")
            steps = page.eval_on_selector_all("#completion-step option", "els => els.map(e => e.value)")
            assert steps == ["", "32", "20", "10"]
            assert "split=eval" in page.get_attribute("#download-completions-csv", "href")
            # A live eval pass is drawn on the eval view; a live training step is not.
            db(_eval_ingest, run.pk, 33)
            page.wait_for_function(
                "() => document.querySelector('#completions .cgroup').dataset.step === '33'"
            )
            db(ingest.completion_samples_ingest, run_id=run.pk, step=33, items=_items(33))
            page.wait_for_timeout(1500)
            assert page.locator(".cgroup[data-split='train']").count() == 0 and page.is_hidden(
                "#completion-new"
            )
            # Back to training: its own steps and groups, step 33's training groups on top.
            with page.expect_response(lambda r: "by=group" in r.url and "split=" not in r.url):
                page.click("#completion-split button[data-split='train']")
            page.wait_for_function(
                "() => document.querySelector('#completions .cgroup').dataset.split === 'train'"
            )
            assert [(g["step"], g["group"]) for g in groups()][:2] == [(33, 67), (33, 66)]
            assert "split" not in page.get_attribute("#download-completions-csv", "href")

            # No sideways scrolling on a phone either: rollouts stacked, text wrapped.
            page.set_viewport_size({"width": 390, "height": 900})
            page.wait_for_function("() => window.innerWidth === 390")
            assert no_sideways_scroll(), page.evaluate("() => document.documentElement.scrollWidth")
            box = page.locator("#completions .cgroup >> nth=0").bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= 390
            assert not errors, errors
        finally:
            browser.close()
