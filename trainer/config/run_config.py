"""RUN.yaml: the document that describes one training run (MISSION.md's contract).

Top-level keys: ``model`` (hub id, local dir or ``tiny``), ``train_dataset`` (registry name, local
JSONL or ``datasets`` directory), ``reward_funcs`` (list of dotted import paths), optional ``tools``
(dotted paths), ``environment_factory`` (dotted path, or a mapping name → dotted path),
``peft_config`` (LoraConfig keyword arguments), hub options (``model_revision``;
``dataset_revision``, ``dataset_config``, ``dataset_split`` (default ``train``) and ``dataset_columns``,
a map from the dataset's column names to the ones the run reads, e.g. ``{question: prompt}``),
``resources`` (GPUs, processes, vLLM parallelism or a named server: :mod:`trainer.config.resources`), ``loop_cls`` (dotted path of an
:class:`~trainer.rollout.loop.AsyncRolloutLoop` subclass, the spec's ``loop_cls``), and ``args`` (AsyncGRPOConfig fields by their spec
names, checked by the run schema :mod:`trainer.config.run_schema`). :func:`run_document_errors` checks a
document without importing transformers or anything it names (the control plane calls it on untrusted
input); :func:`validate_run_document` checks it the same way and then builds its AsyncGRPOConfig for
the trainer CLI.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.config.resources import parse_resources, resources_errors
from trainer.config.run_schema import FIELDS, args_errors
from trainer.config.run_schema import short_repr as _short_repr

TOP_LEVEL_KEYS = (
    "model",
    "train_dataset",
    "reward_funcs",
    "tools",
    "environment_factory",
    "peft_config",
    "loop_cls",
    "model_revision",
    "dataset_revision",
    "dataset_config",
    "dataset_split",
    "dataset_columns",
    "eval_dataset",
    "eval_dataset_revision",
    "eval_dataset_config",
    "eval_dataset_split",
    "resources",
    "args",
)
# The split an eval dataset is read from when eval_dataset_split is not given (a registered dataset,
# a .jsonl file or a one-split directory has one split whatever is asked).
DEFAULT_EVAL_SPLIT = "test"
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
    loop_cls: str | None = None
    model_revision: str | None = None
    dataset_revision: str | None = None
    dataset_config: str | None = None
    dataset_split: str = "train"
    dataset_columns: dict[str, str] = field(default_factory=dict)
    # Held-out prompts scored during training (an extension, issue 30): the same forms as
    # train_dataset, read with the same dataset_columns map.
    eval_dataset: str | None = None
    eval_dataset_revision: str | None = None
    eval_dataset_config: str | None = None
    eval_dataset_split: str = DEFAULT_EVAL_SPLIT
    resources: Any = None  # trainer.config.resources.Resources (used by the control plane's worker)
    args: Any = None  # AsyncGRPOConfig


def config_field_names() -> set[str]:
    """Every field name ``args`` may set (AsyncGRPOConfig = TrainingArguments + the spec's fields)."""
    return set(FIELDS)


def _is_dotted_path(value: Any) -> bool:
    return isinstance(value, str) and "." in value and all(p.isidentifier() for p in value.split("."))


def run_document_errors(doc: Any) -> dict[str, str]:
    """Every problem of a run document as ``{field path: message}`` (``{}``: valid), from the run
    schema alone (:mod:`trainer.config.run_schema`): imports neither transformers nor anything it names.
    The web (``services.run_create``) and the trainer CLI both check documents with this."""
    if not isinstance(doc, dict):
        return {"document": "must be a mapping with keys " + ", ".join(TOP_LEVEL_KEYS)}
    errors: dict[str, str] = {}
    for key in doc:
        if key not in TOP_LEVEL_KEYS:
            errors[str(key) or "document"] = (
                f"unknown key {_short_repr(key)}; allowed: {', '.join(TOP_LEVEL_KEYS)}"
            )
    for key in REQUIRED_KEYS:
        if not doc.get(key):
            errors[key] = "required"
    model = doc.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        errors["model"] = "must be a non-empty string (hub id, local directory or 'tiny')"
    dataset = doc.get("train_dataset")
    if dataset is not None and (not isinstance(dataset, str) or not dataset.strip()):
        errors["train_dataset"] = (
            "must be a non-empty string (registry name, .jsonl file or datasets directory)"
        )
    if dataset is None and not doc.get("environment_factory"):
        errors.setdefault("train_dataset", "required unless environment_factory provides the prompts")
    eval_dataset = doc.get("eval_dataset")
    if eval_dataset is not None and (not isinstance(eval_dataset, str) or not eval_dataset.strip()):
        errors["eval_dataset"] = (
            "must be a non-empty string (registry name, .jsonl file or datasets directory), or left out"
        )
    reward_funcs = doc.get("reward_funcs") or []
    if isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]
    if not isinstance(reward_funcs, list):
        errors["reward_funcs"] = "must be a list of dotted import paths"
        reward_funcs = []
    for i, path in enumerate(reward_funcs):
        if not _is_dotted_path(path):
            errors[f"reward_funcs[{i}]"] = (
                f"{_short_repr(path)} is not a dotted import path like 'package.module.function'"
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
            errors[f"tools[{i}]"] = f"{_short_repr(path)} is not a dotted import path"
    env = doc.get("environment_factory")
    if env is not None:
        if isinstance(env, dict):
            for name, path in env.items():
                if not _is_dotted_path(path):
                    errors[f"environment_factory.{name}"] = f"{_short_repr(path)} is not a dotted import path"
        elif not _is_dotted_path(env):
            errors["environment_factory"] = "must be a dotted import path or a mapping name -> dotted path"
    errors.update(_hub_option_errors(doc))
    errors.update(resources_errors(doc.get("resources")))
    loop_cls = doc.get("loop_cls")
    if loop_cls is not None and not _is_dotted_path(loop_cls):
        errors["loop_cls"] = (
            f"{_short_repr(loop_cls)} is not a dotted import path of an AsyncRolloutLoop subclass"
        )
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
            errors.update({f"peft_config.{k}": m for k, m in _peft_value_errors(peft).items()})
            targets = peft.get("target_modules")
            if targets == "lm_head" or (isinstance(targets, list) and "lm_head" in targets):
                errors["peft_config.target_modules"] = "adapters on lm_head are not supported; remove lm_head"
    # A missing `args` is the spec's defaults; anything else that is not a mapping (null, [], "", 0,
    # false) is refused rather than read as "no args".
    raw_args = doc.get("args", {})
    if not isinstance(raw_args, dict):
        errors["args"] = (
            f"must be a mapping of AsyncGRPOConfig fields (or left out), got {_short_repr(raw_args)}"
        )
    else:
        errors.update({f"args.{key}": message for key, message in args_errors(raw_args).items()})
        for path, message in _launch_rule_errors(doc, raw_args).items():
            errors.setdefault(path, message)
    return errors


def _launch_rule_errors(doc: dict, args: dict) -> dict[str, str]:
    """Rules between ``args`` and the rest of the document that the trainer enforces when it starts:
    an environment without a dataset makes prompts forever (so ``max_steps`` must end the run), and
    transformers runs FSDP only over several processes."""
    from trainer.config.run_schema import DEFAULTS

    errors: dict[str, str] = {}
    max_steps = args.get("max_steps", DEFAULTS["max_steps"])
    if (
        doc.get("train_dataset") is None
        and doc.get("environment_factory")
        and isinstance(max_steps, int)
        and max_steps <= 0
    ):
        errors["args.max_steps"] = (
            "without train_dataset the environment makes prompts forever: set max_steps > 0"
        )
    strategy = args.get("eval_strategy", "no")
    evaluates = isinstance(strategy, str) and strategy != "no"
    if evaluates and not doc.get("eval_dataset"):
        errors["args.eval_strategy"] = (
            f"{strategy!r} evaluates on eval_dataset, which the document does not name: set eval_dataset "
            "(held-out prompts, the same forms as train_dataset) or leave eval_strategy 'no'"
        )
    if doc.get("eval_dataset") and not evaluates:
        errors["eval_dataset"] = (
            "is set but args.eval_strategy is 'no', so it would never be scored: set args.eval_strategy "
            "to 'steps' (with args.eval_steps) or 'epoch', or leave eval_dataset out"
        )
    if args.get("eval_on_start") and not doc.get("eval_dataset"):
        errors["args.eval_on_start"] = "needs eval_dataset: set it, or leave eval_on_start false"
    if args.get("fsdp") and not resources_errors(doc.get("resources")):
        resources = parse_resources(doc.get("resources"))
        if (resources.trainer_gpus or resources.trainer_processes or 1) < 2:
            errors["args.fsdp"] = (
                "FSDP shards the model over several trainer processes and this run has one: set "
                "resources.trainer.gpus (a GPU worker) or resources.trainer.processes (a CPU worker) above 1, "
                "or leave fsdp unset"
            )
    return errors


def validate_run_document(doc: Any, *, output_dir: str | None = None) -> RunSpec:
    """Check a run document (:func:`run_document_errors`) and build its AsyncGRPOConfig, which adds
    the checks that need the runtime (TrainingArguments' own rules, CUDA); imports nothing the
    document names.

    Raises :class:`RunConfigError` with one message per offending field path.
    """
    errors = run_document_errors(doc)
    if errors:
        raise RunConfigError(errors)
    raw_args = doc.get("args", {})
    kwargs = dict(raw_args)
    if output_dir is not None:
        kwargs["output_dir"] = output_dir
    from trainer.config.async_grpo_config import (
        AsyncGRPOConfig,  # transformers: imported only to build the config
    )

    try:
        config = AsyncGRPOConfig(**kwargs)
    except Exception as exc:  # whatever refuses the values, it is the document's fault
        message = str(exc) or type(exc).__name__
        raise RunConfigError({_field_of_error(message, raw_args, output_dir=output_dir): message}) from None
    env = doc.get("environment_factory")
    reward_funcs = doc.get("reward_funcs") or []
    return RunSpec(
        model=doc["model"],
        train_dataset=doc.get("train_dataset"),
        reward_funcs=[reward_funcs] if isinstance(reward_funcs, str) else list(reward_funcs),
        tools=list(doc.get("tools") or []),
        environment_factory=env,
        peft_config=doc.get("peft_config"),
        loop_cls=doc.get("loop_cls"),
        model_revision=doc.get("model_revision"),
        dataset_revision=doc.get("dataset_revision"),
        dataset_config=doc.get("dataset_config"),
        dataset_split=doc.get("dataset_split") or "train",
        dataset_columns=dict(doc.get("dataset_columns") or {}),
        eval_dataset=doc.get("eval_dataset"),
        eval_dataset_revision=doc.get("eval_dataset_revision"),
        eval_dataset_config=doc.get("eval_dataset_config"),
        eval_dataset_split=doc.get("eval_dataset_split") or DEFAULT_EVAL_SPLIT,
        resources=parse_resources(doc.get("resources")),
        args=config,
    )


def _hub_option_errors(doc: dict) -> dict[str, str]:
    """Types and shapes of the hub options (whether a hub id is allowed is the control plane's call)."""
    from trainer.plugins.hub import valid_revision

    errors: dict[str, str] = {}
    for key in ("model_revision", "dataset_revision", "eval_dataset_revision"):
        value = doc.get(key)
        if value is not None and not valid_revision(value):
            errors[key] = f"{_short_repr(value)} is not a branch, tag or commit hash"
    for key in ("dataset_config", "dataset_split", "eval_dataset_config", "eval_dataset_split"):
        value = doc.get(key)
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= 200 and ".." not in value):
            errors[key] = "must be a short string (a dataset config name or split such as 'train')"
    columns = doc.get("dataset_columns")
    if columns is not None:
        if not isinstance(columns, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v.isidentifier() for k, v in columns.items()
        ):
            errors["dataset_columns"] = (
                "must map the dataset's column names to names the run reads, e.g. {question: prompt}"
            )
        elif len(set(columns.values())) != len(columns):
            errors["dataset_columns"] = "two columns are mapped to the same name"
    return errors


_PEFT_BIAS = ("none", "all", "lora_only")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v for v in value)


def _peft_value_errors(peft: dict) -> dict[str, str]:
    """Types and ranges of the LoraConfig fields a document may set (peft checks them only at training)."""
    errors: dict[str, str] = {}
    if "r" in peft and not (
        isinstance(peft["r"], int) and not isinstance(peft["r"], bool) and 1 <= peft["r"] <= 65536
    ):
        errors["r"] = f"must be an integer in [1, 65536], got {_short_repr(peft['r'])}"
    alpha = peft.get("lora_alpha")
    if "lora_alpha" in peft and not (_is_number(alpha) and math.isfinite(alpha) and alpha > 0):
        errors["lora_alpha"] = f"must be a number > 0, got {_short_repr(alpha)}"
    dropout = peft.get("lora_dropout")
    if "lora_dropout" in peft and not (_is_number(dropout) and 0 <= dropout < 1):
        errors["lora_dropout"] = f"must be a number in [0, 1), got {_short_repr(dropout)}"
    targets = peft.get("target_modules")
    if targets is not None and not ((isinstance(targets, str) and targets) or _is_str_list(targets)):
        errors["target_modules"] = "must be a module name pattern or a list of module names"
    if "bias" in peft and peft["bias"] not in _PEFT_BIAS:
        errors["bias"] = f"must be one of {', '.join(_PEFT_BIAS)}, got {_short_repr(peft['bias'])}"
    if "use_rslora" in peft and not isinstance(peft["use_rslora"], bool):
        errors["use_rslora"] = f"must be true or false, got {_short_repr(peft['use_rslora'])}"
    to_save = peft.get("modules_to_save")
    if to_save is not None and not _is_str_list(to_save):
        errors["modules_to_save"] = "must be a list of module names"
    return errors


def _field_of_error(message: str, raw_args: dict, *, output_dir: str | None = None) -> str:
    """Field path for a config error: the ``args`` key the message names or, when it names none
    (``"nope is not a valid OptimizerNames"``), the one key that fails on its own."""
    from trainer.config.async_grpo_config import AsyncGRPOConfig

    head = message.split(":", 1)[0]
    keys = [k for k in raw_args if isinstance(k, str)]
    for key in sorted(keys, key=len, reverse=True):
        if key in head:
            return f"args.{key}"
    for key in sorted(config_field_names(), key=len, reverse=True):
        if head.startswith(key):
            return f"args.{key}"
    for key in keys:
        kwargs = {key: raw_args[key]}
        if output_dir is not None and key != "output_dir":
            kwargs["output_dir"] = output_dir
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                AsyncGRPOConfig(**kwargs)
        except Exception:  # this key alone is refused: it is the culprit
            return f"args.{key}"
    return "args"


def read_run_file(path: str | Path) -> dict:
    """Parse a RUN.yaml file (safe YAML); errors name the file."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RunConfigError({"config": f"cannot read {path}: {exc.strerror}"}) from exc
    except UnicodeDecodeError as exc:
        raise RunConfigError(
            {"config": f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})"}
        ) from None
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: e.g. an integer too long to convert
        raise RunConfigError({"config": f"{path} is not valid YAML: {exc}"}) from exc
    except RecursionError:
        raise RunConfigError({"config": f"{path} is nested too deeply"}) from None
    return doc
