"""Where a run's model, data and checkpoint come from, as its worker prepares them before the launch:
hub ids resolved to local snapshots (no database), registered names to local directories, the latest
complete checkpoint of an earlier attempt, and what preparing the model will do (for the run's events).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["hub_sources_resolve", "latest_checkpoint", "model_plan", "resolve_model_dir"]


def hub_sources_resolve(
    *, config: dict, progress: Callable[[str], None] | None = None
) -> tuple[str, Any, Any, dict[str, dict[str, str]]]:
    """``(model, train dataset, eval dataset, resolved)`` as the launch reads them: each hub id
    (neither registered nor a local path) resolved to its local snapshot at its revision
    (``model_revision``, ``dataset_revision``, ``eval_dataset_revision``), the rest as the document
    has them; ``resolved``: ``{"model" | "dataset" | "eval_dataset": {"id", "type", "revision",
    "commit", "path"}}`` for the ones resolved. No database. Raises :class:`trainer.plugins.hub.HubError`."""
    from trainer.plugins.hub import resolve_sources

    sources = resolve_sources(
        model=config["model"],
        dataset=config.get("train_dataset"),
        model_revision=config.get("model_revision"),
        dataset_revision=config.get("dataset_revision"),
        eval_dataset=config.get("eval_dataset") or None,
        eval_dataset_revision=config.get("eval_dataset_revision"),
        progress=progress,
    )
    return sources.model, sources.dataset, sources.eval_dataset, dict(sources.resolved)


def model_plan(name: str) -> str:
    """What preparing ``name`` will do, for the run's events (the page is not silent meanwhile)."""
    if name != "tiny":
        return f"model: {name}"
    from trainer.tiny.build import current_builds

    if current_builds(0):  # the shipped build or the user's cache
        return "model: the embedded tiny model (a build of these sources exists; copying it if needed)"
    return "model: building the embedded tiny model from scratch (its sources changed; ~3 min on 2 cores)"


def resolve_model_dir(name: str) -> str:
    """A registered model name to its local directory (the tiny model is built once and cached)."""
    from trainer.plugins.registry import is_registered, resolve_model

    return resolve_model(name) if is_registered("model", name) else name


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The highest ``checkpoint-<step>`` folder that has its ``rollout_state.json``."""
    found = []
    for folder in output_dir.glob("checkpoint-*"):
        suffix = folder.name.rsplit("-", 1)[1]
        if suffix.isdigit() and (folder / "rollout_state.json").exists():
            found.append((int(suffix), folder))
    return max(found)[1] if found else None
