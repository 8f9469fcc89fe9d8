"""Registries of importable names: models, datasets, reward functions, tools, environments.

RUN.yaml and the control plane refer to everything by name. The trainer CLI resolves any dotted
import path (a user's own module); the web control plane only accepts the names listed here
(:func:`is_registered`), so it never imports code it receives.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

MODELS: dict[str, str] = {
    "tiny": "the embedded random-init Qwen3-architecture model, warm-started on arithmetic"
}

DATASETS: dict[str, str] = {
    "arithmetic": "procedural arithmetic prompts (conversational) with a `solution` column, 4,000 rows",
    "arithmetic-small": "the same task, 256 rows (quick runs, tests)",
    "arithmetic-unseen": "single-digit facts the tiny model's warm start never saw (~55 problems), "
    "4,000 rows: the demo's dataset, where reward rises within minutes",
}

REWARD_FUNCS: dict[str, str] = {
    "trainer.rewards.accuracy_reward": "1.0 when the answer equals `solution` (math-verify)",
    "trainer.rewards.boxed_format_reward": "1.0 when the completion is exactly one \\boxed{...}",
    "trainer.rewards.think_format_reward": "1.0 for <think>...</think> then an answer",
    "trainer.rewards.completion_length_reward": "the completion length in tokens",
}

TOOLS: dict[str, str] = {
    "trainer.builtin_tools.add": "add two integers",
    "trainer.builtin_tools.subtract": "subtract two integers",
    "trainer.builtin_tools.multiply": "multiply two integers",
}

ENVIRONMENTS: dict[str, str] = {}

_KINDS = {
    "model": MODELS,
    "dataset": DATASETS,
    "reward_func": REWARD_FUNCS,
    "tool": TOOLS,
    "environment": ENVIRONMENTS,
}


def is_registered(kind: str, name: str) -> bool:
    """True when ``name`` is in the registry of ``kind`` (model, dataset, reward_func, tool, environment)."""
    return name in _KINDS[kind]


def cache_root() -> Path:
    """Where built artefacts (the tiny model) are cached: ``$GRPO_CACHE_DIR``, else ``~/.cache/grpo``.

    Per user, not per checkout (as Hugging Face's cache is): the tiny model is keyed by the hash of
    its sources, so every clone with the same sources reuses one build (~3 minutes on 2 cores).
    """
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo"
    root = Path(os.environ.get("GRPO_CACHE_DIR") or default)
    root.mkdir(parents=True, exist_ok=True)
    return root


def resolve_model(name: str) -> str:
    """A model name to what ``from_pretrained`` and vLLM take: ``tiny`` is built once and cached."""
    if name == "tiny":
        from trainer.tiny import ensure_tiny

        return str(ensure_tiny(cache_root() / "tiny"))
    return name


def import_object(path: str) -> Any:
    """Import ``package.module.attr`` (a dotted path); errors name the path and what is missing."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted import path (expected 'package.module.name')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{path!r}: cannot import module {module_name!r} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"{path!r}: module {module_name!r} has no attribute {attr!r}") from exc


def resolve_callable(path: str) -> Callable:
    """Import a callable by dotted path (reward function, tool, environment factory)."""
    obj = import_object(path)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    return obj


def load_dataset_by_name(name: str):
    """A registry name, a local ``.jsonl`` file or a ``datasets.save_to_disk`` directory → a Dataset.

    Nothing is fetched from a hub (``HF_DATASETS_OFFLINE`` is forced for the local loaders).
    """
    import datasets

    if name in ("arithmetic", "arithmetic-small"):
        from trainer.tasks.arithmetic import arithmetic_rows

        n = 4000 if name == "arithmetic" else 256
        return datasets.Dataset.from_list(arithmetic_rows(n, seed=0, split="train"))
    if name == "arithmetic-unseen":
        from trainer.tasks.demo import unseen_fact_rows

        return datasets.Dataset.from_list(unseen_fact_rows(4000, seed=0))
    path = Path(name).expanduser()
    if path.suffix in (".jsonl", ".json") and path.is_file():
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        return datasets.load_dataset("json", data_files=str(path), split="train")
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"train_dataset {name!r}: DatasetDict without a 'train' split")
            loaded = loaded["train"]
        return loaded
    raise ValueError(
        f"train_dataset {name!r}: not a registered dataset ({', '.join(DATASETS)}), "
        "nor an existing .jsonl file or datasets directory"
    )
