"""Reads of what a run may use: the registries, the form's main arguments and their defaults,
a dataset's summary (columns and a preview)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from trainer.config import run_schema
from trainer.plugins import registry

# The form's main hyper-parameters (the rest go in its advanced JSON box).
MAIN_ARGS = (
    "max_steps",
    "learning_rate",
    "num_generations",
    "max_completion_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "temperature",
    "max_staleness",
    "weight_sync_steps",
    "max_concurrent_rollouts",
    "save_steps",
    "seed",
    "log_completions",
)


# The run form's evaluation fields (issue 30; with eval_dataset): when (TrainingArguments' strategy,
# steps, a pass at the start) and how (AsyncGRPOConfig's eval_* fields).
EVAL_ARGS = (
    "eval_strategy",
    "eval_steps",
    "eval_on_start",
    "eval_num_generations",
    "eval_temperature",
    "eval_max_prompts",
    "eval_pass_threshold",
)


REGISTRY_KEYS = {
    "model": "models",
    "dataset": "datasets",
    "reward_func": "reward_funcs",
    "tool": "tools",
    "environment": "environments",
    "rollout_loop": "rollout_loops",
}


def registry_get() -> dict[str, Any]:
    """What the form and ``GET /api/v1/registry/`` offer: every name of every kind with its origin,
    target, first docstring line (rewards: the dataset columns they read), broken ones with their
    error; plugin modules that could not register; the main hyper-parameters' defaults."""
    out: dict[str, Any] = {
        key: {name: entry.as_dict() for name, entry in registry.entries(kind, include_broken=True).items()}
        for kind, key in REGISTRY_KEYS.items()
    }
    out["plugin_errors"] = dict(registry.current().module_errors)
    out["main_args"] = main_arg_defaults()
    return out


def main_arg_defaults() -> dict[str, Any]:
    """AsyncGRPOConfig's defaults (the spec's, from the run schema) for the form's main hyper-parameters."""
    return {name: run_schema.DEFAULTS[name] for name in MAIN_ARGS}


PREVIEW_ROWS = 3
PREVIEW_TEXT_CHARS = 300


def dataset_summary(*, name: str, split: str = "train") -> dict[str, Any]:
    """``{"columns": [...], "rows": [first PREVIEW_ROWS rows], "num_rows": N}`` of a registered dataset
    or an allowed local path (the caller validated it), its ``split`` for a directory of several (a
    registered dataset or a .jsonl file has one). Loaded once per process for registered names
    and per modification time for files. Raises ``ValueError`` when it cannot be loaded."""
    path = Path(name)
    stamp = path.stat().st_mtime_ns if path.is_absolute() and path.exists() else None
    return _dataset_summary(name, stamp, split)


@functools.lru_cache(maxsize=64)
def _dataset_summary(name: str, stamp: int | None, split: str = "train") -> dict[str, Any]:
    try:
        dataset = registry.load_dataset_by_name(name, split=split)
    except Exception as exc:  # a loader's failure is the dataset's, reported in words
        raise ValueError(f"could not be loaded: {type(exc).__name__}: {exc}") from exc
    rows = [dataset[i] for i in range(min(PREVIEW_ROWS, len(dataset)))]
    return {
        "columns": list(dataset.column_names),
        "rows": [_preview_value(row) for row in rows],
        "num_rows": len(dataset),
    }


def _preview_value(value: Any) -> Any:
    """JSON-safe, with long strings cut (a preview, not the data)."""
    if isinstance(value, str):
        return value if len(value) <= PREVIEW_TEXT_CHARS else value[:PREVIEW_TEXT_CHARS] + "…"
    if isinstance(value, dict):
        return {str(k): _preview_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_preview_value(v) for v in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)
