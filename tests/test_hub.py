"""Hub models and datasets behind the operator's allowlists, offline, through the real
``huggingface_hub`` / ``datasets`` loading code: the tests lay out a hub cache (``HF_HUB_CACHE``)
holding the tiny model as ``acme/tiny-qwen3`` and a small dataset as ``acme/sums`` (plain-text
``question`` and an ``answer`` column), and run with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest
from rest_framework.test import APIClient

from controlplane.runs import services
from controlplane.runs.models import MetricPoint, Run, RunStatus
from tests.conftest import PYTHON, REPO, SESSION_SERVERS_ENV, browser_login, start_celery_worker
from worker.processes import wait_for

MODEL_COMMIT = "0123456789abcdef0123456789abcdef01234567"
DATASET_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model_dir):
    """A hub cache with ``acme/tiny-qwen3`` (main -> MODEL_COMMIT) and ``acme/sums`` (main ->
    DATASET_COMMIT), laid out as huggingface_hub does (refs/<branch> names the snapshot)."""
    root = tmp_path_factory.mktemp("hub")
    model = root / "models--acme--tiny-qwen3"
    (model / "refs").mkdir(parents=True)
    (model / "refs" / "main").write_text(MODEL_COMMIT)
    shutil.copytree(tiny_model_dir, model / "snapshots" / MODEL_COMMIT)
    data = root / "datasets--acme--sums"
    (data / "refs").mkdir(parents=True)
    (data / "refs" / "main").write_text(DATASET_COMMIT)
    files = data / "snapshots" / DATASET_COMMIT / "data"
    files.mkdir(parents=True)
    with open(files / "train.jsonl", "w") as fh:
        for a in range(10):
            for b in range(10):
                fh.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return root


def offline_env(hub_cache) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_snapshots_resolve_offline_to_their_commit_and_failures_are_words(hub_cache):
    """In a subprocess: huggingface_hub reads its cache location and offline switch at import."""
    script = """
import json
from trainer.plugins.hub import HubError, resolve_snapshot
out = {}
for repo, kind, rev in [("acme/tiny-qwen3", "model", None), ("acme/sums", "dataset", "main"),
                        ("acme/missing", "model", None), ("acme/tiny-qwen3", "model", "v9")]:
    try:
        s = resolve_snapshot(repo, repo_type=kind, revision=rev)
        out[f"{repo}@{rev}"] = {"commit": s.commit, "files": sorted(p.name for p in s.path.rglob("*") if p.is_file())}
    except HubError as exc:
        out[f"{repo}@{rev}"] = {"error": str(exc)}
print(json.dumps(out))
"""
    done = subprocess.run(
        [PYTHON, "-c", script],
        cwd=REPO,
        env={**os.environ, **offline_env(hub_cache)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["acme/tiny-qwen3@None"]["commit"] == MODEL_COMMIT
    assert "model.safetensors" in out["acme/tiny-qwen3@None"]["files"]
    assert out["acme/sums@main"] == {"commit": DATASET_COMMIT, "files": ["train.jsonl"]}
    missing = out["acme/missing@None"]["error"]
    assert "not in the worker's hub cache and the worker is offline" in missing and "Traceback" not in missing
    assert "offline" in out["acme/tiny-qwen3@v9"]["error"]


def _doc(**overrides) -> dict:
    doc = {
        "model": "acme/tiny-qwen3",
        "train_dataset": "acme/sums",
        "dataset_columns": {"question": "prompt", "answer": "solution"},
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {"max_steps": 2},
    }
    doc.update(overrides)
    return doc


def api_for(username: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username=username))
    return client


@pytest.mark.django_db
def test_hub_ids_outside_the_allowlists_are_refused_naming_the_setting(settings):
    api = api_for("hubber")
    settings.GRPO_ALLOWED_HUB_MODELS, settings.GRPO_ALLOWED_HUB_DATASETS = [], []
    errors = api.post("/api/v1/runs/", {"config": _doc()}, format="json").json()["config"]
    assert "GRPO_ALLOWED_HUB_MODELS" in errors["model"] and "it is empty" in errors["model"], errors
    assert "GRPO_ALLOWED_HUB_DATASETS" in errors["train_dataset"], errors
    settings.GRPO_ALLOWED_HUB_MODELS, settings.GRPO_ALLOWED_HUB_DATASETS = ["Qwen/*"], ["trl-lib/*"]
    errors = api.post("/api/v1/runs/", {"config": _doc()}, format="json").json()["config"]
    assert "it allows Qwen/*" in errors["model"], errors
    settings.GRPO_ALLOWED_HUB_MODELS, settings.GRPO_ALLOWED_HUB_DATASETS = ["acme/*"], ["acme/sum?"]
    created = api.post("/api/v1/runs/", {"config": _doc(model_revision="main")}, format="json")
    assert created.status_code == 201, created.content
    # Revisions apply to hub ids only; a bad revision is refused before anything runs.
    bad = api.post("/api/v1/runs/", {"config": _doc(model="tiny", model_revision="main")}, format="json")
    assert "model_revision" in bad.json()["config"], bad.content
    bad = api.post("/api/v1/runs/", {"config": _doc(model_revision="../etc")}, format="json")
    assert "model_revision" in bad.json()["config"], bad.content


@pytest.mark.parametrize(
    "repo_id",
    [
        "Qwen/Qwen3-0.6B\n",
        "Qwen/Qwen3-0.6B.",
        "Qwen/Qwen3--x",
        "Qwen/-x",
        "Qwen/x-",
        "Qwen/a..b",
        "/abs/path",
    ],
)
def test_a_hub_id_is_the_whole_string_by_the_hubs_own_rules(repo_id):
    """Issue 29 item 6: ``$`` let a trailing newline through, and names the hub refuses passed."""
    from trainer.plugins.hub import is_hub_id, valid_revision

    assert not is_hub_id(repo_id)
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("trl-lib/DeepMath-103K") and is_hub_id("a/b_")
    assert valid_revision("main") and valid_revision("refs/pr/1") and valid_revision("a" * 40)
    assert not any(valid_revision(r) for r in ("main\n", "main/", "a//b", "../x", ".x", ""))


@pytest.mark.django_db
def test_identifiers_with_a_trailing_newline_are_refused_by_field(settings):
    settings.GRPO_ALLOWED_HUB_MODELS, settings.GRPO_ALLOWED_HUB_DATASETS = ["acme/*"], ["acme/*"]
    api = api_for("newline")
    for field, value in (
        ("model", "acme/tiny-qwen3\n"),
        ("train_dataset", "acme/sums\n"),
        ("model_revision", "main\n"),
    ):
        response = api.post("/api/v1/runs/", {"config": _doc(**{field: value})}, format="json")
        assert response.status_code == 400 and field in response.json()["config"], (field, response.content)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_run_on_a_hub_model_and_dataset_trains_offline_and_records_the_commits(hub_cache, settings, tmp_path):
    queue = f"hub-{uuid.uuid4().hex[:8]}"
    worker = start_celery_worker(queue, tmp_path / "worker.log", env=offline_env(hub_cache))
    try:
        settings.GRPO_RUNS_QUEUE = queue
        settings.GRPO_ALLOWED_HUB_MODELS, settings.GRPO_ALLOWED_HUB_DATASETS = ["acme/*"], ["acme/*"]
        args = {
            "max_steps": 2,
            "num_generations": 4,
            "max_completion_length": 12,
            "token_budget": 256,
            "max_samples_per_row": 16,
            "gradient_checkpointing": False,
            "dtype": "float32",
            "disable_tqdm": True,
            "save_strategy": "no",
        }
        response = api_for("hubrun").post("/api/v1/runs/", {"config": _doc(args=args)}, format="json")
        assert response.status_code == 201, response.content
        run_id = response.json()["id"]
        wait_for(lambda: Run.objects.get(pk=run_id).is_terminal, timeout_s=600, what="the hub run to end")
        run = Run.objects.get(pk=run_id)
        events = "\n".join(e.message for e in run.events.all())
        assert run.status == RunStatus.COMPLETED, (run.status, run.failure_reason, events[-3000:])
        assert (
            run.sources["model"]["commit"] == MODEL_COMMIT
            and run.sources["dataset"]["commit"] == DATASET_COMMIT
        )
        assert f"model acme/tiny-qwen3@main is commit {MODEL_COMMIT}" in events
        assert MetricPoint.objects.filter(run_id=run_id, name="rewards/accuracy_reward/mean").exists()
        api = api_for("hubrun")
        assert api.get(f"/api/v1/runs/{run_id}/").json()["sources"]["dataset"]["id"] == "acme/sums"

        # Not in the cache: the run fails with the reason in words.
        missing = api.post(
            "/api/v1/runs/", {"config": _doc(model="acme/not-cached", args=args)}, format="json"
        )
        run_id = missing.json()["id"]
        wait_for(
            lambda: Run.objects.get(pk=run_id).is_terminal, timeout_s=120, what="the missing-model run to end"
        )
        run = Run.objects.get(pk=run_id)
        assert run.status == RunStatus.FAILED
        assert "is not in the worker's hub cache and the worker is offline" in run.failure_reason, (
            run.failure_reason
        )
        assert "Traceback" not in run.failure_reason
    finally:
        worker.stop(grace_s=15)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_form_run_with_a_plugin_reward_and_a_hub_model_charts_its_reward(
    acme_installed, hub_cache, session_server, tmp_path
):
    """In the browser: the form, a hub-cached model typed by id, the plugin's dataset and reward;
    the run page charts the plugin reward. daphne and the worker start after the plugin is installed.
    It trains on the session's vLLM server (the hub snapshot is the tiny model; its trainer loads its
    weights there first): the per-run launch of a hub model is the test above."""
    from django.contrib.auth import get_user_model
    from playwright.sync_api import sync_playwright

    from tests.conftest import CHROMIUM, DbThread, daphne_on_test_db

    get_user_model().objects.create_user(username="former", password="s3cret-pass")
    queue = f"hubform-{uuid.uuid4().hex[:8]}"
    worker = start_celery_worker(
        queue, tmp_path / "worker.log", env={**offline_env(hub_cache), **SESSION_SERVERS_ENV}
    )
    web_env = {"GRPO_ALLOWED_HUB_MODELS": "acme/*", **SESSION_SERVERS_ENV}
    try:
        with (
            DbThread() as db,
            daphne_on_test_db(tmp_path / "daphne.log", queue=queue, env=web_env) as base,
            sync_playwright() as pw,
        ):
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                browser_login(page, base, "former", "s3cret-pass", "/runs/new/")
                page.wait_for_url("**/runs/new/")
                # Typed as a user would; Escape closes the datalist's suggestions (they cover the
                # fields below), leaving the field fires its change event.
                for name, value in (("model", "acme/tiny-qwen3"), ("train_dataset", "acme-sums")):
                    page.fill(f"input[name={name}]", value)
                    page.press(f"input[name={name}]", "Escape")
                    page.locator(f"input[name={name}]").blur()
                page.wait_for_function(
                    "() => document.getElementById('dataset-preview').dataset.columns === 'prompt,answer'"
                )
                page.uncheck("input[name=reward_funcs][value='trainer.rewards.accuracy_reward']")
                page.check("input[name=reward_funcs][value='acme_grpo.rewards.exact_answer']")
                page.fill("input[name=name]", "plugin + hub from the form")
                for name, value in {
                    "max_steps": "3",
                    "num_generations": "4",
                    "max_completion_length": "12",
                }.items():
                    page.fill(f"input[name={name}]", value)
                page.click("#resources-options summary")
                page.fill("input[name=resources]", json.dumps({"server": session_server}))
                page.fill(
                    "textarea[name=advanced]",
                    '{"dtype": "float32", "gradient_checkpointing": false, "token_budget": 256, "disable_tqdm": true}',
                )
                page.click("form#run-form button[type=submit]")
                page.wait_for_url("**/runs/*/", timeout=30_000)
                run_id = int(page.get_attribute("#run", "data-run-id"))
                chart = '.chart[data-metric="rewards/exact_answer/mean"]'
                page.wait_for_selector(chart, timeout=480_000)
                assert int(page.get_attribute(chart, "data-points")) >= 1
                run = db(Run.objects.get, pk=run_id)
                assert run.config["model"] == "acme/tiny-qwen3"
                assert db(lambda: Run.objects.get(pk=run_id).sources)["model"]["commit"] == MODEL_COMMIT
            finally:
                browser.close()
    finally:
        worker.stop(grace_s=15)
