"""The one place a run document from the web form or the REST API is checked.

Two layers, both reported together as ``{field path: message}`` (``args.learning_rate``,
``reward_funcs[1]``, ...):

1. :func:`trainer.config.run_config.run_document_errors`: the RUN.yaml shape and the run schema
   (:mod:`trainer.config.run_schema`: types, ranges, choices, the spec's incompatible combinations); it
   imports neither transformers nor anything the document names.
2. What the control plane adds because the document is untrusted: every importable name must be in
   the registry (:mod:`trainer.plugins.registry`), local model directories and dataset files only under the
   configured roots (no path traversal), and no ``args`` that would let a request pick where the run
   writes, which server it talks to, or make the worker run remote code / reach a hub.

Once both pass, :func:`~controlplane.runs.services.run_config_validate` makes the checks the run's
launch would make (:mod:`controlplane.runs.launch_checks`: the model's context, the dataset's prompts,
the trainer's config, the named server).

Before both, the document must be plain JSON that Postgres can store (no NaN, NUL or unpaired
surrogates, string keys), at most :data:`MAX_DOCUMENT_BYTES` long and :data:`MAX_DOCUMENT_DEPTH` levels deep,
measured without expanding YAML aliases first.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from django.conf import settings

from controlplane.runs.selectors import dataset_summary
from trainer.config.resources import Resources, parse_resources, resources_errors
from trainer.config.run_config import DEFAULT_EVAL_SPLIT, RunConfigError, run_document_errors
from trainer.plugins import registry
from trainer.plugins.hub import is_hub_id

MAX_DOCUMENT_BYTES = 64_000
MAX_DOCUMENT_DEPTH = 32
MAX_INTEGER = 2**63 - 1  # beyond int64 nothing downstream (torch, numpy) takes it

# Set by the supervisor for every attempt (its own output directory and its own vLLM server).
CONTROLLED_ARGS = ("output_dir", "vllm_server_base_url", "logging_dir")
# Resuming goes through POST /runs/<id>/resume/, which picks the checkpoint.
RESUME_ARGS = ("resume_from_checkpoint",)
# These must keep their default (falsy) value: remote code, hub pushes, credentials.
MUST_BE_FALSY_ARGS = ("trust_remote_code", "push_to_hub", "hub_token", "hub_model_id", "deepspeed")
# Strings here are file paths read by the worker; only inline mappings are accepted from the web.
MAPPING_ONLY_ARGS = ("fsdp_config", "accelerator_config")
MODEL_INIT_KWARGS_ALLOWED = ("attn_implementation", "dtype", "torch_dtype", "low_cpu_mem_usage", "use_cache")
# chat_template_kwargs from the web: plain flags the model's template reads (enable_thinking, ...),
# each a name, its value a boolean, a number, null or a short string holding no Jinja; never a
# template or an argument of apply_chat_template itself (the worker renders with them).
CHAT_TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
CHAT_TEMPLATE_KWARG_MAX_CHARS = 256
APPLY_CHAT_TEMPLATE_ARGS = (
    "chat_template",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "conversation",
)
REPORT_TO_ALLOWED = ("none",)
# Attention implementations that load nothing: transformers also takes a hub kernel repo
# ("org/repo@rev:fn"), which makes the worker fetch and import code through `kernels`. Operators
# add installed ones (e.g. flash_attention_2) with GRPO_ALLOWED_ATTN_IMPLEMENTATIONS.
LOCAL_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
# torch.compile backends that ship with torch (a name outside them is looked up among installed
# entry points; refused from the web rather than resolved).
COMPILE_BACKENDS_ALLOWED = ("inductor", "aot_eager", "eager")


def run_document_validate(*, document: Any, owner: Any = None) -> dict:
    """Check an untrusted run document; return it unchanged when valid. ``owner`` (the user creating
    the run) may name a checkpoint folder of one of their own runs as the model, wherever
    ``GRPO_ALLOWED_MODEL_ROOTS`` is (the form's "new run from this checkpoint").

    Raises :class:`~trainer.config.run_config.RunConfigError` whose ``errors`` maps each offending field
    path to a message (all problems at once, not just the first).
    """
    if not isinstance(document, dict):
        raise RunConfigError({"config": "must be a JSON object (the RUN.yaml document)"})
    # Walk before serialising: a YAML document with aliases can be tiny as text and expand to
    # gigabytes as JSON, so the walk stops as soon as the size or the depth is over the limit.
    shape_errors = _json_shape_errors(document)
    if shape_errors:
        raise RunConfigError(shape_errors)
    size = len(json.dumps(document, allow_nan=False))
    if size > MAX_DOCUMENT_BYTES:
        raise RunConfigError({"config": f"is {size} bytes; the limit is {MAX_DOCUMENT_BYTES}"})
    errors = _control_plane_errors(document, owner)
    for path, message in run_document_errors(document).items():
        errors.setdefault(path, message)
    if errors:
        raise RunConfigError(errors)
    return document


class _TooBig(Exception):
    """Raised inside the bounded walk to stop it at the first size or depth over the limit."""


def _json_shape_errors(document: dict) -> dict[str, str]:
    """Problems that would make the document unstorable or unsafe to serialise, by field path:
    not plain JSON (dates, sets, non-string keys), NaN/Infinity, NUL or unpaired surrogates in
    strings (Postgres ``jsonb`` refuses them), nesting deeper than :data:`MAX_DOCUMENT_DEPTH`, and a
    size over :data:`MAX_DOCUMENT_BYTES` (counted as the walk goes, aliases included)."""
    errors: dict[str, str] = {}
    budget = [MAX_DOCUMENT_BYTES]

    def spend(n: int) -> None:
        budget[0] -= n
        if budget[0] < 0:
            raise _TooBig

    def check_str(value: str, where: str) -> None:
        spend(len(value) + 2)
        if "\x00" in value:
            errors.setdefault(where, "must not contain NUL characters")
        else:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                errors.setdefault(where, "must be valid Unicode text (unpaired surrogate)")

    def walk(value: Any, path: str | None, depth: int) -> None:
        where = "config" if path is None else path
        if depth > MAX_DOCUMENT_DEPTH:
            errors.setdefault(where, f"is nested deeper than {MAX_DOCUMENT_DEPTH} levels")
            return
        if value is None or isinstance(value, bool):
            spend(5)
        elif isinstance(value, int):
            spend(value.bit_length() // 3 + 2)
            if abs(value) > MAX_INTEGER:
                errors.setdefault(where, "is out of range (integers must be below 2**63 in magnitude)")
        elif isinstance(value, float):
            spend(24)
            if not math.isfinite(value):
                errors.setdefault(where, f"must be a finite number, got {value}")
        elif isinstance(value, str):
            check_str(value, where)
        elif isinstance(value, list):
            spend(2)
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]", depth + 1)
        elif isinstance(value, dict):
            spend(2)
            for key, item in value.items():
                if not isinstance(key, str):
                    errors.setdefault(where, f"keys must be strings, got {type(key).__name__}")
                    continue
                # The path goes back in the error response: NUL and surrogates escaped.
                name = key.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
                child = (name or "document") if path is None else f"{path}.{name}"
                check_str(key, child)
                walk(item, child, depth + 1)
        else:
            errors.setdefault(where, f"must be plain JSON data, got {type(value).__name__}")

    try:
        walk(document, None, 0)
    except _TooBig:
        return {"config": f"is larger than the limit of {MAX_DOCUMENT_BYTES} bytes"}
    return errors


def _control_plane_errors(doc: dict, owner: Any = None) -> dict[str, str]:
    errors: dict[str, str] = {}
    model = doc.get("model")
    if isinstance(model, str) and model and not registry.is_registered("model", model):
        message = _own_checkpoint_error(model, owner)
        if message is None:
            message = _source_error(model, "model")
        if message:
            errors["model"] = message
    dataset = doc.get("train_dataset")
    eval_dataset = doc.get("eval_dataset")
    # eval_dataset takes the same forms as train_dataset, under the same rules (roots, links, hub allowlist).
    for field, value in (("train_dataset", dataset), ("eval_dataset", eval_dataset)):
        if isinstance(value, str) and value and not registry.is_registered("dataset", value):
            message = _source_error(value, "dataset")
            if message:
                errors[field] = message
    for key, source in (
        ("model_revision", model),
        ("dataset_revision", dataset),
        ("eval_dataset_revision", eval_dataset),
    ):
        if doc.get(key) is not None and not is_hub_id(source):
            errors.setdefault(key, "applies to a hub id only (org/name)")
    errors.update(
        _names_errors(doc.get("reward_funcs"), "reward_funcs", "reward_func", registry.names("reward_func"))
    )
    errors.update(_names_errors(doc.get("tools"), "tools", "tool", registry.names("tool")))
    env = doc.get("environment_factory")
    if isinstance(env, str) and not registry.is_registered("environment", env):
        errors["environment_factory"] = _unregistered("environment", env, registry.names("environment"))
    elif isinstance(env, dict):
        for name, path in env.items():
            if isinstance(path, str) and not registry.is_registered("environment", path):
                errors[f"environment_factory.{name}"] = _unregistered(
                    "environment", path, registry.names("environment")
                )
    if not errors:
        errors.update(_column_errors(doc))
    loop_cls = doc.get("loop_cls")
    if isinstance(loop_cls, str) and not registry.is_registered("rollout_loop", loop_cls):
        errors["loop_cls"] = _unregistered("rollout_loop", loop_cls, registry.names("rollout_loop"))
    args = doc.get("args")
    if isinstance(args, dict):
        errors.update(_args_errors(args))
    resources = doc.get("resources")
    if isinstance(resources, dict) and not resources_errors(resources):
        errors.update(_resources_errors(parse_resources(resources)))
    return errors


def _resources_errors(resources: Resources) -> dict[str, str]:
    """The named server and pool must be the operator's; the GPUs (CPUs) asked for must exist on
    at least one registered worker of the pool (no worker registered yet: not checked, the worker
    refuses at claim time what it can never meet)."""
    from controlplane.runs import worker_hosts

    errors: dict[str, str] = {}
    unknown = [name for name in resources.servers if name not in settings.GRPO_VLLM_SERVERS]
    if unknown:
        known = ", ".join(sorted(settings.GRPO_VLLM_SERVERS)) or "none (the operator sets GRPO_VLLM_SERVERS)"
        errors[resources.servers_field] = (
            f"{', '.join(map(repr, unknown))} {'is not a' if len(unknown) == 1 else 'are not'} registered "
            f"vLLM server{'s' if len(unknown) > 1 else ''}; registered: {known}"
        )
    pool = resources.pool or settings.GRPO_RUNS_QUEUE
    if resources.pool is not None and resources.pool not in settings.GRPO_RUN_POOLS:
        errors["resources.pool"] = (
            f"{resources.pool!r} is not a pool; pools: {', '.join(settings.GRPO_RUN_POOLS)}"
        )
        return errors
    if resources.trainer_nodes > 1:
        live = worker_hosts.pool_live_workers(pool=pool)
        if len(live) < resources.trainer_nodes:
            hosts = ", ".join(w.host for w in live) or "none"
            errors["resources.trainer.nodes"] = (
                f"{resources.trainer_nodes} hosts asked and pool {pool!r} has {len(live)} live worker host"
                f"{'s' if len(live) != 1 else ''} ({hosts}): lower nodes, or start a worker on more hosts"
            )
    wanted = resources.explicit_gpus()
    largest = worker_hosts.pool_max_gpus(pool=pool)
    field = "resources.trainer.gpus" if resources.trainer_gpus else "resources.vllm.gpus"
    asked = f"{wanted} GPUs (vLLM {resources.vllm_gpus_on(gpu_host=True)} + trainer {resources.trainer_gpus or 0})"
    if wanted and largest is not None and wanted > largest:
        errors[field] = f"the run asks for {asked} and the largest worker of pool {pool!r} has {largest}"
    elif wanted and largest is None and wanted > settings.GRPO_MAX_RUN_GPUS:
        # No worker has registered yet to say what a host has: the operator's bound on one host.
        errors[field] = (
            f"the run asks for {asked}; a run gets one host's GPUs, at most {settings.GRPO_MAX_RUN_GPUS} "
            "(GRPO_MAX_RUN_GPUS)"
        )
    cpus = worker_hosts.pool_max_cpus(pool=pool)
    processes = resources.trainer_processes
    if processes and cpus is not None and processes > cpus:
        errors["resources.trainer.processes"] = (
            f"{processes} processes, and the largest worker of pool {pool!r} has {cpus} CPUs"
        )
    elif processes and cpus is None and processes > settings.GRPO_MAX_TRAINER_PROCESSES:
        errors["resources.trainer.processes"] = (
            f"{processes} processes; at most {settings.GRPO_MAX_TRAINER_PROCESSES} (GRPO_MAX_TRAINER_PROCESSES) "
            "while no worker of the pool has registered its CPUs"
        )
    if resources.max_model_len is not None and resources.max_model_len > settings.GRPO_MAX_MODEL_LEN:
        errors["resources.vllm.max_model_len"] = (
            f"{resources.max_model_len} tokens; at most {settings.GRPO_MAX_MODEL_LEN} (GRPO_MAX_MODEL_LEN)"
        )
    return errors


def _column_errors(doc: dict) -> dict[str, str]:
    """Each reward function whose required columns (parameters without a default) the dataset lacks,
    naming both (under ``reward_funcs[i]``; for ``eval_dataset``, whose rows the same functions score,
    under ``eval_dataset``); or the dataset itself when it cannot be loaded. Only registered names get here."""
    rewards = doc.get("reward_funcs")
    rewards = [rewards] if isinstance(rewards, str) else rewards
    if not isinstance(rewards, list):
        return {}
    entries = registry.entries("reward_func")
    needed = {i: entries[n].required for i, n in enumerate(rewards) if isinstance(n, str) and n in entries}
    if not any(needed.values()):
        return {}
    renames = doc.get("dataset_columns") if isinstance(doc.get("dataset_columns"), dict) else {}
    errors: dict[str, str] = {}
    splits = {
        "train_dataset": doc.get("dataset_split") or "train",
        "eval_dataset": doc.get("eval_dataset_split") or DEFAULT_EVAL_SPLIT,
    }
    for field, split in splits.items():
        dataset = doc.get(field)
        if not isinstance(dataset, str) or not dataset:
            continue
        if is_hub_id(dataset) and not registry.is_registered("dataset", dataset):
            continue  # the web never fetches: the worker checks when it loads it
        try:
            columns = dataset_summary(name=dataset, split=split if isinstance(split, str) else "train")[
                "columns"
            ]
        except ValueError as exc:
            if f"no split {split!r}" in str(exc) or "Unknown split" in str(exc):
                split_field = "dataset_split" if field == "train_dataset" else "eval_dataset_split"
                errors[split_field] = f"{split!r}: {dataset!r} {exc}; name a split it has"
            else:
                errors[field] = f"{dataset!r} {exc}"
            continue
        columns = [renames.get(c, c) for c in columns]
        for i, required in needed.items():
            missing = [c for c in required if c not in columns]
            if not missing:
                continue
            message = (
                f"{rewards[i]!r} reads column(s) {', '.join(missing)}, which dataset {dataset!r} does not "
                f"have (its columns: {', '.join(columns)}); choose another dataset or reward function"
            )
            errors.setdefault(f"reward_funcs[{i}]" if field == "train_dataset" else field, message)
    return errors


def _names_errors(value: Any, field: str, kind: str, known: dict[str, str]) -> dict[str, str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list):
        return {}
    return {
        f"{field}[{i}]": _unregistered(kind, name, known)
        for i, name in enumerate(names)
        if isinstance(name, str) and not registry.is_registered(kind, name)
    }


def _unregistered(kind: str, name: str, known: dict[str, str]) -> str:
    choices = ", ".join(known) or "none registered"
    return (
        f"{name!r} is not a registered {kind.replace('_', ' ')} (choose from: {choices}); an operator "
        f"registers more with a '{registry.ENTRY_POINT_GROUPS[kind]}' entry point or {registry.PLUGIN_MODULES_ENV}"
    )


def _own_checkpoint_error(value: str, owner: Any) -> str | None:
    """An empty string (accepted) when ``value`` is the folder of a checkpoint of one of ``owner``'s runs that holds
    a whole model; the reason when it is such a checkpoint but cannot be a model (a LoRA adapter, a
    folder since deleted); None when it is no checkpoint of theirs (the usual rules apply)."""
    from controlplane.runs.selectors import checkpoint_owned_by_path

    checkpoint = checkpoint_owned_by_path(user=owner, path=value) if owner is not None else None
    if checkpoint is None:
        return None
    run = checkpoint.run
    if isinstance(run.config, dict) and run.config.get("peft_config"):
        return (
            f"checkpoint {checkpoint.step} of run {run.pk} holds a LoRA adapter (the run set "
            "peft_config), not a whole model: use the run's base model, or resume the run itself"
        )
    if not (Path(value) / "config.json").is_file():
        return f"checkpoint {checkpoint.step} of run {run.pk} is no longer on disk ({value})"
    return ""


def _source_error(value: str, what: str) -> str | None:
    """None when an unregistered model or dataset may be used from the web: a hub id matching the
    operator's allowlist, or a local path under the allowed roots; else why not, naming the setting."""
    if is_hub_id(value):
        setting = "GRPO_ALLOWED_HUB_MODELS" if what == "model" else "GRPO_ALLOWED_HUB_DATASETS"
        patterns = getattr(settings, setting)
        if any(fnmatch.fnmatchcase(value, pattern) for pattern in patterns):
            return None
        allowed = f"it allows {', '.join(patterns)}" if patterns else "it is empty"
        return (
            f"{value!r} is a hub {what} id that the operator has not allowed: hub {what}s must match a "
            f"glob pattern of {setting} ({allowed})"
        )
    if what == "model":
        return _local_path_error(
            value, settings.GRPO_ALLOWED_MODEL_ROOTS, "GRPO_ALLOWED_MODEL_ROOTS", "model"
        )
    return _local_path_error(
        value, settings.GRPO_ALLOWED_DATASET_ROOTS, "GRPO_ALLOWED_DATASET_ROOTS", "dataset"
    )


def _local_path_error(value: str, roots: list[str], setting: str, what: str) -> str | None:
    """None when ``value`` names an existing path inside one of ``roots``; else the reason why not."""
    registered = ", ".join(registry.names("model" if what == "model" else "dataset"))
    if not roots:
        return f"{value!r} is not a registered {what} ({registered}); local paths need {setting}"
    if "\x00" in value:
        return f"local {what} paths must not contain NUL characters"
    path = Path(value)
    if ".." in path.parts or not path.is_absolute():
        return f"{value!r}: local {what} paths must be absolute and must not contain '..'"
    real = os.path.realpath(path)
    real_roots = [os.path.realpath(r) for r in roots]
    if not _inside(real, real_roots):
        return f"{value!r} is outside the allowed {what} roots ({setting})"
    if what == "model" and not os.path.isdir(real):
        return f"{value!r} is not a model directory"
    if what == "dataset" and not (os.path.isdir(real) or real.endswith((".jsonl", ".json"))):
        return f"{value!r} is neither a .jsonl file nor a datasets directory"
    if not os.path.exists(real):
        return f"{value!r} does not exist"
    if os.path.isdir(real):
        return _tree_error(value, real, real_roots, setting, what)
    return None


def _inside(real: str, real_roots: list[str]) -> bool:
    """Whether the resolved path ``real`` is one of ``real_roots`` or under one."""
    return any(os.path.commonpath([real, root]) == root for root in real_roots)


def _tree_error(value: str, real: str, real_roots: list[str], setting: str, what: str) -> str | None:
    """Why the directory ``real`` may not be read from the web: a link inside it (at any depth,
    through linked directories too) that resolves outside the roots, which the loader would follow;
    or more entries than ``GRPO_LOCAL_SOURCE_MAX_ENTRIES`` (the walk's bound, which also ends link
    cycles). None when every entry stays inside."""
    limit = settings.GRPO_LOCAL_SOURCE_MAX_ENTRIES
    seen = 0
    for dirpath, dirnames, filenames in os.walk(real, followlinks=True):
        for name in (*dirnames, *filenames):
            seen += 1
            if seen > limit:
                return (
                    f"{value!r} holds more than {limit} files and folders (GRPO_LOCAL_SOURCE_MAX_ENTRIES): "
                    f"name the {what}'s own folder, not a folder of many"
                )
            entry = os.path.join(dirpath, name)
            if os.path.islink(entry) and not _inside(os.path.realpath(entry), real_roots):
                shown = os.path.relpath(entry, real)
                return (
                    f"{value!r} holds {shown!r}, a link to a path outside the allowed {what} roots "
                    f"({setting}); remove the link, or copy what it points to into the folder"
                )
    return None


def local_sources_errors(*, document: dict) -> dict[str, str]:
    """The folder rule of :func:`run_document_validate` again, as the files stand now: a model or
    dataset folder inside an allowed root must hold no link out of the roots. The worker checks it
    before it reads the files: a folder accepted when the run was created may have gained one since."""
    errors: dict[str, str] = {}
    for field, what, setting in (
        ("model", "model", "GRPO_ALLOWED_MODEL_ROOTS"),
        ("train_dataset", "dataset", "GRPO_ALLOWED_DATASET_ROOTS"),
        ("eval_dataset", "dataset", "GRPO_ALLOWED_DATASET_ROOTS"),
    ):
        value = document.get(field)
        if not isinstance(value, str) or "\x00" in value or not os.path.isabs(value):
            continue
        real, real_roots = os.path.realpath(value), [os.path.realpath(r) for r in getattr(settings, setting)]
        if os.path.isdir(real) and _inside(real, real_roots):
            message = _tree_error(value, real, real_roots, setting, what)
            if message:
                errors[field] = message
    return errors


def _chat_template_kwargs_errors(kwargs: Any) -> dict[str, str]:
    """What the web refuses in ``chat_template_kwargs`` (see :data:`APPLY_CHAT_TEMPLATE_ARGS`)."""
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except (ValueError, RecursionError):
            return {}  # the run schema reports the JSON error itself
    if not isinstance(kwargs, dict):
        return {}
    errors: dict[str, str] = {}
    for key, value in kwargs.items():
        field = f"args.chat_template_kwargs.{str(key)[:64]}"
        if key in APPLY_CHAT_TEMPLATE_ARGS:
            errors[field] = (
                "not allowed from the web: it is an argument of apply_chat_template itself (a template, "
                "tools or rendering options), not a flag the model's template reads"
            )
        elif not isinstance(key, str) or not CHAT_TEMPLATE_KWARG_NAME.fullmatch(key):
            errors[field] = "must be a name (letters, digits, _; at most 64)"
        elif isinstance(value, str) and (
            len(value) > CHAT_TEMPLATE_KWARG_MAX_CHARS or any(m in value for m in ("{{", "{%", "{#"))
        ):
            errors[field] = (
                f"a string value must be at most {CHAT_TEMPLATE_KWARG_MAX_CHARS} characters and hold no "
                "Jinja ({{, {%, {#)"
            )
        elif not (value is None or isinstance(value, bool | int | float | str)):
            errors[field] = "must be true/false, a number, null or a short string (a flag the template reads)"
    return errors


def _args_errors(args: dict) -> dict[str, str]:
    errors: dict[str, str] = {}
    for key in CONTROLLED_ARGS:
        if key in args:
            errors[f"args.{key}"] = "is set by the control plane for each run; remove it"
    if "vllm_server_base_url" in args:
        errors["args.vllm_server_base_url"] += (
            " (to use a running server, name one the operator registered: resources.server; several: "
            "resources.vllm.servers)"
        )
    for key in RESUME_ARGS:
        if key in args:
            errors[f"args.{key}"] = "resume a stopped or failed run with POST /api/v1/runs/<id>/resume/"
    for key in MUST_BE_FALSY_ARGS:
        if args.get(key):
            errors[f"args.{key}"] = "is not allowed from the web or the API (remote code, hub access)"
    for key in MAPPING_ONLY_ARGS:
        if isinstance(args.get(key), str):
            errors[f"args.{key}"] = "must be an inline mapping; file paths are not accepted from the web"
    kwargs = args.get("model_init_kwargs")
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except (ValueError, RecursionError):
            kwargs = None  # the run schema reports the JSON error itself
    if isinstance(kwargs, dict):
        for key in kwargs:
            if key not in MODEL_INIT_KWARGS_ALLOWED:
                errors[f"args.model_init_kwargs.{key}"] = (
                    f"not allowed from the web; allowed: {', '.join(MODEL_INIT_KWARGS_ALLOWED)}"
                )
        attn = kwargs.get("attn_implementation")
        allowed_attn = (*LOCAL_ATTN_IMPLEMENTATIONS, *settings.GRPO_ALLOWED_ATTN_IMPLEMENTATIONS)
        if attn is not None and attn not in allowed_attn:
            errors["args.model_init_kwargs.attn_implementation"] = (
                f"{str(attn)[:80]!r} is not allowed from the web (hub kernels are fetched and imported); "
                f"allowed: {', '.join(allowed_attn)}; an operator adds installed ones with "
                "GRPO_ALLOWED_ATTN_IMPLEMENTATIONS"
            )
    errors.update(_chat_template_kwargs_errors(args.get("chat_template_kwargs")))
    backend = args.get("torch_compile_backend")
    if backend is not None and backend not in COMPILE_BACKENDS_ALLOWED:
        errors["args.torch_compile_backend"] = (
            f"not allowed from the web; one of {', '.join(COMPILE_BACKENDS_ALLOWED)} (or leave it unset)"
        )
    report_to = args.get("report_to")
    if report_to is not None:
        values = [report_to] if isinstance(report_to, str) else report_to
        if not isinstance(values, list) or any(v not in REPORT_TO_ALLOWED for v in values):
            errors["args.report_to"] = "integrations are not enabled from the web; use 'none'"
    return errors
