"""A run's token lengths before it starts: its longest prompt as the rollout renders it, its model's
context limit, and the ``max_model_len`` of a per-run vLLM server that fits both.

The same rules serve twice: the control plane refuses, when a run is created, what could not fit
(:mod:`controlplane.runs.launch_checks`), and the worker sizes the run's own server's
``--max-model-len`` before it starts it (:mod:`worker.supervisor`). Nothing here downloads or builds:
a model is read from a local directory (``config.json``, the tokenizer), a dataset through the
registry's loader (:func:`trainer.plugins.registry.load_dataset_by_name`). Tokenizers, configs and measured
prompts are cached per path in the process, so a second run on the same model and data costs nothing.

Every length is in tokens.
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "SERVED_CONTEXT",
    "ContextLimit",
    "PromptLengths",
    "TokenizerUnavailable",
    "fitted_max_model_len",
    "model_config",
    "model_context_limit",
    "run_prompt_lengths",
    "tokenizer_for",
]

# Registered models served with a context below their config's: the embedded tiny model's vLLM
# server runs with 1024 tokens (NOTES.md; its config.json says 2048). A run may still ask for more,
# up to the config's, with resources.vllm.max_model_len.
SERVED_CONTEXT: dict[str, int] = {"tiny": 1024}
# config.json keys vLLM derives a model's longest sequence from (the smallest present wins).
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_target_positions",
)
# RoPE scalings whose factor stretches the context past max_position_embeddings.
_STRETCHING_ROPE = ("linear", "dynamic", "yarn")
# A dataset sample is drawn with this seed, so a run's creation and its launch measure the same rows.
_SAMPLE_SEED = 0


class TokenizerUnavailable(RuntimeError):
    """The model directory's tokenizer cannot be loaded here (missing files, a package this host
    lacks): the prompts cannot be measured, which says nothing about the run."""


@dataclass(frozen=True)
class ContextLimit:
    """The most tokens (prompt + completion) a request may hold, and where that limit comes from
    (``"the model 'tiny'"``, ``"resources.vllm.max_model_len"``, ``"the vLLM server 'x'"``)."""

    tokens: int
    source: str


@dataclass(frozen=True)
class PromptLengths:
    """The longest prompt of a dataset, in tokens, as the rollout renders it (chat template with the
    generation prompt and the run's tool schemas); ``measured`` of ``total`` rows were tokenized."""

    longest: int
    measured: int
    total: int

    @property
    def sampled(self) -> bool:
        """True when only a sample of the rows was measured (a longer prompt may be elsewhere)."""
        return self.measured < self.total

    def joined(self, other: PromptLengths) -> PromptLengths:
        """The lengths of both datasets' rows together (the training and the eval set on one server)."""
        return PromptLengths(
            max(self.longest, other.longest), self.measured + other.measured, self.total + other.total
        )

    def text(self) -> str:
        """``the longest prompt (19 tokens)``, saying so when it was the longest of a sample."""
        if self.sampled:
            return f"the longest prompt of a sample of {self.measured} of {self.total} rows ({self.longest} tokens)"
        return f"the longest prompt ({self.longest} tokens)"


def _stamp(path: str) -> tuple[int, int] | None:
    """A file's (modification time, size): a cached reading of it is stale when either changed."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def model_config(model_dir: str) -> dict[str, Any] | None:
    """The model directory's ``config.json`` as a dict (cached per path and modification time);
    None when there is none or it is not JSON."""
    path = os.path.join(model_dir, "config.json")
    return _model_config(os.path.realpath(path), _stamp(path))


@functools.lru_cache(maxsize=64)
def _model_config(path: str, stamp: tuple[int, int] | None) -> dict[str, Any] | None:
    if stamp is None:
        return None
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (``text_config`` of a vision-language model)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def derived_max_len(config: dict[str, Any]) -> tuple[int, str] | None:
    """The longest sequence vLLM derives from a model's config (tokens) and the key it came from:
    the smallest of the length keys present, stretched by a RoPE scaling factor; None when the
    config names none. vLLM refuses to start with a larger ``--max-model-len``."""
    inner = text_config(config)
    found = [(int(inner[k]), k) for k in _LENGTH_KEYS if isinstance(inner.get(k), int) and inner[k] > 0]
    if not found:
        return None
    tokens, key = min(found)
    scaling = inner.get("rope_scaling") or inner.get("rope_parameters")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type") or scaling.get("type")
        factor = scaling.get("factor")
        if kind in _STRETCHING_ROPE and isinstance(factor, int | float) and factor > 1:
            base = scaling.get("original_max_position_embeddings")
            tokens = int((base if isinstance(base, int) and base > 0 else tokens) * factor)
    return tokens, key


def model_context_limit(*, model: str, model_dir: str | None) -> ContextLimit | None:
    """The context a run's own vLLM server gets for ``model`` unless the run sets
    ``resources.vllm.max_model_len``: a registered model's served context (:data:`SERVED_CONTEXT`),
    else what vLLM derives from ``model_dir``'s ``config.json``; None when neither is known (a hub
    model not downloaded yet)."""
    if model in SERVED_CONTEXT:
        return ContextLimit(SERVED_CONTEXT[model], f"the model {model!r}")
    config = model_config(model_dir) if model_dir else None
    derived = derived_max_len(config) if config else None
    if derived is None:
        return None
    return ContextLimit(derived[0], f"the model {model!r} (config.json {derived[1]})")


def tokenizer_for(model_dir: str) -> Any:
    """The tokenizer of a local model directory, loaded once per path and modification time, from
    local files only and without remote code (the web never runs a model's code)."""
    return _tokenizer(os.path.realpath(model_dir), _stamp(model_dir))


@functools.lru_cache(maxsize=16)
def _tokenizer(model_dir: str, stamp: tuple[int, int] | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)


def _sample_indices(total: int, sample_rows: int) -> list[int]:
    """Every row index when ``total <= sample_rows``, else ``sample_rows`` of them drawn with a fixed seed."""
    if total <= sample_rows:
        return list(range(total))
    return sorted(random.Random(_SAMPLE_SEED).sample(range(total), sample_rows))


def measure_prompts(
    *,
    tokenizer: Any,
    prompts: Sequence[Any],
    total: int,
    tool_schemas: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> PromptLengths:
    """Tokenize ``prompts`` (conversations, the rows chosen of ``total``) the way the rollout renders
    them (:class:`trainer.rollout.rendering.ConversationRenderer`: chat template, generation prompt,
    tool schemas) and return the longest. Raises ``ValueError`` naming the row for a prompt with
    image parts or one the chat template cannot render."""
    from trainer.tiny.chat_template import check_text_only

    longest = 0
    for i, prompt in enumerate(prompts):
        check_text_only(prompt, f"train_dataset prompt {i}")
        try:
            ids = tokenizer.apply_chat_template(
                prompt,
                tools=tool_schemas,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # a template error is the run's: the rollout would raise the same
            raise ValueError(
                f"the model's chat template cannot render a prompt: {type(exc).__name__}: {exc}"
            ) from None
        longest = max(longest, len(ids))
    return PromptLengths(longest=longest, measured=len(prompts), total=total)


def run_prompt_lengths(
    *,
    model_dir: str,
    dataset: str,
    dataset_config: str | None = None,
    dataset_split: str = "train",
    dataset_columns: dict[str, str] | None = None,
    tools: Sequence[str] = (),
    chat_template_kwargs: dict[str, Any] | None = None,
    sample_rows: int,
    field: str = "train_dataset",
) -> PromptLengths:
    """The longest prompt of a run's dataset (``dataset`` as the trainer loads it: a registered name,
    a local file or directory, a resolved hub snapshot) rendered with ``model_dir``'s tokenizer, the
    run's ``tools`` (dotted paths) and ``chat_template_kwargs``; at most ``sample_rows`` rows are
    tokenized. Cached per model, dataset (and its file's modification time) and options. ``field``
    names the document's field in the loader's errors (``train_dataset``, ``eval_dataset``).

    Raises ``ValueError`` when the dataset cannot feed the rollout (no ``prompt`` column, image
    parts, a template error) or cannot be loaded, :class:`TokenizerUnavailable` when the model's
    tokenizer cannot be loaded.
    """
    key = (
        os.path.realpath(model_dir),
        _stamp(model_dir),
        dataset,
        _stamp(dataset) if os.path.isabs(dataset) else None,
        dataset_config,
        dataset_split,
        tuple(sorted((dataset_columns or {}).items())),
        tuple(tools),
        json.dumps(chat_template_kwargs or {}, sort_keys=True, default=str),
        int(sample_rows),
        field,
    )
    return _run_prompt_lengths(key)


@functools.lru_cache(maxsize=64)
def _run_prompt_lengths(key: tuple) -> PromptLengths:
    model_dir, _, dataset, _, config, split, columns, tools, kwargs, sample_rows, field = key
    from trainer.plugins.registry import load_dataset_by_name, resolve_callable

    try:
        tokenizer = tokenizer_for(model_dir)
    except Exception as exc:
        raise TokenizerUnavailable(f"{type(exc).__name__}: {exc}") from exc
    try:
        data = load_dataset_by_name(dataset, config=config, split=split, columns=dict(columns), field=field)
    except Exception as exc:  # a loader's failure is the dataset's, in words
        raise ValueError(f"could not be loaded: {type(exc).__name__}: {exc}") from None
    if "prompt" not in data.column_names:
        raise ValueError(
            f"has no 'prompt' column (its columns: {', '.join(data.column_names)}); the trainer needs one: "
            "map a column to it with dataset_columns, e.g. {question: prompt}"
        )
    total = len(data)
    indices = _sample_indices(total, sample_rows)
    prompts = list((data.select(indices) if len(indices) < total else data)["prompt"])
    schemas = None
    if tools:
        from trainer.rollout.multiturn import tool_schema

        schemas = [tool_schema(resolve_callable(path)) for path in tools]
    return measure_prompts(
        tokenizer=tokenizer,
        prompts=prompts,
        total=total,
        tool_schemas=schemas,
        chat_template_kwargs=json.loads(kwargs) or None,
    )


def fitted_max_model_len(*, needed_tokens: int, cap: int, multiple: int, floor: int = 0) -> int:
    """A per-run server's ``max_model_len``: ``needed_tokens`` (longest prompt + max_completion_length)
    rounded up to a multiple of ``multiple``, at least ``floor``, at most ``cap`` (the model's limit)."""
    step = max(1, int(multiple))
    rounded = -(-int(needed_tokens) // step) * step
    return max(1, min(int(cap), max(rounded, int(floor))))
