"""Registries of importable names: models, datasets, reward functions, tools, environments, rollout loops.

RUN.yaml and the control plane refer to everything by name. The trainer CLI resolves any dotted
import path (a user's own module); the web control plane only accepts registered names
(:func:`is_registered`), so it never imports or fetches anything an operator did not install.

Names come from two places, the built-ins included (they are declared in this project's own
``pyproject.toml`` like any plugin's):

* **entry points** of installed packages, one group per kind (:data:`ENTRY_POINT_GROUPS`):
  ``grpo.models``, ``grpo.datasets``, ``grpo.reward_funcs``, ``grpo.tools``, ``grpo.environments``,
  ``grpo.rollout_loops``;
* **``GRPO_PLUGIN_MODULES``** (comma-separated module names), for operators without packaging: each
  module's ``register(add)`` calls ``add(kind, target, name=None)`` once per entry.

A target is ``"module:attr"``. Models and datasets are registered under the entry point's name and
point at a zero-argument loader (a model's returns what ``from_pretrained`` and vLLM take; a
dataset's returns a ``datasets.Dataset`` or a list of row dicts). Reward functions, tools,
environment factories and rollout-loop classes are registered under their dotted path
(``module.attr``), which is what RUN.yaml names them by (the entry point's own name is a label).

Every entry records its origin (distribution and version, or the plugin module), the first line of
its docstring and, for rewards, the dataset columns its signature reads. An entry whose import fails
is kept as *broken*, with the error: it is listed, never registered, and never takes a caller down.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

KINDS = ("model", "dataset", "reward_func", "tool", "environment", "rollout_loop")
ENTRY_POINT_GROUPS = {kind: f"grpo.{kind}s" for kind in KINDS}
PLUGIN_MODULES_ENV = "GRPO_PLUGIN_MODULES"
# Kinds registered under the entry point's name (the rest under the target's dotted path).
_NAMED_KINDS = ("model", "dataset")
# Reward keyword arguments that are not dataset columns (the spec's reward contract).
_REWARD_NON_COLUMNS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)


@dataclass(frozen=True)
class Entry:
    """One registered (or broken) name."""

    kind: str
    name: str
    target: str  # "module:attr"
    package: str  # the distribution (entry points) or the plugin module (GRPO_PLUGIN_MODULES)
    version: str
    doc: str = ""
    columns: tuple[str, ...] = ()  # reward functions: the dataset columns they read
    required: tuple[str, ...] = ()  # ... of which these have no default (a dataset must have them)
    error: str = ""  # why it could not be imported (broken)

    @property
    def broken(self) -> bool:
        return bool(self.error)

    def load(self) -> Any:
        """The object the target names (imports its module)."""
        return _load_target(self.target)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "origin": {"package": self.package, "version": self.version},
            "target": self.target,
            "doc": self.doc,
        }
        if self.kind == "reward_func":
            out["columns"] = list(self.columns)
            out["required_columns"] = list(self.required)
        if self.broken:
            out["broken"] = True
            out["error"] = self.error
        return out


@dataclass
class Registry:
    """Every entry by kind and name, and plugin modules that could not register at all."""

    entries: dict[str, dict[str, Entry]] = field(default_factory=lambda: {kind: {} for kind in KINDS})
    module_errors: dict[str, str] = field(default_factory=dict)  # module -> error

    def add(self, entry: Entry) -> None:
        current = self.entries[entry.kind].get(entry.name)
        if current is None or (current.broken and not entry.broken):
            self.entries[entry.kind][entry.name] = entry


def _load_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def _first_doc_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def reward_columns(func: Callable, *, required_only: bool = False) -> tuple[str, ...]:
    """The dataset columns a reward function reads: its named parameters beyond the spec's own
    (``prompts``, ``completions``, ``completion_ids``, ...); ``**kwargs`` reads none by name.
    ``required_only``: those without a default (a dataset without them cannot feed the function)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in _REWARD_NON_COLUMNS
        and not (required_only and p.default is not p.empty)
    )


def _entry(kind: str, name: str | None, target: str, package: str, version: str) -> Entry:
    """Import ``target`` and describe it; an import failure gives a broken entry, not an exception."""
    if ":" not in target and "." in target:  # "module.attr" accepted too
        module_name, _, attr = target.rpartition(".")
        target = f"{module_name}:{attr}"
    dotted = target.replace(":", ".")
    if kind not in _NAMED_KINDS:
        name = dotted
    name = name or dotted
    try:
        obj = _load_target(target)
    except Exception as exc:  # a plugin's import error is data here, not a crash
        return Entry(kind, name, target, package, version, error=f"{type(exc).__name__}: {exc}")
    if not callable(obj):
        return Entry(kind, name, target, package, version, error=f"{dotted} is not callable")
    columns = required = ()
    if kind == "reward_func":
        columns, required = reward_columns(obj), reward_columns(obj, required_only=True)
    doc = _first_doc_line(obj)
    return Entry(kind, name, target, package, version, doc=doc, columns=columns, required=required)


def _from_entry_points(reg: Registry) -> None:
    for kind, group in ENTRY_POINT_GROUPS.items():
        for ep in metadata.entry_points(group=group):
            dist = getattr(ep, "dist", None)
            package = dist.metadata["Name"] if dist is not None else "?"
            version = dist.version if dist is not None else "?"
            reg.add(_entry(kind, ep.name, ep.value, package, version))


def _from_plugin_modules(reg: Registry, modules: list[str]) -> None:
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
            version = str(getattr(module, "__version__", "") or "-")

            def add(kind: str, target: str, name: str | None = None, *, _m=module_name, _v=version) -> None:
                if kind not in KINDS:
                    raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
                reg.add(_entry(kind, name, target, _m, _v))

            module.register(add)
        except Exception as exc:
            reg.module_errors[module_name] = f"{type(exc).__name__}: {exc}"


def plugin_modules() -> list[str]:
    """``GRPO_PLUGIN_MODULES`` as a list of module names."""
    return [m.strip() for m in os.environ.get(PLUGIN_MODULES_ENV, "").split(",") if m.strip()]


@functools.cache
def current() -> Registry:
    """The registry of this process (built once; :func:`refresh` rebuilds it)."""
    reg = Registry()
    _from_entry_points(reg)
    _from_plugin_modules(reg, plugin_modules())
    return reg


def refresh() -> Registry:
    """Forget the built registry and build it again (after installing a plugin, in tests)."""
    current.cache_clear()
    return current()


def entries(kind: str, *, include_broken: bool = False) -> dict[str, Entry]:
    """The entries of ``kind`` by name, sorted; broken ones only when asked for."""
    items = current().entries[kind]
    return {n: e for n, e in sorted(items.items()) if include_broken or not e.broken}


def names(kind: str) -> dict[str, str]:
    """Registered (working) names of ``kind`` → the first line of their docs."""
    return {name: entry.doc for name, entry in entries(kind).items()}


def is_registered(kind: str, name: str) -> bool:
    """True when ``name`` is a working entry of ``kind`` (model, dataset, reward_func, tool,
    environment, rollout_loop)."""
    entry = current().entries[kind].get(name)
    return entry is not None and not entry.broken


def cache_root() -> Path:
    """Where built artefacts (the tiny model) are cached: ``$GRPO_CACHE_DIR``, else ``~/.cache/grpo``.

    Per user, not per checkout (as Hugging Face's cache is): the tiny model is keyed by the hash of
    its sources, so every clone with the same sources reuses one build.
    """
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo"
    root = Path(os.environ.get("GRPO_CACHE_DIR") or default)
    root.mkdir(parents=True, exist_ok=True)
    return root


def resolve_model(name: str) -> str:
    """A model name to what ``from_pretrained`` and vLLM take: a registered model's loader runs (the
    tiny model is built or copied once and cached); anything else is returned as it is."""
    if is_registered("model", name):
        return str(entries("model")[name].load()())
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
    """Import a callable by dotted path (reward function, tool, environment factory, loop class)."""
    obj = import_object(path)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    return obj


def load_dataset_by_name(
    name: str,
    *,
    config: str | None = None,
    split: str = "train",
    columns: dict[str, str] | None = None,
    field: str = "train_dataset",
):
    """A registered dataset, a local ``.jsonl`` file, a ``datasets.save_to_disk`` directory or a
    directory in the hub's layout (a resolved snapshot: data files plus an optional README config)
    → a Dataset; ``columns`` renames the dataset's columns to those the run reads. A ``prompt`` of
    plain text becomes one user message (the trainer renders conversations).

    Nothing is fetched from a hub here (hub ids are resolved to a snapshot first: :mod:`trainer.plugins.hub`).
    ``field`` names the document's field in errors (``train_dataset``, ``eval_dataset``).
    """
    import datasets

    dataset = _load_dataset(name, config=config, split=split, field=field)
    if columns:
        missing = [c for c in columns if c not in dataset.column_names]
        if missing:
            raise ValueError(
                f"dataset_columns: {', '.join(missing)} not among {name!r}'s columns ({', '.join(dataset.column_names)})"
            )
        dataset = dataset.rename_columns(columns)
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(f"{field} {name!r} did not load as one split (got {type(dataset).__name__})")
    if "prompt" in dataset.column_names and len(dataset) and isinstance(dataset[0]["prompt"], str):
        # A plain-text prompt (most hub datasets' question column) is one user message.
        dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    return dataset


def _load_dataset(name: str, *, config: str | None, split: str, field: str = "train_dataset"):
    import datasets

    if is_registered("dataset", name):
        loaded = entries("dataset")[name].load()()
        return loaded if isinstance(loaded, datasets.Dataset) else datasets.Dataset.from_list(list(loaded))
    path = Path(name).expanduser()
    if path.suffix in (".jsonl", ".json") and path.is_file():
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        return datasets.load_dataset("json", data_files=str(path), split="train")
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{field} {name!r}: no split {split!r} (has {', '.join(loaded)})")
            loaded = loaded[split]
        return loaded
    if path.is_dir():  # the hub's layout (a resolved snapshot)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        return datasets.load_dataset(str(path), name=config, split=split)
    raise ValueError(
        f"{field} {name!r}: not a registered dataset ({', '.join(names('dataset')) or 'none'}), "
        "nor an existing .jsonl file or datasets directory"
    )
