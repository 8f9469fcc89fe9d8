"""Preflight of a run document: the checks its launch would make, made when the run is created.

"Accepted means it runs" (issue 28). :func:`run_launch_errors` runs after the schema and the
control plane's own rules passed (:func:`~controlplane.runs.validation.run_document_validate`), on
the model and the vLLM server the run will use, and reports ``{field path: message}`` like them:

* the trainer's config: ``AsyncGRPOConfig`` is built as the trainer builds it
  (:func:`trainer.config.run_config.validate_run_document`: TrainingArguments' own rules between fields);
  GPU-only options are left to the worker when its pool has GPUs and this host has none;
* the vLLM server's context (``max_model_len``): the run's own server's (``resources.vllm.max_model_len``,
  else the model's limit: :func:`trainer.config.run_lengths.model_context_limit`), or a named server's,
  read from its ``/v1/models``; ``args.max_completion_length`` plus the longest prompt (the dataset
  through the registry's loader, rendered with the model's tokenizer and chat template; a large
  dataset is sampled, ``GRPO_PREFLIGHT_SAMPLE_ROWS``, and the message says so) must fit in it; the
  server starts at all (``resources.vllm.max_model_len`` within the model's limit, the tensor-parallel
  size dividing the attention heads);
* ``args.token_budget`` (if set) holds one prompt and one full completion (else such a sample fits no
  row and is dropped);
* the dataset feeds the rollout: a ``prompt`` column, text-only prompts the chat template renders;
  so does ``eval_dataset`` (its split ``eval_dataset_split``, the same ``dataset_columns``), whose
  longest prompt plus ``max_completion_length`` must fit the server's context too (refused under
  ``eval_dataset``, or ``eval_dataset_split`` for a split it does not have);
* a named server serves the run's model, and has the LoRA adapter slots the trainer checks for
  adapter-only sync (``max_staleness + 2``, rank); so does a run's own server started with
  ``--enable-lora`` (``GRPO_VLLM_EXTRA_ARGS``).

Nothing is downloaded, built or started: a hub model or dataset not in the local hub cache, the tiny
model not built yet, a named server that does not answer within ``GRPO_PREFLIGHT_SERVER_TIMEOUT_S``
leave the checks that need them out (the worker fetches, builds and waits later; what then fails
ends the run with one sentence: :func:`worker.log_records.failure_sentence`).

The worker sizes the run's own server with :func:`per_run_max_model_len` (the same rules) once the
model and the dataset are local, and refuses the launch in one sentence when the data changed so
that the run no longer fits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shlex
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from trainer.config.resources import Resources, parse_resources
from trainer.config.run_config import DEFAULT_EVAL_SPLIT, RunConfigError
from trainer.config.run_lengths import (
    ContextLimit,
    PromptLengths,
    TokenizerUnavailable,
    derived_max_len,
    fitted_max_model_len,
    model_config,
    model_context_limit,
    run_prompt_lengths,
    text_config,
)
from trainer.config.run_schema import DEFAULTS
from trainer.plugins import registry
from trainer.plugins.hub import cached_snapshot, is_hub_id
from trainer.processes.serve import DEFAULT_MAX_MODEL_LEN

__all__ = ["ContextPlan", "LaunchRefused", "per_run_max_model_len", "process_state_kept", "run_launch_errors"]

logger = logging.getLogger(__name__)

# transformers refuses these on a host without the GPU feature they need (bf16, tf32, fp16 eval):
# they are judged on the worker when the run's pool has GPUs and this host has none.
DEVICE_ARGS = ("bf16", "fp16", "tf32", "bf16_full_eval", "fp16_full_eval")
# vLLM's LoRA defaults when --enable-lora is given without --max-loras / --max-lora-rank.
VLLM_DEFAULT_MAX_LORAS = 1
VLLM_DEFAULT_MAX_LORA_RANK = 16
PEFT_DEFAULT_RANK = 8  # peft's LoraConfig.r
# Architecture fields compared to tell whether a served model is the run's model under another path.
SHAPE_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class LaunchRefused(Exception):
    """The run cannot start as it is: ``str()`` is one sentence naming the field to change."""


@dataclass(frozen=True)
class ContextPlan:
    """The run's own vLLM server's ``max_model_len`` (tokens) and how it was chosen, for the events."""

    tokens: int
    reason: str


# The checks change process-wide state and restore it (os.environ, accelerate's PartialState, torch's
# thread count) and import transformers lazily: under daphne every request runs in its own thread, and
# two checks at once saw each other's state or a half-imported module ("module 'transformers' has no
# attribute 'PreTrainedTokenizerBase'", a 400 for a valid document in the CI of 2026-12-07). One at a
# time per process: they are CPU-bound under the GIL, so little is lost.
_CHECKS_ONE_AT_A_TIME = threading.Lock()


# ------------------------------------------------------------------------------------ entry points
def run_launch_errors(*, document: dict) -> dict[str, str]:
    """Every problem the launch of ``document`` (a document the schema and the control plane's rules
    accepted) would meet, as ``{field path: message}``; ``{}`` when it would start and fit.

    Thread-safe: calls in one process run one at a time (``_CHECKS_ONE_AT_A_TIME``)."""
    with _CHECKS_ONE_AT_A_TIME:
        return _launch_errors(document)


def _launch_errors(document: dict) -> dict[str, str]:
    errors = _trainer_config_errors(document)
    if errors:
        return errors  # the lengths below read args the config refused
    args = {**DEFAULTS, **(document.get("args") or {})}
    completion = int(args["max_completion_length"])
    resources = parse_resources(document.get("resources"))
    model = document["model"]
    model_dir = _local_model_dir(model=model, revision=document.get("model_revision"))
    # Each prompt source (the training set, the eval set): its longest prompt, or why it cannot feed
    # the rollout (then its lengths are not judged).
    measured = {
        source.field: _source_prompt_lengths(document=document, model_dir=model_dir, source=source)
        for source in _prompt_sources(document)
    }
    for _, source_errors in measured.values():
        errors.update(source_errors)
    prompts, train_errors = measured.get("train_dataset", (None, {}))
    dataset_error = bool(train_errors)
    # Judged against the context: the training prompts (unmeasured: one of 1 token), the eval
    # prompts where measured; never a set that cannot feed the rollout.
    judged = {} if dataset_error else {"train_dataset": prompts}
    eval_prompts, eval_errors = measured.get("eval_dataset", (None, {}))
    if eval_prompts is not None and not eval_errors:
        judged["eval_dataset"] = eval_prompts
    if resources.server is None:
        limit, server_errors = _own_server_limit(model=model, model_dir=model_dir, resources=resources)
        where = _OWN
    else:
        limit, server_errors, where = _named_servers_limit(
            resources=resources, model=model, model_dir=model_dir
        )
    errors.update(server_errors)
    for source_field, source_prompts in judged.items() if limit is not None else ():
        for field, message in _length_errors(
            completion=completion,
            prompts=source_prompts,
            limit=limit,
            where=where,
            own_server=resources.server is None,
            field=source_field,
        ).items():
            errors.setdefault(field, message)
    budget = args.get("token_budget")
    if isinstance(budget, int) and not dataset_error:
        longest = prompts.longest if prompts is not None else 1
        if budget < longest + completion:
            errors.setdefault(
                "args.token_budget",
                f"{budget} tokens cannot hold one prompt and one full completion "
                f"({_prompt_words(prompts)} + max_completion_length {completion} = {longest + completion} tokens): "
                f"such a sample fits no row and is dropped; set token_budget to at least {longest + completion} "
                "or lower max_completion_length",
            )
    errors.update(_lora_errors(document=document, resources=resources, args=args))
    for field, message in _model_errors(model=model, model_dir=model_dir, args=args).items():
        errors.setdefault(field, message)
    return errors


def per_run_max_model_len(
    *, document: dict, model_dir: str, dataset: str | None, eval_dataset: str | None = None
) -> ContextPlan:
    """The ``max_model_len`` of the run's own vLLM server, once ``model_dir`` and ``dataset`` (and
    ``eval_dataset``, whose prompts the same server completes) are local
    (the worker, before it starts the server): ``resources.vllm.max_model_len`` when given, else the
    run's lengths (longest prompt of either dataset + ``max_completion_length``) rounded up to a multiple of
    ``GRPO_VLLM_MAX_MODEL_LEN_MULTIPLE`` and capped at the model's limit. When not every prompt was
    measured (a sampled dataset, prompts from an environment) or turns add to the context (tools,
    environments), it is at least the former fixed default (2048 tokens, or the model's limit).

    Raises :class:`LaunchRefused` (one sentence) when the run no longer fits the model's limit, e.g.
    its dataset changed since the run was created.
    """
    resources = parse_resources(document.get("resources"))
    if resources.max_model_len is not None:
        return ContextPlan(resources.max_model_len, "resources.vllm.max_model_len")
    model = document["model"]
    args = {**DEFAULTS, **(document.get("args") or {})}
    completion = int(args["max_completion_length"])
    limit = model_context_limit(model=model, model_dir=model_dir) or ContextLimit(
        DEFAULT_MAX_MODEL_LEN, "trainer serve's default (the model's config names no limit)"
    )
    lengths: dict[str, PromptLengths] = {}  # field -> its dataset's longest prompt, where measured
    note = ""
    local = {"train_dataset": dataset, "eval_dataset": eval_dataset}
    for source in _prompt_sources(document):
        if not local[source.field]:
            continue
        try:
            lengths[source.field] = _measure(
                document=document, model_dir=model_dir, dataset=local[source.field], source=source
            )
        except Exception as exc:  # the trainer reports a dataset it cannot use, in its own words
            what = "prompts" if source.field == "train_dataset" else "eval prompts"
            note += f" ({what} not measured: {type(exc).__name__}: {str(exc)[:200]})"
    # Unmeasured training prompts are judged as one of 1 token; an unmeasured eval set not at all.
    refusal = _length_errors(
        completion=completion, prompts=lengths.get("train_dataset"), limit=limit, where=_OWN
    )
    if "eval_dataset" in lengths:
        for field, message in _length_errors(
            completion=completion,
            prompts=lengths["eval_dataset"],
            limit=limit,
            where=_OWN,
            field="eval_dataset",
        ).items():
            refusal.setdefault(field, message)
    # The server completes both sets: the longest of either sizes it, "sampled" when either was.
    prompts = functools.reduce(PromptLengths.joined, lengths.values()) if lengths else None
    if refusal:
        field, message = next(iter(refusal.items()))
        raise LaunchRefused(f"{field}: {message}")
    multi_turn = bool(document.get("tools") or document.get("environment_factory"))
    floor = (
        min(DEFAULT_MAX_MODEL_LEN, limit.tokens) if prompts is None or prompts.sampled or multi_turn else 0
    )
    needed = (prompts.longest if prompts is not None else 1) + completion
    multiple = settings.GRPO_VLLM_MAX_MODEL_LEN_MULTIPLE
    tokens = fitted_max_model_len(needed_tokens=needed, cap=limit.tokens, multiple=multiple, floor=floor)
    why = "turns add to the context" if multi_turn else "not every prompt was measured"
    reason = (
        f"{_prompt_words(prompts)} + max_completion_length {completion} = {needed} tokens, rounded up to a "
        f"multiple of {multiple} (GRPO_VLLM_MAX_MODEL_LEN_MULTIPLE)"
        + (f", at least {floor} ({why})" if floor else "")
        + f", at most {limit.tokens} ({limit.source}){note}; resources.vllm.max_model_len sets it"
    )
    return ContextPlan(tokens, reason)


# ------------------------------------------------------------------------------ the trainer's config
@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """TrainingArguments sets a few ACCELERATE_* / FSDP_* variables while it checks and initialises
    accelerate's process-wide PartialState from the first config it sees, and building a trainer may
    set torch's thread count: a document checked in the web process must change none of them for the
    next one. Its warnings are silenced (the refusals are what is reported)."""
    import torch
    from accelerate.state import PartialState

    saved, threads = dict(os.environ), torch.get_num_threads()
    initialised = bool(PartialState._shared_state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        # Key by key, never clear(): a thread outside the checks reading the environment meanwhile
        # (a logger, a settings lookup) must never find it empty.
        for key in set(os.environ) - set(saved):
            os.environ.pop(key, None)
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        if not initialised and PartialState._shared_state:
            PartialState._reset_state()
        torch.set_num_threads(threads)


def _trainer_config_errors(document: dict) -> dict[str, str]:
    """``AsyncGRPOConfig`` built as ``python -m trainer train`` builds it; its refusal by field."""
    from trainer.config.run_config import validate_run_document

    doc = document
    if _gpu_options_judged_by_worker(document):
        doc = {
            **document,
            "args": {k: v for k, v in (document.get("args") or {}).items() if k not in DEVICE_ARGS},
        }
    try:
        with process_state_kept():
            spec = validate_run_document(doc, output_dir=str(Path(settings.GRPO_RUNS_DIR) / "preflight"))
            return _optimizer_errors(spec.args)
    except RunConfigError as exc:
        return {field: " ".join(message.split()) for field, message in exc.errors.items()}


# The step count a run without max_steps trains towards (AsyncGRPOTrainer.set_initial_training_values).
EPOCH_RUN_STEPS = 10**8


def _optimizer_errors(args: Any) -> dict[str, str]:
    """What ``train()`` sets up first, before any step: the optimizer (its package installed; the
    control plane's hosts carry the worker's packages) and the learning-rate schedule (with its
    ``lr_scheduler_kwargs``), built on a one-parameter stand-in for the model."""
    import torch
    from transformers import Trainer, get_scheduler

    errors: dict[str, str] = {}
    try:
        Trainer.get_optimizer_cls_and_kwargs(args)
    except (ImportError, ValueError) as exc:  # a missing package, named by transformers
        message = " ".join(str(exc).split())
        if "install" in message.lower() or "import" in message.lower() or isinstance(exc, ImportError):
            errors["args.optim"] = f"{args.optim}: {message}"
    except Exception as exc:  # needs the model (GaLore, LOMO...): judged when the trainer starts
        logger.debug("optimizer %s left to the trainer: %s", args.optim, exc)
    steps = args.max_steps if args.max_steps > 0 else EPOCH_RUN_STEPS
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    try:
        get_scheduler(
            args.lr_scheduler_type,
            optimizer=stand_in,
            num_warmup_steps=args.get_warmup_steps(steps),
            num_training_steps=steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )
    except (ValueError, TypeError, KeyError) as exc:
        errors["args.lr_scheduler_type"] = (
            f"{args.lr_scheduler_type}: {' '.join(str(exc).split())} (lr_scheduler_kwargs sets its options)"
        )
    return errors


def _gpu_options_judged_by_worker(document: dict) -> bool:
    """True when the run's pool has GPU workers (or, none registered yet, the run asks for GPUs)
    while this host has no CUDA device: GPU-only options cannot be judged here."""
    from controlplane.runs import worker_hosts

    if not any(k in (document.get("args") or {}) for k in DEVICE_ARGS):
        return False
    resources = parse_resources(document.get("resources"))
    largest = worker_hosts.pool_max_gpus(pool=resources.pool or settings.GRPO_RUNS_QUEUE)
    target_has_gpus = largest > 0 if largest is not None else resources.explicit_gpus() > 0
    return target_has_gpus and not _local_cuda()


@functools.cache
def _local_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# ------------------------------------------------------------------------------ model and prompts
def _local_model_dir(*, model: str, revision: str | None) -> str | None:
    """The run's model as a local directory, without downloading or building; None when it is not
    local yet (then the checks that need its tokenizer or config are left to the worker)."""
    if model == "tiny":
        # The registry's loader builds the tiny model when no build of its sources exists (~3 min):
        # only a current build is read here; the worker builds it otherwise.
        from trainer.tiny.build import current_builds

        builds = current_builds(0)
        return str(builds[0]) if builds else None
    if registry.is_registered("model", model):
        return _registered_model_dir(model)
    if os.path.isdir(model):
        return model
    if is_hub_id(model):
        # Offline, from the local hub cache only: the worker downloads (with its own HF_TOKEN) later.
        path = cached_snapshot(model, revision=revision)
        return str(path) if path is not None and (path / "config.json").exists() else None
    return None


@functools.cache
def _registered_model_dir(name: str) -> str | None:
    """A registered model's loader returns its local directory (the registry's contract), once per process."""
    try:
        path = registry.resolve_model(name)
    except Exception:  # the worker reports a broken loader when it launches
        logger.warning("preflight: the loader of model %r failed", name, exc_info=True)
        return None
    return path if os.path.isdir(path) else None


def _model_errors(*, model: str, model_dir: str | None, args: dict) -> dict[str, str]:
    """What the trainer refuses about the model when it loads it, read from its config.json: an
    architecture tree packing cannot train, a router loss weight for a model without experts."""
    config = model_config(model_dir) if model_dir else None
    if config is None:
        return {}
    from trainer.step.modeling import config_architecture_refusal

    inner = text_config(config)
    errors: dict[str, str] = {}
    layer_types = inner.get("layer_types")
    refusal = config_architecture_refusal(
        model_type=str(inner.get("model_type") or config.get("model_type") or ""),
        layer_types={str(t) for t in layer_types} if isinstance(layer_types, list) else set(),
    )
    if refusal:
        errors["model"] = f"{model!r}: {refusal}"
    experts = any(inner.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if args.get("router_aux_loss_coef") is not None and not experts:
        errors["args.router_aux_loss_coef"] = (
            f"is set but the model {model!r} is not a Mixture-of-Experts model (its config.json names no "
            "experts), and the trainer refuses it; leave router_aux_loss_coef unset"
        )
    return errors


def _prompt_columns(document: dict) -> set[str]:
    """``{"prompt"}`` when the trainer reads prompts from the dataset (no environment makes them)."""
    return set() if document.get("environment_factory") else {"prompt"}


@dataclass(frozen=True)
class _DatasetSource:
    """One dataset the run reads prompts from, as the document names it, and the fields its
    problems are reported under (``field``; ``split_field`` for a split it does not have, None:
    under ``field`` too)."""

    field: str
    split_field: str | None
    name: Any
    revision: str | None
    config: str | None
    split: str


_OWN = "the run's vLLM server"


def _prompt_sources(document: dict) -> list[_DatasetSource]:
    """The datasets the trainer reads prompts from: the training set, then ``eval_dataset`` if set;
    none when an environment makes the prompts (its ``reset`` may write them)."""
    if "prompt" not in _prompt_columns(document):
        return []
    evals = _eval_source(document)
    return [_train_source(document), *([evals] if evals is not None else [])]


def _train_source(document: dict) -> _DatasetSource:
    return _DatasetSource(
        field="train_dataset",
        split_field=None,
        name=document.get("train_dataset"),
        revision=document.get("dataset_revision"),
        config=document.get("dataset_config"),
        split=document.get("dataset_split") or "train",
    )


def _eval_source(document: dict) -> _DatasetSource | None:
    """``eval_dataset`` (read with the training set's ``dataset_columns``), or None when not set."""
    if not isinstance(document.get("eval_dataset"), str) or not document["eval_dataset"]:
        return None
    return _DatasetSource(
        field="eval_dataset",
        split_field="eval_dataset_split",
        name=document["eval_dataset"],
        revision=document.get("eval_dataset_revision"),
        config=document.get("eval_dataset_config"),
        split=document.get("eval_dataset_split") or DEFAULT_EVAL_SPLIT,
    )


def _local_dataset(source: _DatasetSource) -> str | None:
    """``source`` as the trainer loads it, without fetching: a hub id not in the local cache gives
    None (the worker downloads it later)."""
    dataset = source.name
    if not isinstance(dataset, str) or not dataset:
        return None
    if is_hub_id(dataset) and not registry.is_registered("dataset", dataset) and not Path(dataset).exists():
        path = cached_snapshot(dataset, repo_type="dataset", revision=source.revision)
        return str(path) if path is not None else None
    return dataset


def _measure(*, document: dict, model_dir: str, dataset: str, source: _DatasetSource) -> PromptLengths:
    """The longest prompt of ``dataset`` (``source`` local) with the model's tokenizer
    (:func:`trainer.config.run_lengths.run_prompt_lengths`); ``source`` gives its config and split."""
    from trainer.config.run_schema import parse_json_object

    args = document.get("args") or {}
    return run_prompt_lengths(
        model_dir=model_dir,
        dataset=dataset,
        dataset_config=source.config,
        dataset_split=source.split,
        dataset_columns=document.get("dataset_columns") or None,
        tools=list(document.get("tools") or []),
        chat_template_kwargs=parse_json_object("chat_template_kwargs", args.get("chat_template_kwargs")),
        sample_rows=settings.GRPO_PREFLIGHT_SAMPLE_ROWS,
        field=source.field,
    )


def _source_prompt_lengths(
    *, document: dict, model_dir: str | None, source: _DatasetSource
) -> tuple[PromptLengths | None, dict[str, str]]:
    """``(the longest prompt of ``source`` or None when it cannot be measured here, {field: why it
    cannot feed the rollout})``: a split it lacks under ``source.split_field`` (if any), the rest under
    ``source.field``."""
    dataset = _local_dataset(source)
    if model_dir is None or dataset is None:
        return None, {}
    try:
        return _measure(document=document, model_dir=model_dir, dataset=dataset, source=source), {}
    except TokenizerUnavailable:  # e.g. a tokenizer package this host lacks: the worker's may load it
        logger.info("preflight: the tokenizer of %s cannot be loaded here; prompts not measured", model_dir)
        return None, {}
    except ValueError as exc:
        text = str(exc)
        if source.split_field and "split" in text.lower() and source.split.lower() in text.lower():
            return None, {
                source.split_field: f"{source.split!r}: {source.name!r} {text}; name a split it has"
            }
        return None, {source.field: f"{source.name!r} {text}"}
    except Exception:  # this host's problem, not the document's: not refused
        logger.warning("preflight: could not measure the prompts of %r", dataset, exc_info=True)
        return None, {}


def _prompt_words(prompts: PromptLengths | None) -> str:
    return prompts.text() if prompts is not None else "a prompt (at least 1 token)"


# ------------------------------------------------------------------------------ context limits
def _own_server_limit(
    *, model: str, model_dir: str | None, resources: Resources
) -> tuple[ContextLimit | None, dict[str, str]]:
    """The run's own server's context and what would stop vLLM from starting with the placement's flags."""
    errors: dict[str, str] = {}
    config = model_config(model_dir) if model_dir else None
    derived = derived_max_len(config) if config else None
    if resources.max_model_len is not None:
        limit: ContextLimit | None = ContextLimit(resources.max_model_len, "resources.vllm.max_model_len")
        if derived is not None and resources.max_model_len > derived[0]:
            errors["resources.vllm.max_model_len"] = (
                f"{resources.max_model_len} is above the limit of the model {model!r}, {derived[0]} tokens "
                f"(config.json {derived[1]}); vLLM refuses to start with it: set at most {derived[0]}"
            )
    else:
        limit = model_context_limit(model=model, model_dir=model_dir)
    heads = text_config(config).get("num_attention_heads") if config else None
    tp = resources.tensor_parallel_size
    if tp > 1 and isinstance(heads, int) and heads % tp:
        errors["resources.vllm.tensor_parallel_size"] = (
            f"{tp} does not divide the {heads} attention heads of the model {model!r}; vLLM refuses to "
            "start: choose a divisor of the head count"
        )
    return limit, errors


def _length_errors(
    *,
    completion: int,
    prompts: PromptLengths | None,
    limit: ContextLimit,
    where: str,
    own_server: bool = True,
    field: str = "train_dataset",
) -> dict[str, str]:
    """The refusal (one field, one line) when a prompt and a full completion do not fit ``limit``:
    under ``field`` when the prompts alone fill it, else under ``args.max_completion_length`` (for the
    training set; an eval set's overflow stays under its own ``field``)."""
    raise_it = (
        "set resources.vllm.max_model_len"
        if own_server and limit.source != "resources.vllm.max_model_len"
        else "raise resources.vllm.max_model_len"
        if own_server
        else "use a server with a larger --max-model-len"
    )
    source = f"{limit.tokens}-token limit of {where} (max_model_len), which comes from {limit.source}"
    if prompts is not None and prompts.longest >= limit.tokens:
        return {
            field: (
                f"{prompts.text()} leaves no room for a completion in the {source}; shorten the prompts "
                f"or {raise_it}"
            )
        }
    longest = prompts.longest if prompts is not None else 1
    if longest + completion <= limit.tokens:
        return {}
    if prompts is None:
        message = (
            f"{completion} tokens leave no room for a prompt in the {source}; set max_completion_length "
            f"below {limit.tokens}"
        )
    else:
        message = (
            f"{completion} tokens plus {prompts.text()} make {longest + completion}, over the {source}; "
            f"set max_completion_length to at most {limit.tokens - longest}"
        )
    if field != "train_dataset":
        return {field: f"its prompts leave too little room for a completion: {message}"}
    return {"args.max_completion_length": message}


def _named_servers_limit(
    *, resources: Resources, model: str, model_dir: str | None
) -> tuple[ContextLimit | None, dict[str, str], str]:
    """The smallest context of the run's named servers (the trainer's token budget and lengths obey
    the smallest), whether each serves the run's model, and which server the limit is."""
    limit: ContextLimit | None = None
    errors: dict[str, str] = {}
    where = f"the vLLM server {resources.server!r}"
    for name in resources.servers:
        own, own_errors = _named_server_limit(
            name=name, model=model, model_dir=model_dir, field=resources.servers_field
        )
        for field, message in own_errors.items():
            errors.setdefault(field, message)
        if own is not None and (limit is None or own.tokens < limit.tokens):
            limit, where = own, f"the vLLM server {name!r}"
    return limit, errors, where


def _named_server_limit(
    *, name: str, model: str, model_dir: str | None, field: str = "resources.server"
) -> tuple[ContextLimit | None, dict[str, str]]:
    """A named server's context from its ``/v1/models`` and whether it serves the run's model."""
    served = _served_models(settings.GRPO_VLLM_SERVERS[name])
    if served is None:
        # Not answering now is not a refusal: an operator's server may be started after the run is
        # queued (the run waits for it; the worker's health check reports it if it never comes).
        return None, {}
    entry, problem = _served_entry(served=served, model=model, model_dir=model_dir)
    errors = {field: f"vLLM server {name!r} {problem}"} if problem else {}
    if entry is None or not isinstance(entry.get("max_model_len"), int):
        return None, errors
    return ContextLimit(int(entry["max_model_len"]), f"the vLLM server {name!r} (its /v1/models)"), errors


def _served_models(url: str) -> list[dict] | None:
    import httpx

    from trainer.processes.server_checks import served_models

    try:
        return served_models(url, timeout_s=settings.GRPO_PREFLIGHT_SERVER_TIMEOUT_S)
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def _served_entry(*, served: list[dict], model: str, model_dir: str | None) -> tuple[dict | None, str]:
    """The ``/v1/models`` entry the trainer will generate with, and why the server does not serve the
    run's model ("" when it does, or when that cannot be told from here)."""
    if not served:
        return None, "serves no model (/v1/models is empty)"
    names = {model}
    if model_dir:
        names |= {model_dir, os.path.realpath(model_dir)}
    if model == "tiny":
        from trainer.plugins.registry import cache_root
        from trainer.tiny.build import source_hash

        names.add(str(cache_root() / "tiny" / source_hash()[:16]))  # where the worker's copy lives
    for entry in served:
        if entry.get("id") in names or entry.get("root") in names:
            return entry, ""
    ours = model_config(model_dir) if model_dir else None
    ids = [str(e.get("id")) for e in served]
    for entry in served:
        theirs = _served_config(entry)
        if ours is not None and theirs is not None:
            if _shape(theirs) == _shape(ours):
                return entry, ""
            if len(served) == 1:
                return entry, (
                    f"serves {ids[0]!r}, a different model from the run's {model!r} "
                    f"({_shape_text(theirs)} vs {_shape_text(ours)}); name the model it serves, or another server"
                )
    if len(served) > 1:
        return None, (
            f"serves {', '.join(ids)}, none of them the run's model {model!r}; the trainer cannot choose: "
            "use a server that serves the run's model"
        )
    only = served[0]
    if is_hub_id(model) and is_hub_id(only.get("id")) and only.get("id") != model:
        return only, f"serves {only.get('id')!r}, not the run's model {model!r}; name the model it serves"
    return only, ""  # a served name that cannot be compared here: the trainer uses the one served


def _served_config(entry: dict) -> dict | None:
    """The config of what a server serves, when its path (or its hub id, cached) is readable here."""
    for value in (entry.get("root"), entry.get("id")):
        if not isinstance(value, str):
            continue
        if os.path.isdir(value):
            return model_config(value)
        if is_hub_id(value):
            path = cached_snapshot(value)
            if path is not None:
                return model_config(str(path))
    return None


def _shape(config: dict) -> tuple:
    inner = text_config(config)
    return tuple(str(inner.get(k, config.get(k))) for k in SHAPE_KEYS)


def _shape_text(config: dict) -> str:
    inner = text_config(config)
    arch = (config.get("architectures") or ["?"])[0]
    return f"{arch}, {inner.get('num_hidden_layers')} layers x {inner.get('hidden_size')}"


# ------------------------------------------------------------------------------------- LoRA slots
@dataclass(frozen=True)
class _LoraServing:
    max_loras: int
    max_lora_rank: int
    runtime_updating: bool
    where: str
    fix: str


def _lora_errors(*, document: dict, resources: Resources, args: dict) -> dict[str, str]:
    """What the trainer checks before adapter-only sync to a ``--enable-lora`` server
    (:func:`trainer.weight_sync.lora.check_server_lora`): slots for ``max_staleness + 2`` adapter
    versions, a large enough ``--max-lora-rank``, runtime loading on. An adapter vLLM cannot serve
    as it is (bias, modules_to_save) is merged and synced in full: nothing to check."""
    peft = document.get("peft_config")
    if not isinstance(peft, dict) or peft.get("bias", "none") != "none" or peft.get("modules_to_save"):
        return {}
    if resources.servers:
        # Adapter-only sync needs every server to serve LoRA; otherwise the adapter is merged.
        servings = [_named_lora(name) for name in resources.servers]
        if any(serving is None for serving in servings):
            return {}
    else:
        servings = [_own_lora()]
        if servings[0] is None:
            return {}
    errors: dict[str, str] = {}
    for serving in servings:
        for field, message in _lora_serving_errors(
            serving, peft=peft, args=args, field=resources.servers_field
        ).items():
            errors.setdefault(field, message)
    return errors


def _lora_serving_errors(serving: _LoraServing, *, peft: dict, args: dict, field: str) -> dict[str, str]:
    """What one LoRA server lacks for the run's adapter (rank, slots, runtime loading)."""
    from trainer.rollout.flow import StalenessPolicy

    errors: dict[str, str] = {}
    rank = int(peft.get("r", PEFT_DEFAULT_RANK))
    if rank > serving.max_lora_rank:
        errors["peft_config.r"] = (
            f"{rank} is above the --max-lora-rank {serving.max_lora_rank} of {serving.where}; lower r or "
            f"{serving.fix} a larger --max-lora-rank"
        )
    slots = StalenessPolicy(max_staleness=int(args["max_staleness"])).lora_slots
    if slots > serving.max_loras:
        errors["args.max_staleness"] = (
            f"{args['max_staleness']} needs max_staleness + 2 = {slots} LoRA adapter slots and {serving.where} "
            f"has --max-loras {serving.max_loras}; lower max_staleness to {max(0, serving.max_loras - 2)} "
            f"or {serving.fix} --max-loras {slots}"
        )
    if not serving.runtime_updating:
        errors.setdefault(
            field,
            f"{serving.where} serves LoRA without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, so adapters cannot be "
            "loaded while it runs; restart it with that variable set",
        )
    return errors


def _own_lora() -> _LoraServing | None:
    """The run's own server's LoRA flags, from ``GRPO_VLLM_EXTRA_ARGS`` (``trainer serve`` turns on
    runtime loading whenever ``--enable-lora`` is given)."""
    try:
        flags = shlex.split(settings.GRPO_VLLM_EXTRA_ARGS)
    except ValueError:
        return None
    if "--enable-lora" not in flags:
        return None

    def value(flag: str, default: int) -> int:
        for i, item in enumerate(flags):
            text = item.split("=", 1)[1] if item.startswith(flag + "=") else None
            if item == flag and i + 1 < len(flags):
                text = flags[i + 1]
            if text is not None:
                with contextlib.suppress(ValueError):
                    return int(text)
        return default

    return _LoraServing(
        max_loras=value("--max-loras", VLLM_DEFAULT_MAX_LORAS),
        max_lora_rank=value("--max-lora-rank", VLLM_DEFAULT_MAX_LORA_RANK),
        runtime_updating=True,
        where="the run's vLLM server (GRPO_VLLM_EXTRA_ARGS)",
        fix="have the operator add to GRPO_VLLM_EXTRA_ARGS",
    )


def _named_lora(name: str) -> _LoraServing | None:
    """A named server's LoRA settings from its ``/server_info``; None without ``--enable-lora`` or
    when it does not answer (not refused: it may start later)."""
    from trainer.weight_sync.client import WeightSyncError, server_info

    try:
        info = server_info(settings.GRPO_VLLM_SERVERS[name], timeout=settings.GRPO_PREFLIGHT_SERVER_TIMEOUT_S)
    except WeightSyncError:
        return None
    config = (info.get("vllm_config") or {}).get("lora_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        return None
    updating = (info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return _LoraServing(
        max_loras=int(config.get("max_loras") or VLLM_DEFAULT_MAX_LORAS),
        max_lora_rank=int(config.get("max_lora_rank") or VLLM_DEFAULT_MAX_LORA_RANK),
        runtime_updating=updating in (True, 1, "1", "true", "True"),
        where=f"the vLLM server {name!r}",
        fix="restart it with",
    )
