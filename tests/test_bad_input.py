"""Malformed and hostile input on every way in: the run form, the REST API (create and query
parameters), RUN.yaml (the validator and the ``python -m trainer train`` CLI) and the run stream
websocket, plus a property test of config validation.

Every refusal must be a 4xx (400 for validation, 401/403/404 for auth and visibility) or a
:class:`RunConfigError` whose ``errors`` key names the offending field, never a 500 or another
exception, and a refused create must store nothing. The Django clients keep their default
``raise_request_exception=True``, so a server error surfaces here as the exception itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from rest_framework.exceptions import ParseError
from rest_framework.test import APIClient

from controlplane.asgi import application
from controlplane.runs import services
from controlplane.runs.consumers import CLOSE_NOT_FOUND, CLOSE_TOO_BIG, CLOSE_UNAUTHENTICATED
from controlplane.runs.launch_checks import process_state_kept
from controlplane.runs.models import CompletionSample, MetricPoint, Run, RunEvent
from controlplane.runs.serializers import SafeJSONParser
from controlplane.runs.services import ingest
from controlplane.runs.validation import run_document_validate
from tests.conftest import run_async
from trainer.config.async_grpo_config import AsyncGRPOConfig
from trainer.config.run_config import TOP_LEVEL_KEYS, RunConfigError, validate_run_document

REPO = Path(__file__).resolve().parent.parent
GOOD_REWARD = "trainer.rewards.accuracy_reward"


def good(**args) -> dict:
    return {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": [GOOD_REWARD],
        # within the tiny model's 1024-token server (the default 2048 is refused at creation)
        "args": {"max_steps": 4, "num_generations": 4, "max_completion_length": 128, **args},
    }


def with_(**top) -> dict:
    return {**good(), **top}


def yaml_bomb(levels: int = 9, width: int = 9) -> str:
    """Billion laughs: a few hundred bytes of YAML that expand to width**levels items."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "model: tiny\ntrain_dataset: arithmetic\nreward_funcs: [trainer.rewards.accuracy_reward]\n" + (
        "args:\n  lr_scheduler_kwargs:\n" + "\n".join("    " + line for line in lines) + "\n"
    )


def shared_bomb(levels: int = 9, width: int = 9) -> dict:
    """The same expansion as a Python object graph with shared references (what safe_load builds)."""
    node: list = ["lol"] * width
    for _ in range(levels):
        node = [node] * width
    return good(lr_scheduler_kwargs={"x": node})


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"k": value}
    return value


def nothing_stored() -> None:
    assert Run.objects.count() == 0
    assert RunEvent.objects.count() == 0
    assert MetricPoint.objects.count() == 0
    assert CompletionSample.objects.count() == 0


def error_paths(body: object) -> set[str]:
    """Field paths an error response names: top-level keys and the keys of nested error mappings."""
    paths: set[str] = set()
    if isinstance(body, dict):
        for key, value in body.items():
            paths.add(key)
            if isinstance(value, dict):
                paths.update(value)
    return paths


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture
def roots(settings, tmp_path):
    """Allowed model/dataset roots with a real model dir and dataset, plus escapes out of them."""
    models, datasets, outside = tmp_path / "models", tmp_path / "datasets", tmp_path / "outside"
    for d in (models / "m", datasets, outside / "secret"):
        d.mkdir(parents=True)
    (models / "m" / "config.json").write_text("{}")
    (datasets / "d.jsonl").write_text('{"prompt": "1+1", "solution": "2"}\n')
    (outside / "secret.jsonl").write_text('{"prompt": "secret"}\n')
    (models / "escape").symlink_to(outside / "secret")
    (datasets / "escape.jsonl").symlink_to(outside / "secret.jsonl")
    settings.GRPO_ALLOWED_MODEL_ROOTS = [str(models)]
    settings.GRPO_ALLOWED_DATASET_ROOTS = [str(datasets)]
    return {"MODELS": str(models), "DATASETS": str(datasets), "OUTSIDE": str(outside)}


def fill(value, roots: dict):
    """Replace {MODELS}/{DATASETS}/{OUTSIDE} in every string of a case's payload."""
    if isinstance(value, str):
        for key, root in roots.items():
            value = value.replace("{" + key + "}", root)
        return value
    if isinstance(value, dict):
        return {k: fill(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, roots) for v in value]
    return value


def make_user(name: str, **extra):
    return get_user_model().objects.create_user(username=name, password=None, **extra)


def api_for(username: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username=username))
    return client


# ------------------------------------------------------------------- REST API: POST /runs/
# (id, body, field the error must name; None = a 4xx that names no field, e.g. an unparsable body)
RAW = "raw"  # body is sent as-is with Content-Type: application/json
API_CREATE_CASES = [
    # wrong types
    pytest.param({"config": [1, 2]}, "config", id="config-is-a-list"),
    pytest.param({"config": 42}, "config", id="config-is-a-number"),
    pytest.param({"config": None}, "config", id="config-null"),
    pytest.param({"name": {"a": 1}, "config": good()}, "name", id="name-is-an-object"),
    pytest.param([good()], "non_field_errors", id="body-is-a-list"),
    pytest.param({"config": good(learning_rate="fast")}, "args.learning_rate", id="lr-string"),
    pytest.param({"config": good(max_steps="9")}, "args.max_steps", id="max-steps-string"),
    pytest.param({"config": good(num_generations=4.5)}, "args.num_generations", id="num-gen-float"),
    pytest.param({"config": good(log_completions="yes")}, "args.log_completions", id="bool-as-string"),
    pytest.param({"config": good(label_names="labels")}, "args.label_names", id="list-field-as-string"),
    pytest.param({"config": with_(model=123)}, "model", id="model-number"),
    pytest.param({"config": with_(train_dataset=["arithmetic"])}, "train_dataset", id="dataset-list"),
    pytest.param({"config": with_(train_dataset="")}, "train_dataset", id="dataset-empty"),
    pytest.param({"config": with_(reward_funcs={"a": GOOD_REWARD})}, "reward_funcs", id="rewards-dict"),
    pytest.param({"config": with_(tools="trainer.builtin_tools.add")}, "tools", id="tools-string"),
    pytest.param({"config": with_(args=[1, 2])}, "args", id="args-list"),
    # Falsy non-mappings were read as "no args" (201), then broke the supervisor at launch.
    pytest.param({"config": with_(args=[])}, "args", id="args-empty-list"),
    pytest.param({"config": with_(args=None)}, "args", id="args-null"),
    pytest.param({"config": with_(args="")}, "args", id="args-empty-string"),
    pytest.param({"config": with_(args=0)}, "args", id="args-zero"),
    pytest.param({"config": with_(args=False)}, "args", id="args-false"),
    pytest.param({"config": good(model_init_kwargs=[1])}, "args.model_init_kwargs", id="kwargs-list"),
    # JSON null where a dict / value is expected
    pytest.param({"config": good(learning_rate=None)}, "args.learning_rate", id="lr-null"),
    pytest.param({"config": with_(peft_config={"r": None})}, "peft_config.r", id="peft-r-null"),
    pytest.param({"config": with_(reward_funcs=[None])}, "reward_funcs[0]", id="reward-null-item"),
    pytest.param(
        {"config": with_(environment_factory={"env": None})}, "environment_factory.env", id="env-null"
    ),
    # unknown fields
    pytest.param({"config": with_(bogus=1)}, "bogus", id="unknown-top-level"),
    pytest.param({"config": good(not_a_field=3)}, "args.not_a_field", id="unknown-arg"),
    pytest.param({"config": good(warmup_ratio=0.1)}, "args.warmup_ratio", id="removed-arg"),
    pytest.param({"config": with_(peft_config={"bogus": 1})}, "peft_config.bogus", id="unknown-peft"),
    pytest.param({"config": with_(peft_config={"r": "big"})}, "peft_config.r", id="peft-r-string"),
    # out of range
    pytest.param({"config": good(learning_rate=-1e-5)}, "args.learning_rate", id="lr-negative"),
    pytest.param({"config": good(num_generations=1)}, "args.num_generations", id="num-gen-1"),
    pytest.param({"config": good(max_staleness=-1)}, "args.max_staleness", id="staleness-negative"),
    pytest.param({"config": good(temperature=0)}, "args.temperature", id="temperature-0"),
    pytest.param({"config": good(temperature=-0.5)}, "args.temperature", id="temperature-negative"),
    pytest.param({"config": good(top_p=1.5)}, "args.top_p", id="top-p-1.5"),
    pytest.param({"config": good(top_k=-1)}, "args.top_k", id="top-k-negative"),
    pytest.param({"config": good(max_completion_length=0)}, "args.max_completion_length", id="max-len-0"),
    pytest.param({"config": good(weight_sync_steps=0)}, "args.weight_sync_steps", id="sync-steps-0"),
    pytest.param(
        {"config": good(max_concurrent_rollouts=0)}, "args.max_concurrent_rollouts", id="concurrency-0"
    ),
    pytest.param(
        {"config": good(per_device_train_batch_size=0)},
        "args.per_device_train_batch_size",
        id="batch-size-0",
    ),
    pytest.param({"config": good(seed=-1)}, "args.seed", id="seed-negative"),
    pytest.param({"config": good(max_steps=10**30)}, "args.max_steps", id="max-steps-10e30"),
    pytest.param({"config": good(optim="nope")}, "args.optim", id="optim-unknown"),
    pytest.param(
        {"config": good(lr_scheduler_type="nope")}, "args.lr_scheduler_type", id="scheduler-unknown"
    ),
    pytest.param({"config": good(dtype="int8")}, "args.dtype", id="dtype-int8"),
    # the spec's refused combinations
    pytest.param(
        {"config": good(deepspeed={"zero_optimization": {"stage": 3}})}, "args.deepspeed", id="deepspeed"
    ),
    pytest.param({"config": good(use_liger_kernel=True)}, "args.use_liger_kernel", id="liger"),
    pytest.param(
        {"config": good(parallelism_config={"cp_size": 2})}, "args.parallelism_config", id="context-parallel"
    ),
    pytest.param(
        {"config": good(parallelism_config={"sp_size": 4})}, "args.parallelism_config", id="sequence-parallel"
    ),
    pytest.param(
        {"config": good(ignore_data_skip=False)}, "args.ignore_data_skip", id="ignore-data-skip-off"
    ),
    pytest.param(
        {"config": good(remove_unused_columns=True)}, "args.remove_unused_columns", id="remove-unused-columns"
    ),
    pytest.param({"config": good(top_p=0.9)}, "args.top_p", id="top-p-without-top-k"),
    pytest.param({"config": good(min_p=0.1)}, "args.min_p", id="min-p-without-top-k"),
    pytest.param(
        {"config": good(score_centering=True, num_sampler_logprobs=0)},
        "args.num_sampler_logprobs",
        id="score-centering-without-logprobs",
    ),
    pytest.param(
        {"config": with_(peft_config={"target_modules": ["q_proj", "lm_head"]})},
        "peft_config.target_modules",
        id="lora-on-lm-head",
    ),
    pytest.param({"config": good(trust_remote_code=True)}, "args.trust_remote_code", id="trust-remote-code"),
    pytest.param({"config": good(output_dir="../../etc")}, "args.output_dir", id="output-dir"),
    pytest.param({"config": good(fsdp_config="/etc/fsdp.json")}, "args.fsdp_config", id="fsdp-config-file"),
    # huge payloads
    pytest.param({"name": "x" * 5_000_000, "config": good()}, None, id="name-5MB"),
    pytest.param({"name": "x" * 201, "config": good()}, "name", id="name-201-chars"),
    pytest.param({"config": good(run_name="x" * 1_000_000)}, "config", id="config-1MB"),
    pytest.param({"config": "model: " + "x" * 1_000_000}, "config", id="yaml-text-1MB"),
    pytest.param({"config": with_(reward_funcs=[GOOD_REWARD] * 10_000)}, "config", id="rewards-10k"),
    pytest.param({"config": good(label_names=["labels"] * 10_000)}, "config", id="list-arg-10k"),
    pytest.param({"config": good(lr_scheduler_kwargs=nested(40))}, None, id="config-nested-40"),
    # names outside the registries
    pytest.param({"config": with_(model="Qwen/Qwen3-0.6B")}, "model", id="model-unregistered"),
    pytest.param({"config": with_(train_dataset="gsm8k")}, "train_dataset", id="dataset-unregistered"),
    pytest.param(
        {"config": with_(reward_funcs=["trainer.rewards.nope"])}, "reward_funcs[0]", id="reward-unregistered"
    ),
    pytest.param(
        {"config": with_(tools=["trainer.builtin_tools.rm_rf"])}, "tools[0]", id="tool-unregistered"
    ),
    pytest.param(
        {"config": with_(environment_factory="trainer.envs.Shell")},
        "environment_factory",
        id="env-unregistered",
    ),
    # dotted import paths outside the registries
    pytest.param({"config": with_(reward_funcs=["os.system"])}, "reward_funcs[0]", id="os-system"),
    pytest.param(
        {"config": with_(reward_funcs=[GOOD_REWARD, "subprocess.call"])},
        "reward_funcs[1]",
        id="subprocess-call",
    ),
    pytest.param({"config": with_(reward_funcs=["builtins.eval"])}, "reward_funcs[0]", id="builtins-eval"),
    pytest.param({"config": with_(tools=["os.system"])}, "tools[0]", id="tool-os-system"),
    pytest.param(
        {"config": with_(environment_factory={"shell": "subprocess.Popen"})},
        "environment_factory.shell",
        id="env-subprocess-popen",
    ),
    pytest.param(
        {"config": with_(reward_funcs=["trainer.rewards.accuracy_reward; rm -rf /"])},
        "reward_funcs[0]",
        id="reward-shell-injection",
    ),
    # path traversal and paths outside GRPO_ALLOWED_*_ROOTS
    pytest.param({"config": with_(model="../../etc/passwd")}, "model", id="model-relative-traversal"),
    pytest.param({"config": with_(model="{MODELS}/../outside/secret")}, "model", id="model-dotdot-in-root"),
    pytest.param({"config": with_(model="{OUTSIDE}/secret")}, "model", id="model-outside-roots"),
    pytest.param({"config": with_(model="{MODELS}/escape")}, "model", id="model-symlink-escape"),
    pytest.param({"config": with_(model="/etc")}, "model", id="model-etc"),
    pytest.param({"config": with_(model="{MODELS}/m\x00/../../x")}, "model", id="model-nul-byte"),
    pytest.param({"config": with_(train_dataset="/etc/passwd")}, "train_dataset", id="dataset-etc-passwd"),
    pytest.param(
        {"config": with_(train_dataset="../../etc/passwd")}, "train_dataset", id="dataset-traversal"
    ),
    pytest.param(
        {"config": with_(train_dataset="{DATASETS}/escape.jsonl")},
        "train_dataset",
        id="dataset-symlink-escape",
    ),
    # A folder inside a root that holds a link out of it (the loader would follow it): the root itself.
    pytest.param(
        {"config": with_(train_dataset="{DATASETS}")}, "train_dataset", id="dataset-dir-holds-escape"
    ),
    pytest.param({"config": with_(model="{MODELS}")}, "model", id="model-dir-holds-escape"),
    pytest.param(
        {"config": with_(train_dataset="{DATASETS}/missing.jsonl")}, "train_dataset", id="dataset-missing"
    ),
    # YAML text
    pytest.param({"config": "- model\n- tiny\n"}, "config", id="yaml-list"),
    pytest.param({"config": "just a string"}, "config", id="yaml-scalar"),
    pytest.param({"config": "model: [unclosed"}, "config", id="yaml-syntax-error"),
    pytest.param({"config": "!!python/object/apply:os.system ['id']"}, "config", id="yaml-python-tag"),
    pytest.param({"config": yaml_bomb()}, "config", id="yaml-billion-laughs"),
    pytest.param({"config": "[" * 5000 + "]" * 5000}, "config", id="yaml-nested-5000"),
    pytest.param({"config": "[" * 31900 + "]" * 31900}, "config", id="yaml-nested-31900"),
    pytest.param(
        {
            "config": "model: tiny\ntrain_dataset: arithmetic\nreward_funcs: [x.y]\nargs: {temperature: .nan}\n"
        },
        "args.temperature",
        id="yaml-nan",
    ),
    pytest.param(
        {
            "config": "model: tiny\ntrain_dataset: arithmetic\nreward_funcs: [x.y]\nargs: {run_name: 2024-01-01}\n"
        },
        "args.run_name",
        id="yaml-date",
    ),
    pytest.param({"config": "model: tiny\nargs: {1: 2}\n"}, "args", id="yaml-int-key"),
    pytest.param(
        {"config": "model: tiny\nmax_steps: " + "9" * 5000 + "\n"}, "config", id="yaml-5000-digit-int"
    ),
    # NUL bytes, invalid Unicode, non-UTF-8, non-JSON numbers
    pytest.param({"config": good(run_name="a\x00b")}, "args.run_name", id="nul-in-arg"),
    pytest.param({"name": "a\x00b", "config": good()}, "name", id="nul-in-name"),
    pytest.param({"config": with_(model="tiny\x00")}, "model", id="nul-in-model"),
    pytest.param(
        (
            RAW,
            json.dumps({"config": good(run_name="SURROGATE")}).replace("SURROGATE", "\\ud800"),
        ),
        "args.run_name",
        id="lone-surrogate-in-arg",
    ),
    pytest.param(
        (RAW, '{"name": "\\udc00", "config": {"model": "tiny"}}'), "name", id="lone-surrogate-in-name"
    ),
    pytest.param((RAW, b'{"name": "\xff\xfe", "config": {}}'), None, id="body-not-utf8"),
    pytest.param((RAW, '{"config": {"model": "tiny", "args": {"temperature": NaN}}}'), None, id="json-NaN"),
    pytest.param(
        (RAW, '{"config": {"model": "tiny", "args": {"seed": ' + "9" * 5000 + "}}}"),
        None,
        id="json-5000-digits",
    ),
    pytest.param((RAW, '{"config": {"model": "tiny", '), None, id="json-truncated"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("body", "field"), API_CREATE_CASES)
def test_api_create_refuses_bad_input_and_stores_nothing(roots, body, field):
    make_user("alice")
    client = api_for("alice")
    if isinstance(body, tuple) and body[0] == RAW:
        response = client.post("/api/v1/runs/", body[1], content_type="application/json")
    else:
        response = client.post("/api/v1/runs/", fill(body, roots), format="json")
    assert response.status_code == 400, response.content[:500]
    if field is not None:
        errors = response.json()
        assert field in error_paths(errors), errors
        for path, message in (
            errors.get("config", {}).items() if isinstance(errors.get("config"), dict) else ()
        ):
            assert path and message, errors
    elif response["Content-Type"].startswith("application/json"):
        assert response.json()  # a parse error says why ({"detail": "JSON parse error - ..."})
    nothing_stored()


@pytest.mark.django_db
def test_api_create_accepts_the_allowed_local_paths(roots):
    """The roots fixture's own model and dataset pass: the refusals above are not blanket refusals."""
    make_user("alice")
    config = with_(model=f"{roots['MODELS']}/m", train_dataset=f"{roots['DATASETS']}/d.jsonl")
    response = api_for("alice").post("/api/v1/runs/", {"config": config}, format="json")
    assert response.status_code == 201, response.content


@pytest.mark.django_db
def test_api_create_refuses_anonymous_and_bad_tokens():
    for client in (APIClient(), APIClient(HTTP_AUTHORIZATION="Token not-a-token")):
        response = client.post("/api/v1/runs/", {"config": good()}, format="json")
        assert response.status_code == 401, response.content
    response = APIClient(HTTP_AUTHORIZATION="Token \x00\xff").post(
        "/api/v1/runs/", {"config": good()}, format="json"
    )
    assert response.status_code == 401
    nothing_stored()


def test_safe_json_parser_turns_deep_nesting_into_a_parse_error():
    """The parser settings.REST_FRAMEWORK installs first (the API test below goes through it)."""
    import io

    with pytest.raises(ParseError, match="nested too deeply"):
        SafeJSONParser().parse(io.BytesIO(b"[" * 100_000 + b"]" * 100_000), parser_context={})


@pytest.mark.django_db
def test_api_create_deeply_nested_json_body_is_400():
    make_user("alice")
    body = '{"config": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = api_for("alice").post("/api/v1/runs/", body, content_type="application/json")
    assert response.status_code == 400
    nothing_stored()


@pytest.mark.django_db
def test_api_create_nul_in_idempotency_key_is_400():
    make_user("alice")
    response = api_for("alice").post(
        "/api/v1/runs/", {"config": good()}, format="json", HTTP_IDEMPOTENCY_KEY="k\x00"
    )
    assert response.status_code == 400
    nothing_stored()


# --------------------------------------------------------- REST API: query parameters of reads
# (id, path under /api/v1/runs/<id>/, expected status, what the error names)
QUERY_CASES = [
    pytest.param("metrics/?since_step=abc", 400, "since_step", id="metrics-since-step-text"),
    pytest.param("metrics/?since_step=-1", 400, "since_step", id="metrics-since-step-negative"),
    pytest.param("metrics/?since_step=1.5", 400, "since_step", id="metrics-since-step-float"),
    pytest.param("metrics/?since_step=99999999999999999999", 400, "since_step", id="metrics-since-step-huge"),
    pytest.param("metrics/?since_step=%00", 400, "since_step", id="metrics-since-step-nul"),
    pytest.param("metrics/?layout=xml", 400, "layout", id="metrics-layout-unknown"),
    pytest.param("metrics/?names=reward%00", 400, "names", id="metrics-names-nul"),
    pytest.param("completions/?since_step=abc", 400, "since_step", id="completions-since-step-text"),
    pytest.param("completions/?step=-1", 400, "step", id="completions-step-negative"),
    pytest.param("completions/?step=99999999999999999999", 400, "step", id="completions-step-huge"),
    pytest.param("completions/?step=%ff%fe", 400, "step", id="completions-step-not-utf8"),
    pytest.param("completions/?page=abc", 404, "detail", id="completions-page-text"),
    pytest.param("completions/?page=0", 404, "detail", id="completions-page-0"),
    pytest.param("completions/?page=-1", 404, "detail", id="completions-page-negative"),
    pytest.param("completions/?page=99999", 404, "detail", id="completions-page-past-the-end"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("path", "status", "field"), QUERY_CASES)
def test_api_query_params_are_checked(path, status, field):
    alice = make_user("alice")
    run = Run.objects.create(owner=alice, name="q", config=good(), config_sha256="0" * 64)
    ingest.metric_points_ingest(run_id=run.pk, step=1, values={"reward": 0.5})
    response = api_for("alice").get(f"/api/v1/runs/{run.pk}/{path}")
    assert response.status_code == status, response.content
    assert field in response.json(), response.json()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path",
    ["metrics/", "completions/", "events/", "diagnosis/", "checkpoints/", ""],
    ids=lambda p: p or "detail",
)
def test_api_other_users_and_missing_runs_are_404(path):
    alice, _ = make_user("alice"), make_user("bob")
    run = Run.objects.create(owner=alice, name="a", config=good(), config_sha256="0" * 64)
    bob = api_for("bob")
    assert bob.get(f"/api/v1/runs/{run.pk}/{path}").status_code == 404
    assert bob.get(f"/api/v1/runs/99999999999999999999/{path}").status_code == 404
    assert APIClient().get(f"/api/v1/runs/{run.pk}/{path}").status_code == 401


@pytest.mark.django_db
def test_api_garbage_page_size_falls_back_to_the_default():
    """DRF's documented leniency: a page_size it cannot use means the default (or the 1000 cap)."""
    alice = make_user("alice")
    run = Run.objects.create(owner=alice, name="p", config=good(), config_sha256="0" * 64)
    client = api_for("alice")
    for value in ("abc", "-5", "0", "1e3", "%00", "99999999999999999999"):
        response = client.get(f"/api/v1/runs/{run.pk}/completions/?page_size={value}")
        assert response.status_code == 200, (value, response.content)


# ------------------------------------------------------------------------ the web form
FORM_BASE = {
    "model": "tiny",
    "train_dataset": "arithmetic-small",
    "reward_funcs": [GOOD_REWARD],
    "max_completion_length": "128",
}
# (id, overrides of FORM_BASE, form field the error sits on, text its message must contain)
FORM_CASES = [
    pytest.param({"num_generations": "1"}, "num_generations", "at least 2 completions", id="num-gen-1"),
    pytest.param({"num_generations": "two"}, "num_generations", "", id="num-gen-text"),
    pytest.param({"num_generations": "9" * 5000}, "num_generations", "", id="num-gen-5000-digits"),
    pytest.param({"learning_rate": "-1"}, "learning_rate", "must be in [0, 1]", id="lr-negative"),
    pytest.param({"learning_rate": "nan"}, "learning_rate", "", id="lr-nan"),
    pytest.param({"learning_rate": "inf"}, "learning_rate", "", id="lr-inf"),
    pytest.param({"temperature": "0"}, "temperature", "must be in (0, 100]", id="temperature-0"),
    pytest.param({"max_staleness": "-1"}, "max_staleness", "must be in [0, 10^6]", id="staleness-negative"),
    pytest.param({"max_steps": "9" * 40}, "max_steps", "range", id="max-steps-10e40"),
    pytest.param({"per_device_train_batch_size": "0"}, "per_device_train_batch_size", "", id="batch-size-0"),
    pytest.param({"model": "../../etc/passwd"}, "model", "", id="model-traversal"),
    pytest.param({"model": "/etc"}, "model", "", id="model-absolute"),
    pytest.param({"train_dataset": "/etc/passwd"}, "train_dataset", "", id="dataset-absolute"),
    pytest.param({"reward_funcs": ["os.system"]}, "reward_funcs", "", id="reward-os-system"),
    pytest.param({"reward_funcs": ["builtins.eval"]}, "reward_funcs", "", id="reward-builtins-eval"),
    pytest.param({"reward_funcs": []}, "reward_funcs", "", id="no-reward"),
    pytest.param({"name": "a\x00b"}, "name", "", id="name-nul"),
    pytest.param({"name": "x" * 201}, "name", "", id="name-201-chars"),
    pytest.param({"advanced": "[1, 2]"}, "advanced", "JSON object", id="advanced-list"),
    pytest.param({"advanced": "null"}, "advanced", "JSON object", id="advanced-null"),
    pytest.param({"advanced": "{not json"}, "advanced", "JSON", id="advanced-not-json"),
    pytest.param({"advanced": "[" * 3000 + "]" * 3000}, "advanced", "nested", id="advanced-nested-3000"),
    pytest.param(
        {"advanced": '{"run_name": "' + "x" * 100_000 + '"}'}, "advanced", "limit", id="advanced-100KB"
    ),
    pytest.param({"advanced": '{"nope": 1}'}, "advanced", "args.nope", id="advanced-unknown-arg"),
    pytest.param({"advanced": '{"temperature": 0.5}'}, "advanced", "temperature", id="advanced-main-arg"),
    pytest.param({"advanced": '{"epsilon": NaN}'}, "advanced", "args.epsilon", id="advanced-nan"),
    pytest.param({"advanced": '{"epsilon": -1}'}, "advanced", "args.epsilon", id="advanced-epsilon-negative"),
    pytest.param({"advanced": '{"run_name": "a\\u0000b"}'}, "advanced", "args.run_name", id="advanced-nul"),
    pytest.param(
        {"advanced": '{"run_name": "\\ud800"}'}, "advanced", "args.run_name", id="advanced-surrogate"
    ),
    pytest.param(
        {"advanced": '{"deepspeed": "ds.json"}'}, "advanced", "args.deepspeed", id="advanced-deepspeed"
    ),
    pytest.param(
        {"advanced": '{"use_liger_kernel": true}'}, "advanced", "args.use_liger_kernel", id="advanced-liger"
    ),
    pytest.param(
        {"advanced": '{"parallelism_config": {"cp_size": 2}}'},
        "advanced",
        "args.parallelism_config",
        id="advanced-context-parallel",
    ),
    pytest.param({"advanced": '{"optim": "nope"}'}, "advanced", "args.optim", id="advanced-optim-unknown"),
    pytest.param({"advanced": '{"top_p": 0.5}'}, "advanced", "args.top_p", id="advanced-top-p-without-top-k"),
    pytest.param(
        {"advanced": '{"model_init_kwargs": {"trust_remote_code": true}}'},
        "advanced",
        "args.model_init_kwargs.trust_remote_code",
        id="advanced-remote-code",
    ),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("overrides", "field", "fragment"), FORM_CASES)
def test_form_refuses_bad_input_beside_the_field(overrides, field, fragment):
    web = Client()
    web.force_login(make_user("alice"))
    response = web.post("/runs/new/", {**FORM_BASE, **overrides})
    assert response.status_code == 400, response.content[:300]
    errors = response.context["form"].errors
    assert field in errors, errors
    assert fragment in " ".join(errors[field]), errors[field]
    nothing_stored()


@pytest.mark.django_db
def test_form_refuses_a_5mb_post_and_anonymous_users():
    web = Client()
    web.force_login(make_user("alice"))
    assert web.post("/runs/new/", {**FORM_BASE, "name": "x" * 5_000_000}).status_code == 400
    anonymous = Client().post("/runs/new/", FORM_BASE)
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]
    assert Client(enforce_csrf_checks=True).post("/runs/new/", FORM_BASE).status_code == 403
    nothing_stored()


# ------------------------------------------------------------ RUN.yaml: validate_run_document
def doc(**top) -> dict:
    return {"model": "tiny", "train_dataset": "arithmetic", "reward_funcs": ["a.b"], **top}


def args(**values) -> dict:
    return doc(args=values)


# (id, document, the errors key that must name the problem)
DOCUMENT_CASES = [
    pytest.param(None, "document", id="none"),
    pytest.param([1, 2], "document", id="list"),
    pytest.param("model: tiny", "document", id="string"),
    pytest.param({}, "model", id="empty"),
    pytest.param(doc(bogus=1), "bogus", id="unknown-top-level"),
    pytest.param(doc(**{"": 1}), "document", id="empty-top-level-key"),
    pytest.param(doc(model=""), "model", id="model-empty"),
    pytest.param(doc(model=["tiny"]), "model", id="model-list"),
    pytest.param(doc(train_dataset=""), "train_dataset", id="dataset-empty"),
    pytest.param(doc(train_dataset=7), "train_dataset", id="dataset-number"),
    pytest.param(doc(reward_funcs=["not a path"]), "reward_funcs[0]", id="reward-not-dotted"),
    pytest.param(doc(reward_funcs=[1]), "reward_funcs[0]", id="reward-number"),
    pytest.param(doc(reward_funcs=[]), "reward_funcs", id="reward-none"),
    pytest.param(doc(tools="a.b"), "tools", id="tools-string"),
    pytest.param(doc(environment_factory=5), "environment_factory", id="env-number"),
    pytest.param(doc(peft_config=[1]), "peft_config", id="peft-list"),
    pytest.param(doc(peft_config={"r": "abc"}), "peft_config.r", id="peft-r-string"),
    pytest.param(doc(peft_config={"r": 0}), "peft_config.r", id="peft-r-0"),
    pytest.param(doc(peft_config={"lora_dropout": 1.5}), "peft_config.lora_dropout", id="peft-dropout"),
    pytest.param(doc(peft_config={"bias": "some"}), "peft_config.bias", id="peft-bias"),
    pytest.param(doc(peft_config={"target_modules": 3}), "peft_config.target_modules", id="peft-targets"),
    pytest.param(
        doc(peft_config={"target_modules": "lm_head"}), "peft_config.target_modules", id="peft-lm-head"
    ),
    pytest.param(doc(args=[1]), "args", id="args-list"),
    pytest.param(args(lr=1), "args.lr", id="unknown-arg"),
    pytest.param(args(learning_rate=-1.0), "args.learning_rate", id="lr-negative"),
    pytest.param(args(learning_rate=math.nan), "args.learning_rate", id="lr-nan"),
    pytest.param(args(temperature=math.inf), "args.temperature", id="temperature-inf"),
    pytest.param(args(temperature=0.0), "args.temperature", id="temperature-0"),
    pytest.param(args(num_generations=1), "args.num_generations", id="num-gen-1"),
    pytest.param(args(num_generations=True), "args.num_generations", id="num-gen-bool"),
    pytest.param(args(max_staleness=-1), "args.max_staleness", id="staleness-negative"),
    pytest.param(args(max_tool_calling_iterations=-1), "args.max_tool_calling_iterations", id="tool-iters"),
    pytest.param(args(vllm_server_base_url="file:///etc/passwd"), "args.vllm_server_base_url", id="vllm-url"),
    pytest.param(
        args(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.0),
        "args.vllm_importance_sampling_clip_min",
        id="is-clip-inverted",
    ),
    pytest.param(args(deepspeed="ds_config.json"), "args.deepspeed", id="deepspeed"),
    pytest.param(args(use_liger_kernel=True), "args.use_liger_kernel", id="liger"),
    pytest.param(args(parallelism_config={"cp_size": 2}), "args.parallelism_config", id="context-parallel"),
    pytest.param(args(parallelism_config={"sp_size": "2"}), "args.parallelism_config", id="sp-size-string"),
    pytest.param(args(ignore_data_skip=False), "args.ignore_data_skip", id="ignore-data-skip-off"),
    pytest.param(args(remove_unused_columns=True), "args.remove_unused_columns", id="remove-unused-columns"),
    pytest.param(args(optim="nope"), "args.optim", id="optim-unknown"),
    pytest.param(args(save_strategy="nope"), "args.save_strategy", id="save-strategy-unknown"),
    pytest.param(args(accelerator_config={"bogus": 1}), "args.accelerator_config", id="accelerator-config"),
    pytest.param(args(model_init_kwargs="{not json"), "args.model_init_kwargs", id="kwargs-bad-json"),
    pytest.param(
        args(chat_template_kwargs="[1]"), "args.chat_template_kwargs", id="template-kwargs-json-list"
    ),
    pytest.param(
        args(gradient_checkpointing_kwargs=[1]), "args.gradient_checkpointing_kwargs", id="gc-kwargs"
    ),
    pytest.param(args(seed=2**40), "args.seed", id="seed-too-big"),
    pytest.param(args(max_steps=10**5000), "args.max_steps", id="max-steps-5000-digits"),
]


@pytest.mark.parametrize(("document", "field"), DOCUMENT_CASES)
def test_run_document_errors_name_the_field(document, field):
    with process_state_kept(), pytest.raises(RunConfigError) as info:
        validate_run_document(document)
    assert field in info.value.errors, info.value.errors
    assert all(isinstance(k, str) and k and v for k, v in info.value.errors.items())


# What only the control plane refuses (it stores the document and never imports what it names).
CONTROL_PLANE_CASES = [
    pytest.param(shared_bomb(), "config", id="shared-reference-bomb"),
    pytest.param(good(lr_scheduler_kwargs=nested(40)), "args.lr_scheduler_kwargs", id="nested-40"),
    pytest.param(
        good(lr_scheduler_kwargs={"when": __import__("datetime").date(2024, 1, 1)}),
        "args.lr_scheduler_kwargs.when",
        id="date-object",
    ),
    pytest.param(good(label_names={"a", "b"}), "args.label_names", id="set-object"),
    pytest.param(good(run_name=b"bytes"), "args.run_name", id="bytes-object"),
    pytest.param(good(lr_scheduler_kwargs={("a",): 1}), "args.lr_scheduler_kwargs", id="tuple-key"),
    pytest.param(good(lr_scheduler_kwargs={"power": math.inf}), "args.lr_scheduler_kwargs.power", id="inf"),
    pytest.param(good(lr_scheduler_kwargs={"a\x00": 1}), "args.lr_scheduler_kwargs.a\\x00", id="nul-in-key"),
    pytest.param(
        good(lr_scheduler_kwargs={"\udcff": 1}), "args.lr_scheduler_kwargs.\\udcff", id="surrogate-key"
    ),
    pytest.param(good(run_name="x" * 70_000), "config", id="70KB"),
    pytest.param(good(report_to=["wandb"]), "args.report_to", id="report-to-wandb"),
    pytest.param(good(push_to_hub=True), "args.push_to_hub", id="push-to-hub"),
    pytest.param(good(resume_from_checkpoint="/tmp/x"), "args.resume_from_checkpoint", id="resume-path"),
    pytest.param(good(vllm_server_base_url="http://169.254.169.254"), "args.vllm_server_base_url", id="ssrf"),
]


@pytest.mark.parametrize(("document", "field"), CONTROL_PLANE_CASES)
def test_control_plane_validation_names_the_field(document, field):
    with process_state_kept(), pytest.raises(RunConfigError) as info:
        run_document_validate(document=document)
    # the path may go deeper than the field (args.lr_scheduler_kwargs.k.k...: where the depth ran out)
    assert any(path == field or path.startswith(field + ".") for path in info.value.errors), info.value.errors


# ------------------------------------------------------------- RUN.yaml through the CLI
CLI_CASES = [
    pytest.param(
        "model: tiny\ntrain_dataset: arithmetic\nreward_funcs: [trainer.rewards.accuracy_reward]\n"
        "args:\n  learning_rate: -0.5\n",
        "args.learning_rate",
        id="negative-learning-rate",
    ),
    pytest.param(b"- model\n- tiny\n", "document", id="yaml-not-a-mapping"),
    pytest.param(b"model: tiny\nname: \xff\xfe\n", "config", id="not-utf8"),
]


@pytest.mark.parametrize(("content", "field"), CLI_CASES)
def test_cli_reports_one_line_naming_the_field(tmp_path, content, field):
    path = tmp_path / "BAD.yaml"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"error: {path}: {field}: "), errors
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------- the run stream websocket
LOCAL = (b"origin", b"http://localhost")
# (id, path with {run}/{missing}/{token}/{bob}/{inactive} filled in, headers, outcome)
# outcome: ("closed", code) after the handshake, or ("refused", None) at the handshake
WS_CASES = [
    pytest.param("/ws/runs/{run}/", [LOCAL], ("closed", CLOSE_UNAUTHENTICATED), id="no-login"),
    pytest.param(
        "/ws/runs/{run}/?token=not-a-token", [LOCAL], ("closed", CLOSE_UNAUTHENTICATED), id="bad-token"
    ),
    pytest.param("/ws/runs/{run}/?token=%00%ff", [LOCAL], ("closed", CLOSE_UNAUTHENTICATED), id="nul-token"),
    pytest.param(
        "/ws/runs/{run}/?token=" + "a" * 10_000, [LOCAL], ("closed", CLOSE_UNAUTHENTICATED), id="10k-token"
    ),
    pytest.param(
        "/ws/runs/{run}/?token={inactive}", [LOCAL], ("closed", CLOSE_UNAUTHENTICATED), id="inactive-user"
    ),
    pytest.param("/ws/runs/{run}/?token={bob}", [LOCAL], ("closed", CLOSE_NOT_FOUND), id="other-users-run"),
    pytest.param("/ws/runs/{missing}/?token={token}", [LOCAL], ("closed", CLOSE_NOT_FOUND), id="missing-run"),
    pytest.param(
        "/ws/runs/99999999999999999999/?token={token}", [LOCAL], ("closed", CLOSE_NOT_FOUND), id="huge-run-id"
    ),
    pytest.param(
        "/ws/runs/{run}/?token={token}",
        [(b"origin", b"http://evil.example")],
        ("refused", None),
        id="foreign-origin",
    ),
    pytest.param(
        "/ws/runs/{run}/?token={token}", [(b"origin", b"null")], ("refused", None), id="null-origin"
    ),
    pytest.param(
        "/ws/runs/{run}/?token={token}",
        [(b"origin", b"http://localhost.evil.example")],
        ("refused", None),
        id="lookalike-origin",
    ),
    # Issue 29 item 8: an allowed host on another port or scheme is another site.
    pytest.param(
        "/ws/runs/{run}/?token={token}",
        [(b"host", b"127.0.0.1:8130"), (b"origin", b"http://127.0.0.1:9999")],
        ("refused", None),
        id="origin-other-port",
    ),
    pytest.param(
        "/ws/runs/{run}/?token={token}",
        [(b"host", b"127.0.0.1:8130"), (b"origin", b"https://127.0.0.1:8130")],
        ("refused", None),
        id="origin-other-scheme",
    ),
    pytest.param(
        "/ws/runs/{run}/?token={token}",
        [(b"host", b"localhost"), (b"origin", b"https://localhost")],
        ("refused", None),
        id="origin-https-for-a-plain-socket",
    ),
    pytest.param(
        "/ws/runs/{run}/?token={token}",
        [(b"host", b"127.0.0.1:8130"), (b"origin", b"http://127.0.0.1:8130")],
        ("open", None),
        id="origin-same-site",
    ),
]


async def ws_outcome(path: str, headers: list, timeout: float = 10) -> tuple[str, int | None]:
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, _ = await comm.connect(timeout=timeout)
    if not connected:
        return "refused", None
    first = await comm.receive_output(timeout=10)
    if first["type"] == "websocket.close":
        return "closed", first.get("code")
    await comm.disconnect()
    return "open", None


def ws_world() -> dict:
    alice, _ = make_user("alice"), make_user("bob")
    make_user("carol", is_active=False)
    run = Run.objects.create(owner=alice, name="ws", config=good(), config_sha256="0" * 64)
    return {
        "run": run.pk,
        "missing": run.pk + 1000,
        "token": services.token_issue(username="alice"),
        "bob": services.token_issue(username="bob"),
        "inactive": services.token_issue(username="carol"),
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("path", "headers", "outcome"), WS_CASES)
def test_websocket_refuses_bad_handshakes(path, headers, outcome):
    world = ws_world()
    assert run_async(ws_outcome(path.format(**world), headers)) == outcome
    # the same socket with a good token and a local Origin is let in
    assert run_async(ws_outcome(f"/ws/runs/{world['run']}/?token={world['token']}", [LOCAL]))[0] == "open"


@pytest.mark.django_db(transaction=True)
def test_websocket_origins_listed_as_trusted_pass_behind_a_proxy(settings):
    """A TLS proxy in front (the socket arrives as plain ws on another host:port): the deployment lists
    its public origin in CSRF_TRUSTED_ORIGINS, or sets SECURE_PROXY_SSL_HEADER for the scheme."""
    world = ws_world()
    path = f"/ws/runs/{world['run']}/?token={world['token']}"
    public = [(b"host", b"127.0.0.1:8130"), (b"origin", b"https://grpo.example.com")]
    assert run_async(ws_outcome(path, public))[0] == "refused"
    settings.CSRF_TRUSTED_ORIGINS = ["https://grpo.example.com"]
    assert run_async(ws_outcome(path, public))[0] == "open"
    proxied = [(b"host", b"localhost"), (b"origin", b"https://localhost"), (b"x-forwarded-proto", b"https")]
    assert run_async(ws_outcome(path, proxied))[0] == "refused"
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    assert run_async(ws_outcome(path, proxied))[0] == "open"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("run_id", ["abc", "-1", "1.5", "%00"])
def test_websocket_non_integer_run_id_is_closed_4404(run_id):
    world = ws_world()
    # (the communicator reports the application's exception once its wait times out)
    outcome = run_async(ws_outcome(f"/ws/runs/{run_id}/?token={world['token']}", [LOCAL], timeout=2))
    assert outcome == ("closed", CLOSE_NOT_FOUND)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "frame", [{"text_data": "not json"}, {"bytes_data": b"\x00\xff"}], ids=["text", "binary"]
)
def test_websocket_malformed_client_frames_are_ignored(frame):
    world = ws_world()

    async def scenario():
        comm = WebsocketCommunicator(
            application, f"/ws/runs/{world['run']}/?token={world['token']}", headers=[LOCAL]
        )
        assert (await comm.connect(timeout=10))[0]
        await comm.receive_json_from(timeout=10)  # the status snapshot
        await comm.send_to(**frame)
        await comm.send_json_to({"type": "ping"})
        assert await comm.receive_json_from(timeout=2) == {"type": "pong"}
        await comm.disconnect()

    run_async(scenario())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "frame",
    [{"text_data": "x" * (64 * 1024 + 1)}, {"bytes_data": b"\x00" * (64 * 1024 + 1)}],
    ids=["text", "binary"],
)
def test_websocket_frame_over_the_limit_is_closed_by_the_consumer_with_4413(frame, settings):
    """The consumer's own check (daphne closes first with 1009: tests/test_ws_connect_burst.py)."""
    settings.GRPO_WS_MAX_FRAME_BYTES = 64 * 1024
    world = ws_world()

    async def scenario():
        comm = WebsocketCommunicator(
            application, f"/ws/runs/{world['run']}/?token={world['token']}", headers=[LOCAL]
        )
        assert (await comm.connect(timeout=10))[0]
        await comm.receive_json_from(timeout=10)  # the status snapshot
        await comm.send_to(text_data="x" * 1000)  # under the limit: ignored (not JSON), socket stays
        await comm.send_to(**frame)
        closed = await comm.receive_output(timeout=5)
        assert closed == {"type": "websocket.close", "code": CLOSE_TOO_BIG}

    run_async(scenario())


# ------------------------------------------------------- property: validation never crashes
CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig) if f.init}
FIELD_NAMES = sorted(CONFIG_FIELDS)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, -1, 8, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["none", "steps", "adamw_torch", "auto", "float32", "http://x", "{}", "[1]", "a.b"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
SMALL_INTS = st.integers(min_value=-2, max_value=16) | st.sampled_from([0, 1, 2**31, 2**63])
SMALL_FLOATS = st.floats(min_value=-1, max_value=10) | st.sampled_from(
    [0.0, 1e-6, math.nan, math.inf, -math.inf]
)


def field_value(name: str) -> st.SearchStrategy:
    """Mostly values of the field's own type (so AsyncGRPOConfig itself gets built and gets to
    refuse), sometimes anything at all."""
    default = CONFIG_FIELDS[name].default
    if isinstance(default, bool):
        typed = st.booleans()
    elif isinstance(default, int):
        typed = SMALL_INTS
    elif isinstance(default, float):
        typed = SMALL_FLOATS | SMALL_INTS
    elif isinstance(default, str):
        typed = st.sampled_from([default, "", "none", "steps", "auto", "nope", "http://x"]) | st.text(
            max_size=8
        )
    else:
        typed = st.none() | SCALARS
    return st.one_of(typed, typed, typed, VALUES)


KNOWN_ARGS = st.lists(st.sampled_from(FIELD_NAMES), max_size=5, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: field_value(name) for name in names})
)
ARGS = st.one_of(
    KNOWN_ARGS,
    KNOWN_ARGS,
    KNOWN_ARGS,
    st.tuples(KNOWN_ARGS, st.dictionaries(st.text(min_size=1, max_size=10), VALUES, max_size=2)).map(
        lambda pair: {**pair[0], **pair[1]}
    ),
    VALUES,
)


def mostly(valid, anything=VALUES) -> st.SearchStrategy:
    return st.one_of(st.just(valid), st.just(valid), st.just(valid), anything)


DOCUMENTS = st.one_of(
    *[
        st.fixed_dictionaries(
            {
                "model": mostly("tiny", st.sampled_from(["Qwen/Qwen3-0.6B", "/etc", ""]) | VALUES),
                "train_dataset": mostly("arithmetic", st.sampled_from(["../../etc/passwd", ""]) | VALUES),
                "reward_funcs": mostly(
                    [GOOD_REWARD],
                    st.lists(st.sampled_from([GOOD_REWARD, "os.system", "nope"]) | VALUES, max_size=3),
                ),
                "args": ARGS,
            },
            optional={
                "tools": st.lists(st.sampled_from(["trainer.builtin_tools.add", "os.system"]), max_size=2)
                | VALUES,
                "environment_factory": VALUES,
                "peft_config": st.dictionaries(
                    st.sampled_from(["r", "lora_alpha", "lora_dropout", "bias", "target_modules", "x"]),
                    SMALL_INTS | SMALL_FLOATS | VALUES,
                    max_size=3,
                )
                | VALUES,
                "": VALUES,
                "unknown": VALUES,
            },
        )
    ]
    * 3,
    VALUES,
)


def assert_field_paths(errors: dict, document) -> None:
    assert errors, "RunConfigError without errors"
    tops = set(TOP_LEVEL_KEYS) | {"document", "config"}
    if isinstance(document, dict):
        keys = [str(k) for k in document]
        # the control plane escapes NUL and surrogates in the paths it sends back
        tops |= {
            *keys,
            *(k.encode("utf-8", "backslashreplace").decode().replace("\x00", "\\x00") for k in keys),
        }
    for path, message in errors.items():
        assert isinstance(path, str) and path, errors
        assert any(path == top or path.startswith((top + ".", top + "[")) for top in tops), errors
        assert isinstance(message, str) and message, errors


@hypothesis_settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(DOCUMENTS)
def test_validation_of_random_documents_only_ever_raises_run_config_error(document):
    """Random subsets of real AsyncGRPOConfig fields with random JSON-ish values (and unknown keys)."""
    for layer, validate in (
        ("trainer", validate_run_document),
        ("control plane", lambda d: run_document_validate(document=d)),
    ):
        try:
            with process_state_kept():
                validate(document)
        except RunConfigError as exc:
            assert_field_paths(exc.errors, document)
            where = "args" if any(k.startswith("args.") for k in exc.errors) else "elsewhere"
            event(f"{layer}: refused, {where}")  # --hypothesis-show-statistics shows the mix
        else:
            event(f"{layer}: accepted")


def test_deep_yaml_is_refused_while_it_is_read_not_after():
    """The bound is on the parse itself: the flow-nesting scan (or the parser's event stream, for
    block nesting) stops at the limit instead of building 32,000 levels first."""
    from controlplane.runs.serializers import yaml_depth_error

    assert yaml_depth_error("[" * 31900 + "]" * 31900) == "is nested deeper than 32 levels"
    block = "".join(" " * i + f"k{i}:\n" for i in range(40)) + " " * 40 + "v\n"
    assert yaml_depth_error(block) == "is nested deeper than 32 levels"
    assert (
        yaml_depth_error("model: tiny\nargs: {max_steps: 3, report_to: ['none']}\nname: \"[[[[\"\n") is None
    )
