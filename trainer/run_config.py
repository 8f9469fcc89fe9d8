"""RUN.yaml: the document that describes one training run (MISSION.md's contract).

Top-level keys: ``model`` (hub id, local dir or ``tiny``), ``train_dataset`` (registry name, local
JSONL or ``datasets`` directory), ``reward_funcs`` (list of dotted import paths), optional ``tools``
(dotted paths), ``environment_factory`` (dotted path, or a mapping name → dotted path),
``peft_config`` (LoraConfig keyword arguments), and ``args`` (AsyncGRPOConfig fields by their spec
names). :func:`validate_run_document` checks a document without importing anything it names
(the control plane calls it on untrusted input); :func:`load_run_document` resolves it for the
trainer CLI.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TOP_LEVEL_KEYS = (
    "model",
    "train_dataset",
    "reward_funcs",
    "tools",
    "environment_factory",
    "peft_config",
    "args",
)
REQUIRED_KEYS = ("model",)
# LoraConfig fields a run document may set (the rest keep peft's defaults).
PEFT_KEYS = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "modules_to_save")


class RunConfigError(ValueError):
    """A run document is invalid. ``errors`` maps a field path (``args.learning_rate``) to a message."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()))


@dataclass
class RunSpec:
    """A validated run document with its ``args`` turned into an :class:`AsyncGRPOConfig`."""

    model: str
    train_dataset: str | None
    reward_funcs: list[str]
    tools: list[str] = field(default_factory=list)
    environment_factory: str | dict[str, str] | None = None
    peft_config: dict[str, Any] | None = None
    args: Any = None  # AsyncGRPOConfig


def config_field_names() -> set[str]:
    """Every field name ``args`` may set (AsyncGRPOConfig = TrainingArguments + the spec's fields)."""
    from trainer.config import AsyncGRPOConfig

    return {f.name for f in dataclasses.fields(AsyncGRPOConfig) if f.init}


def _is_dotted_path(value: Any) -> bool:
    return isinstance(value, str) and "." in value and all(p.isidentifier() for p in value.split("."))


def validate_run_document(doc: Any, *, output_dir: str | None = None) -> RunSpec:
    """Check a run document's shape and build its AsyncGRPOConfig; imports nothing the document names.

    Raises :class:`RunConfigError` with one message per offending field path.
    """
    from trainer.config import AsyncGRPOConfig

    if not isinstance(doc, dict):
        raise RunConfigError({"document": "must be a mapping with keys " + ", ".join(TOP_LEVEL_KEYS)})
    errors: dict[str, str] = {}
    for key in doc:
        if key not in TOP_LEVEL_KEYS:
            errors[str(key)] = f"unknown key; allowed: {', '.join(TOP_LEVEL_KEYS)}"
    for key in REQUIRED_KEYS:
        if not doc.get(key):
            errors[key] = "required"
    model = doc.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        errors["model"] = "must be a non-empty string (hub id, local directory or 'tiny')"
    dataset = doc.get("train_dataset")
    if dataset is not None and not isinstance(dataset, str):
        errors["train_dataset"] = "must be a string (registry name, .jsonl file or datasets directory)"
    if dataset is None and not doc.get("environment_factory"):
        errors.setdefault("train_dataset", "required unless environment_factory provides the prompts")
    reward_funcs = doc.get("reward_funcs") or []
    if isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]
    if not isinstance(reward_funcs, list):
        errors["reward_funcs"] = "must be a list of dotted import paths"
        reward_funcs = []
    for i, path in enumerate(reward_funcs):
        if not _is_dotted_path(path):
            errors[f"reward_funcs[{i}]"] = (
                f"{path!r} is not a dotted import path like 'package.module.function'"
            )
    if not reward_funcs and not doc.get("environment_factory"):
        errors.setdefault(
            "reward_funcs", "at least one reward function is required (or an environment_factory)"
        )
    tools = doc.get("tools") or []
    if not isinstance(tools, list):
        errors["tools"] = "must be a list of dotted import paths"
        tools = []
    for i, path in enumerate(tools):
        if not _is_dotted_path(path):
            errors[f"tools[{i}]"] = f"{path!r} is not a dotted import path"
    env = doc.get("environment_factory")
    if env is not None:
        if isinstance(env, dict):
            for name, path in env.items():
                if not _is_dotted_path(path):
                    errors[f"environment_factory.{name}"] = f"{path!r} is not a dotted import path"
        elif not _is_dotted_path(env):
            errors["environment_factory"] = "must be a dotted import path or a mapping name -> dotted path"
    peft = doc.get("peft_config")
    if peft is not None:
        if not isinstance(peft, dict):
            errors["peft_config"] = "must be a mapping of LoraConfig fields"
        else:
            for key in peft:
                if key not in PEFT_KEYS:
                    errors[f"peft_config.{key}"] = (
                        f"unknown LoraConfig field; allowed: {', '.join(PEFT_KEYS)}"
                    )
            targets = peft.get("target_modules")
            if targets == "lm_head" or (isinstance(targets, list) and "lm_head" in targets):
                errors["peft_config.target_modules"] = "adapters on lm_head are not supported; remove lm_head"
    raw_args = doc.get("args") or {}
    config = None
    if not isinstance(raw_args, dict):
        errors["args"] = "must be a mapping of AsyncGRPOConfig fields"
    else:
        allowed = config_field_names()
        unknown = [k for k in raw_args if k not in allowed]
        for key in unknown:
            errors[f"args.{key}"] = "unknown AsyncGRPOConfig field (see docs/config.md)"
        for key, message in _type_errors(raw_args).items():
            errors[f"args.{key}"] = message
        if not any(k.startswith("args.") for k in errors):
            kwargs = dict(raw_args)
            if output_dir is not None:
                kwargs["output_dir"] = output_dir
            try:
                config = AsyncGRPOConfig(**kwargs)
            except (ValueError, TypeError) as exc:
                errors[_field_of_error(str(exc), raw_args)] = str(exc)
    if errors:
        raise RunConfigError(errors)
    return RunSpec(
        model=model,
        train_dataset=dataset,
        reward_funcs=list(reward_funcs),
        tools=list(tools),
        environment_factory=env,
        peft_config=peft,
        args=config,
    )


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _scalar_types(annotation: Any) -> tuple[set[type], bool] | None:
    """The scalar types a field accepts and whether None is allowed; None when not a plain scalar."""
    import types
    import typing

    args = (
        typing.get_args(annotation)
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
        else (annotation,)
    )
    allowed = {a for a in args if a in _SCALARS}
    others = [a for a in args if a not in _SCALARS and a is not type(None)]
    if not allowed or others:
        return None
    return allowed, type(None) in args


def _type_errors(raw_args: dict) -> dict[str, str]:
    """Type-check scalar ``args`` values against AsyncGRPOConfig's annotations."""
    import typing

    from trainer.config import AsyncGRPOConfig

    hints = typing.get_type_hints(AsyncGRPOConfig)
    errors = {}
    for key, value in raw_args.items():
        spec = _scalar_types(hints.get(key))
        if spec is None:
            continue
        allowed, nullable = spec
        if value is None:
            if not nullable:
                errors[key] = "must not be null"
            continue
        ok = (
            (bool in allowed and isinstance(value, bool))
            or (int in allowed and isinstance(value, int) and not isinstance(value, bool))
            or (float in allowed and isinstance(value, int | float) and not isinstance(value, bool))
            or (str in allowed and isinstance(value, str))
        )
        if not ok:
            expected = " or ".join(_SCALARS[t] for t in (bool, int, float, str) if t in allowed)
            errors[key] = f"must be {expected}, got {type(value).__name__} {value!r}"
    return errors


def _field_of_error(message: str, raw_args: dict) -> str:
    """Best-effort field path for a config error: the first ``args`` key the message names."""
    head = message.split(":", 1)[0]
    for key in sorted(raw_args, key=len, reverse=True):
        if key in head:
            return f"args.{key}"
    for key in sorted(config_field_names(), key=len, reverse=True):
        if head.startswith(key):
            return f"args.{key}"
    return "args"


def read_run_file(path: str | Path) -> dict:
    """Parse a RUN.yaml file (safe YAML); errors name the file."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise RunConfigError({"config": f"cannot read {path}: {exc.strerror}"}) from exc
    except yaml.YAMLError as exc:
        raise RunConfigError({"config": f"{path} is not valid YAML: {exc}"}) from exc
    return doc
