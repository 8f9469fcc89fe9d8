"""What the run form starts from: a preset of RUN.yaml ``args`` per model, and the form's initial
values built from a preset or from an existing run's config ("Clone this run").

The one place presets live. ``tiny`` starts from the demo run's args (whatever
:func:`controlplane.runs.services.demo_config` says today); any other model starts from the spec's
defaults with a finite length, sampled completions logged, 1,024-token completions and a checkpoint
every 100 steps. Main hyper-parameters (:data:`~controlplane.runs.selectors.MAIN_ARGS`) fill the
form's grid; every other key goes into its "advanced" JSON box.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from controlplane.runs.models import Checkpoint, Run
from controlplane.runs.selectors import EVAL_ARGS, MAIN_ARGS, main_arg_defaults
from controlplane.runs.services import demo_config
from trainer.config.run_config import TOP_LEVEL_KEYS
from trainer.plugins import registry

DEFAULT_MODEL = "tiny"
# What the form has fields for: every RUN.yaml key but these (the API takes them).
NOT_ON_FORM = ("tools", "environment_factory", "peft_config", "loop_cls")
FORM_KEYS = tuple(key for key in TOP_LEVEL_KEYS if key not in NOT_ON_FORM)
MAX_NAME_CHARS = 200
CLONE_SUFFIX = " (clone)"

# Models without a preset of their own: the spec's defaults (its learning rate included) except these.
GENERIC_ARGS: dict[str, Any] = {
    "max_steps": 500,
    "log_completions": True,
    "max_completion_length": 1024,
    "save_steps": 100,
}


def _tiny_args() -> dict[str, Any]:
    """The demo run's args, read at each call (the demo config is tuned on its own)."""
    return dict(demo_config()["args"])


def _generic_args() -> dict[str, Any]:
    """The preset of every model without one of its own."""
    return dict(GENERIC_ARGS)


# model name -> its preset's args (a function: read when the form is shown, never copied)
PRESETS: dict[str, Callable[[], dict[str, Any]]] = {"tiny": _tiny_args}


def run_preset(*, model: str) -> dict[str, Any]:
    """The RUN.yaml ``args`` the form is prefilled with for ``model`` (a fresh dict)."""
    return PRESETS.get(model, _generic_args)()


@dataclass(frozen=True)
class RunFormPrefill:
    """Initial values for the run form; for a clone, the source run's id and the top-level config
    keys the form has no field for (left out of the clone); for a run from a checkpoint, its step
    and what may keep the checkpoint from being accepted as a model (``notes``)."""

    initial: dict[str, Any]
    cloned_from: int | None = None
    dropped: list[str] = field(default_factory=list)
    checkpoint_step: int | None = None
    notes: list[str] = field(default_factory=list)


def form_args_split(*, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` as the form shows them: every main and evaluation field (the spec's default where
    ``args`` leaves it out) plus ``advanced``, the JSON text of the other keys ("" when there are none)."""
    from trainer.config.run_schema import DEFAULTS

    fields = (*MAIN_ARGS, *EVAL_ARGS)
    defaults = {**main_arg_defaults(), **{name: DEFAULTS[name] for name in EVAL_ARGS}}
    values = {**defaults, **{k: v for k, v in args.items() if k in fields}}
    rest = {k: v for k, v in args.items() if k not in fields}
    return {**values, "advanced": json.dumps(rest) if rest else ""}


def form_presets() -> dict[str, Any]:
    """What the form page embeds for its script: each registered model's prefilled values and the
    generic preset's (used for any model without its own)."""
    return {
        "presets": {
            model: form_args_split(args=run_preset(model=model)) for model in registry.names("model")
        },
        "generic": form_args_split(args=_generic_args()),
    }


def run_new_prefill(*, model: str = DEFAULT_MODEL) -> RunFormPrefill:
    """A new run: ``model`` and its preset; for ``tiny`` also the demo's dataset and reward functions
    (so a plain submit starts the demo)."""
    initial: dict[str, Any] = {"model": model, **form_args_split(args=run_preset(model=model))}
    if model == "tiny":
        demo = demo_config()
        initial.update(train_dataset=demo["train_dataset"], reward_funcs=list(demo["reward_funcs"]))
    return RunFormPrefill(initial=initial)


def run_clone_prefill(*, run: Run) -> RunFormPrefill:
    """Every field from ``run``'s stored config (which the caller checked the user may see), named
    ``"<name> (clone)"``; top-level keys the form has no field for are listed in ``dropped``."""
    config = run.config if isinstance(run.config, dict) else {}
    args = config.get("args") if isinstance(config.get("args"), dict) else {}
    reward_funcs = config.get("reward_funcs") or []
    initial = {
        "name": run.name[: MAX_NAME_CHARS - len(CLONE_SUFFIX)] + CLONE_SUFFIX,
        "model": config.get("model") or DEFAULT_MODEL,
        "train_dataset": config.get("train_dataset") or "",
        "reward_funcs": [reward_funcs] if isinstance(reward_funcs, str) else list(reward_funcs),
        **{
            key: config[key]
            for key in (
                "model_revision",
                "dataset_revision",
                "dataset_config",
                "dataset_split",
                "eval_dataset",
                "eval_dataset_revision",
                "eval_dataset_config",
                "eval_dataset_split",
            )
            if config.get(key)
        },
        **form_args_split(args=args),
    }
    if isinstance(config.get("dataset_columns"), dict) and config["dataset_columns"]:
        initial["dataset_columns"] = json.dumps(config["dataset_columns"])
    if isinstance(config.get("resources"), dict) and config["resources"]:
        initial["resources"] = json.dumps(config["resources"])
    dropped = sorted(str(key) for key in config if key not in FORM_KEYS)
    return RunFormPrefill(initial=initial, cloned_from=run.pk, dropped=dropped)


def run_checkpoint_prefill(*, run: Run, checkpoint: Checkpoint, user: Any = None) -> RunFormPrefill:
    """A new run from ``run``'s checkpoint: every field as :func:`run_clone_prefill` gives it, the
    checkpoint's folder as the model (a checkpoint folder is a model directory: config, weights,
    tokenizer), no ``model_revision`` (a local folder has none), named ``"<name> (from step N)"``.
    Only the weights carry over; the optimizer, the schedule and the step count start afresh (the
    run's own Resume continues them, and ``args.resume_from_checkpoint`` is not taken from the web).

    ``notes``: why the submitted form could still be refused, known before submitting: another
    user's checkpoint outside ``GRPO_ALLOWED_MODEL_ROOTS`` (``user``'s own checkpoints are accepted
    wherever they are; other local models only inside those roots), a LoRA run's checkpoint (an
    adapter, not a whole model)."""
    clone = run_clone_prefill(run=run)
    suffix = f" (from step {checkpoint.step})"
    initial = {
        **clone.initial,
        "name": run.name[: MAX_NAME_CHARS - len(suffix)] + suffix,
        "model": checkpoint.path,
    }
    initial.pop("model_revision", None)
    notes = []
    own = user is not None and run.owner_id == getattr(user, "pk", None)
    if not own and not _under_any(checkpoint.path, settings.GRPO_ALLOWED_MODEL_ROOTS):
        notes.append(
            f"Run {run.pk} is another user's: a run may start from its owner's checkpoints, and from "
            "other local models only inside GRPO_ALLOWED_MODEL_ROOTS, which this checkpoint is outside."
        )
    if isinstance(run.config, dict) and run.config.get("peft_config"):
        notes.append(
            f"Run {run.pk} trained a LoRA adapter (peft_config): its checkpoints hold the adapter, "
            "not a whole model, and cannot be a run's model."
        )
    return RunFormPrefill(
        initial=initial,
        cloned_from=run.pk,
        dropped=clone.dropped,
        checkpoint_step=checkpoint.step,
        notes=notes,
    )


def _under_any(path: str, roots: list[str]) -> bool:
    """Whether ``path`` (resolved) lies inside one of ``roots`` (resolved)."""
    if "\x00" in path or not os.path.isabs(path):
        return False
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, os.path.realpath(r)]) == os.path.realpath(r) for r in roots)
