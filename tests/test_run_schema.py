"""The run schema (trainer/config/run_schema.py): one table of what ``args`` may set, checked without
transformers, equal to AsyncGRPOConfig's fields and to the installed TrainingArguments (issue 20)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest

from tests.conftest import REPO
from trainer.config import run_schema, training_args_fields
from trainer.config.async_grpo_config import AsyncGRPOConfig, json_kinds
from trainer.config.async_grpo_config import training_args_fields as generated_fields
from trainer.config.run_config import RunConfigError, run_document_errors, validate_run_document

GOOD = {"model": "tiny", "train_dataset": "arithmetic", "reward_funcs": ["trainer.rewards.accuracy_reward"]}


def test_the_committed_training_args_fields_are_current():
    """Fails when transformers changed: regenerate with trainer.config.async_grpo_config.write_training_args_fields()."""
    assert generated_fields() == training_args_fields.TRAINING_ARGS_FIELDS, (
        "regenerate trainer/config/training_args_fields.py: "
        "python -c 'from trainer.config.async_grpo_config import write_training_args_fields as w; w()' && ruff format"
    )


def test_the_schema_has_every_config_field_with_its_default_and_json_type():
    hints = typing.get_type_hints(AsyncGRPOConfig)
    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig) if f.init}
    assert set(run_schema.FIELDS) == set(fields)
    for name, f in fields.items():
        spec = run_schema.FIELDS[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert spec.default == getattr(default, "value", default), name
        kinds, nullable, str_items = json_kinds(hints[name])
        assert set(spec.kinds) == {k.__name__ for k in kinds}, name
        assert (spec.nullable, spec.str_items) == (nullable, str_items), name
    # The spec fields' help is what docs/config.md shows.
    for spec in run_schema.SPEC_FIELDS:
        assert fields[spec.name].metadata["help"] == spec.help


def test_validating_a_document_imports_no_transformers():
    code = (
        "import json, sys\n"
        "from trainer.config.run_config import run_document_errors\n"
        "from trainer.config import run_schema\n"
        "from trainer.reporting import diagnosis\n"
        "errors = run_document_errors(json.loads(sys.argv[1]))\n"
        "heavy = sorted(m for m in ('transformers', 'torch', 'accelerate') if m in sys.modules)\n"
        "print(json.dumps({'errors': errors, 'heavy': heavy}))\n"
    )
    doc = {**GOOD, "args": {"optim": "nope", "top_p": 0.5, "accelerator_config": {"bogus": 1}}}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(doc)], cwd=REPO, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    assert result["heavy"] == []
    assert {"args.optim", "args.top_p", "args.accelerator_config"} <= set(result["errors"])


@pytest.mark.parametrize(
    ("args", "field", "fragment"),
    [
        ({"optim": "nope"}, "optim", "must be one of"),
        ({"lr_scheduler_type": "nope"}, "lr_scheduler_type", "constant"),
        ({"save_strategy": "nope"}, "save_strategy", "must be one of"),
        ({"debug": "underflow_overflow nope"}, "debug", "'nope'"),
        ({"accelerator_config": {"bogus": 1}}, "accelerator_config", "unknown key 'bogus'"),
        ({"top_p": 0.5}, "top_p", "needs top_k"),
        ({"score_centering": True, "num_sampler_logprobs": 0}, "num_sampler_logprobs", "score_centering"),
        ({"model_init_kwargs": "{not json"}, "model_init_kwargs", "not valid JSON"),
        ({"dtype": "int8"}, "dtype", "float32"),
    ],
)
def test_args_errors_name_the_field(args, field, fragment):
    errors = run_schema.args_errors(args)
    assert fragment in errors[field], errors


def test_every_problem_of_args_is_reported_at_once():
    """AsyncGRPOConfig stops at its first refusal; the schema reports them all."""
    errors = run_schema.args_errors(
        {"num_generations": 1, "temperature": 0, "top_p": 0.5, "optim": "nope", "nope": 1, "seed": "x"}
    )
    assert set(errors) == {"num_generations", "temperature", "top_p", "optim", "nope", "seed"}


def test_valid_args_pass_and_build_the_same_config():
    args = {"num_generations": 4, "top_p": 0.9, "top_k": 64, "optim": "adamw_torch", "debug": ""}
    assert run_document_errors({**GOOD, "args": args}) == {}
    spec = validate_run_document({**GOOD, "args": args}, output_dir="/tmp/unused-schema")
    assert spec.args.top_k == 64


def test_the_cli_reports_runtime_refusals_of_transformers_per_field():
    """What needs transformers (its own cross-field rules) is refused when the trainer builds the
    config, still naming the field."""
    doc = {**GOOD, "args": {"dataloader_prefetch_factor": 2}}  # needs dataloader_num_workers > 0
    assert run_document_errors(doc) == {}
    with pytest.raises(RunConfigError) as info:
        validate_run_document(doc, output_dir="/tmp/unused-schema")
    assert all(key.startswith("args") for key in info.value.errors), info.value.errors


def test_the_web_validates_a_document_without_transformers():
    """The control plane's modules and its validation (services.run_create's) import no transformers
    for a document the schema refuses (the preflight, which reads the model's tokenizer, runs only on
    documents that pass: controlplane/runs/launch_checks.py)."""
    code = (
        "import json, sys, django\n"
        "django.setup()\n"
        "from controlplane.runs import api, forms, selectors, serializers, services, views\n"
        "from trainer.config.run_config import RunConfigError\n"
        "try:\n"
        "    services.run_config_validate(config=json.loads(sys.argv[1]))\n"
        "except RunConfigError as exc:\n"
        "    errors = exc.errors\n"
        "defaults = selectors.main_arg_defaults()\n"
        "heavy = sorted(m for m in ('transformers', 'torch', 'accelerate') if m in sys.modules)\n"
        "print(json.dumps({'errors': errors, 'heavy': heavy, 'defaults': defaults}))\n"
    )
    doc = {**GOOD, "args": {"optim": "nope", "trust_remote_code": True}}
    env = {**__import__("os").environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(doc)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert {"args.optim", "args.trust_remote_code"} <= set(result["errors"])
    assert result["defaults"]["num_generations"] == AsyncGRPOConfig.num_generations


def test_the_api_serializer_only_reads_the_document():
    """Validation is run_create's (once per launch); the serializer parses YAML text and no more."""
    from controlplane.runs.serializers import RunCreateInputSerializer

    serializer = RunCreateInputSerializer(data={"config": "model: tiny\nargs: {num_generations: 1}\n"})
    assert serializer.is_valid(), serializer.errors
    assert serializer.validated_data["config"] == {"model": "tiny", "args": {"num_generations": 1}}
