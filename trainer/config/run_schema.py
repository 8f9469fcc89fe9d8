"""The one schema of a run document's ``args``: every field a run may set, checked without transformers.

* :data:`SPEC_FIELDS`: AsyncGRPOConfig's own fields (the spec's, and the TrainingArguments defaults
  it changes) with their JSON type, default, choices and help. ``AsyncGRPOConfig`` declares its
  fields from this table (:func:`trainer.config.async_grpo_config` ``_spec_field``), so the two cannot drift.
* :data:`FIELDS`: those plus every other ``TrainingArguments`` field, read from the generated
  :mod:`trainer.config.training_args_fields` (name -> JSON type, default, choices).
* Ranges: :data:`trainer.config.config_ranges.FIELD_RANGES`.
* Cross-field rules (:data:`RULES`): plain functions over the field values (defaults filled in).

:func:`args_errors` checks a document's ``args`` mapping with all of it, reporting every problem at
once as ``{field: message}``; ``AsyncGRPOConfig.__post_init__`` runs :func:`config_errors` (ranges,
choices and rules) on its own values. What needs the runtime stays in AsyncGRPOConfig and is checked
when the trainer builds it (``python -m trainer train``): the bf16 / torch_compile /
tree_min_shared_tokens defaults (CUDA present?), the CPU multi-process switch, and TrainingArguments'
own ``__post_init__`` rules between its fields.

Pure stdlib: the control plane and the diagnosis import this without torch or transformers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from trainer.config.config_ranges import FIELD_RANGES, Range, range_errors
from trainer.config.training_args_fields import TRAINING_ARGS_FIELDS

__all__ = [
    "DEFAULTS",
    "DTYPES",
    "FIELDS",
    "RULES",
    "SPEC_FIELDS",
    "FieldSpec",
    "args_errors",
    "config_errors",
    "parse_json_object",
]

DTYPES = ("auto", "bfloat16", "float16", "float32")
# Integers beyond int64 overflow torch and numpy.
INT_LIMIT = 2**63 - 1
KIND_TEXT = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "dict": "a mapping",
    "list": "a list",
}


@dataclass(frozen=True)
class FieldSpec:
    """One field of ``args``: ``kinds`` are the JSON kinds it takes (None: any, left to the runtime),
    ``nullable`` whether ``null`` is one, ``str_items`` whether list items must be strings,
    ``choices`` the allowed strings, ``item_choices`` the allowed words of a list or space-separated
    string, ``keys`` the allowed keys of a mapping."""

    name: str
    kinds: tuple[str, ...] | None
    default: Any
    nullable: bool = False
    help: str = ""
    str_items: bool = False
    choices: tuple[str, ...] | None = None
    item_choices: tuple[str, ...] | None = None
    keys: tuple[str, ...] | None = None

    @property
    def range(self) -> Range | None:
        return FIELD_RANGES.get(self.name)


def _spec(
    name: str, kinds: str, default: Any, help: str, *, nullable: bool = False, **extra: Any
) -> FieldSpec:
    return FieldSpec(name, tuple(kinds.split()), default, nullable=nullable, help=help, **extra)


SPEC_FIELDS: tuple[FieldSpec, ...] = (
    # --- TrainingArguments defaults the spec changes
    _spec("output_dir", "str", None, "Where checkpoints and metrics.jsonl go.", nullable=True),
    _spec("logging_steps", "float", 1, "Log every N optimizer steps."),
    _spec("gradient_checkpointing", "bool", True, "Recompute activations in backward."),
    _spec("bf16", "bool", None, "bf16 mixed precision; None = True unless fp16.", nullable=True),
    _spec(
        "torch_compile",
        "bool",
        None,
        "Compile the model's blocks; None = on when training on CUDA (measured faster at the same "
        "memory), off on CPU. On CUDA each decoder layer is compiled whole, tree attention inside, and "
        "the compiler chooses what to recompute (activation_memory_budget); elsewhere the norm and MLP "
        "blocks.",
        nullable=True,
    ),
    _spec(
        "activation_memory_budget",
        "float",
        0.02,
        "Extension beyond the spec: with gradient_checkpointing and layers compiled whole (CUDA), the "
        "share of the activations an unconstrained backward would keep that it may keep; the compiler "
        "recomputes the rest, cheapest first (1.0 = keep all, as without checkpointing).",
    ),
    _spec("learning_rate", "float", 1e-6, "AdamW learning rate."),
    _spec("lr_scheduler_type", "str", "constant", "Constant: epochs have no known length."),
    _spec("ignore_data_skip", "bool", True, "Always True: resume uses rollout_state.json."),
    _spec("remove_unused_columns", "bool", False, "Must stay False: columns feed rewards."),
    _spec("report_to", "list str", "none", "Integrations to report to.", nullable=True, str_items=True),
    # --- model
    _spec(
        "model_init_kwargs",
        "dict str",
        None,
        "Keyword arguments for from_pretrained (JSON string accepted).",
        nullable=True,
    ),
    _spec("dtype", "str", "float32", "Weight dtype: auto, bfloat16, float16, float32.", choices=DTYPES),
    _spec("trust_remote_code", "bool", False, "Allow custom code from the Hub."),
    _spec(
        "router_aux_loss_coef",
        "float",
        None,
        "MoE load-balancing loss weight; None = the model config's.",
        nullable=True,
    ),
    # --- generation
    _spec("num_generations", "int", 8, "Completions per prompt (group size G)."),
    _spec("max_completion_length", "int", 2048, "Max tokens per vLLM request (per turn)."),
    _spec("temperature", "float", 1.0, "Sampling temperature."),
    _spec("top_p", "float", 1.0, "Nucleus sampling; < 1 needs top_k and server flags."),
    _spec("top_k", "int", 0, "Top-k sampling; 0 = off."),
    _spec("min_p", "float", None, "Min-p sampling; > 0 needs top_k.", nullable=True),
    _spec(
        "repetition_penalty",
        "float",
        1.0,
        "Sampler repetition penalty (named by the spec's generate_one_turn).",
    ),
    _spec(
        "chat_template_kwargs",
        "dict str",
        None,
        "Extra kwargs for apply_chat_template (JSON string accepted).",
        nullable=True,
    ),
    _spec(
        "max_tool_calling_iterations",
        "int",
        None,
        "Max tool-calling turns per rollout; None = unlimited.",
        nullable=True,
    ),
    # --- vLLM server
    _spec(
        "vllm_server_base_url",
        "str",
        "http://localhost:8000",
        "vLLM server URL; several, comma-separated, spread one run's rollouts over them (weights synced to each).",
    ),
    _spec("vllm_server_timeout", "float", 1800.0, "Seconds per server call/startup wait."),
    # --- training
    _spec("epsilon", "float", 0.2, "Lower clipping epsilon."),
    _spec("epsilon_high", "float", None, "Upper clipping epsilon; None = epsilon.", nullable=True),
    _spec("score_centering", "bool", True, "Score centering instead of clipped surrogate."),
    _spec("vllm_importance_sampling_clip_min", "float", 0.5, "IS ratio lower bound."),
    _spec("vllm_importance_sampling_clip_max", "float", 5.0, "IS ratio upper bound."),
    _spec("num_sampler_logprobs", "int", 8, "Top sampler logprobs per token."),
    _spec("token_budget", "int", None, "Tokens per packed row; None = max_model_len.", nullable=True),
    _spec(
        "max_samples_per_row",
        "int",
        None,
        "Extension beyond the spec: at most this many samples in one packed row, however much they "
        "share (bounds a step's samples as completions converge); None = no cap.",
        nullable=True,
    ),
    _spec(
        "tree_min_shared_tokens",
        "int",
        None,
        "Shorter shared prefixes are forwarded once per sample; None = 32 on CUDA (a short prompt costs "
        "the tree mask more than it saves), 0 on CPU.",
        nullable=True,
    ),
    # --- async pipeline
    _spec("max_concurrent_rollouts", "int", 512, "Hard cap on rollouts in flight."),
    _spec("max_staleness", "int", 4, "Max weight updates a sample may lag."),
    _spec("weight_sync_steps", "int", 1, "Sync weights to vLLM every N steps."),
    _spec("rollout_worker_timeout", "float", 300.0, "Heartbeat timeout of the rollout worker."),
    _spec(
        "idle_log_s",
        "float",
        30.0,
        "Seconds the trainer may wait for samples before it logs the rollout metrics anyway (at the step "
        "in progress), so a run whose groups are all dropped is not silent.",
    ),
    _spec(
        "dropped_groups_warning",
        "int",
        32,
        "Warn after this many groups in a row were dropped (identical rewards); 0 = never.",
    ),
    _spec(
        "max_dropped_groups",
        "int",
        None,
        "Extension beyond the spec: fail the run once this many groups in a row were dropped (equal "
        "rewards, nothing to train) instead of generating forever; None = never (a run launched from the "
        "web gets the worker's GRPO_MAX_DROPPED_GROUPS, 1,000, unless it sets this).",
        nullable=True,
    ),
    _spec(
        "retire_saturated_prompts",
        "int",
        None,
        "Extension beyond the spec: retire a prompt (told apart by its content) once this many of its "
        "groups in a row had all-equal rewards (skipped from then on, kept in rollout_state.json; all "
        "come back if every prompt is retired); None = off.",
        nullable=True,
    ),
    # --- evaluation during training (an extension: the run document's eval_dataset; when is
    # TrainingArguments' eval_strategy / eval_steps / eval_on_start)
    _spec(
        "eval_num_generations",
        "int",
        1,
        "Extension beyond the spec: completions sampled per eval prompt (k of eval/pass@k).",
    ),
    _spec(
        "eval_temperature",
        "float",
        0.0,
        "Extension beyond the spec: sampling temperature of eval completions (0 = greedy).",
    ),
    _spec(
        "eval_max_prompts",
        "int",
        None,
        "Extension beyond the spec: score at most this many eval prompts (the first ones), None = all.",
        nullable=True,
    ),
    _spec(
        "eval_pass_threshold",
        "float",
        1.0,
        "Extension beyond the spec: a completion passes (eval/pass@k) when its total reward is at least this.",
    ),
    # --- logging
    _spec("log_completions", "bool", False, "Log sampled (prompt, completion) pairs."),
    _spec("num_completions_to_print", "int", None, "Completions printed per log.", nullable=True),
)


def _training_args_field(name: str, entry: Mapping[str, Any]) -> FieldSpec:
    return FieldSpec(
        name,
        tuple(entry["kinds"]) if entry["kinds"] is not None else None,
        entry["default"],
        nullable=entry["nullable"],
        help=entry["help"],
        str_items=entry.get("str_items", False),
        choices=entry.get("choices"),
        item_choices=entry.get("item_choices"),
        keys=entry.get("keys"),
    )


def _all_fields() -> dict[str, FieldSpec]:
    fields = {name: _training_args_field(name, entry) for name, entry in TRAINING_ARGS_FIELDS.items()}
    for spec in SPEC_FIELDS:
        base = fields.get(spec.name)
        # A spec field keeps TrainingArguments' choices (e.g. lr_scheduler_type's SchedulerType values).
        if base is not None and spec.choices is None:
            spec = replace(spec, choices=base.choices, item_choices=base.item_choices, keys=base.keys)
        fields[spec.name] = spec
    return fields


FIELDS: dict[str, FieldSpec] = _all_fields()
DEFAULTS: dict[str, Any] = {name: spec.default for name, spec in FIELDS.items()}


# ------------------------------------------------------------------------------- single fields
def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters; a huge integer as its bit length (no 5000-digit echo)."""
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**60
        else f"<{value.bit_length()}-bit integer>"
    )
    return text if len(text) <= limit else text[:limit] + "..."


def _type_error(spec: FieldSpec, value: Any) -> str | None:
    """Why ``value`` is not JSON of the field's kinds (finite numbers, integers within 64 bits)."""
    if spec.kinds is None:
        return None
    if value is None:
        return None if spec.nullable else "must not be null"
    kinds = spec.kinds
    ok = (
        ("bool" in kinds and isinstance(value, bool))
        or ("int" in kinds and _is_number(value) and isinstance(value, int))
        or ("float" in kinds and _is_number(value))
        or ("str" in kinds and isinstance(value, str))
        or ("dict" in kinds and isinstance(value, dict))
        or ("list" in kinds and isinstance(value, list))
    )
    if not ok:
        expected = " or ".join(text for kind, text in KIND_TEXT.items() if kind in kinds)
        return f"must be {expected}, got {type(value).__name__} {short_repr(value)}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if _is_number(value) and isinstance(value, int) and abs(value) > INT_LIMIT:
        return f"is out of range (|value| must be below 2**63), got {short_repr(value)}"
    if spec.str_items and isinstance(value, list) and not all(isinstance(v, str) for v in value):
        return "must be a list of strings"
    return None


def _choice_error(spec: FieldSpec, value: Any) -> str | None:
    """Why a string (or the words of a list) is not one of the field's choices; keys of a mapping."""
    if spec.choices and isinstance(value, str) and value not in spec.choices:
        return f"must be one of {', '.join(spec.choices)}, got {short_repr(value)}"
    if spec.item_choices and isinstance(value, str | list):
        words = value.split() if isinstance(value, str) else value
        bad = [w for w in words if w not in spec.item_choices]
        if bad:
            return f"{short_repr(bad[0])} is not one of {', '.join(spec.item_choices)}"
    if spec.keys is not None and isinstance(value, dict):
        unknown = [k for k in value if k not in spec.keys]
        if unknown:
            return f"unknown key {short_repr(unknown[0])}; allowed: {', '.join(spec.keys)}"
    return None


def parse_json_object(name: str, value: Any) -> Any:
    """``value`` with a JSON object string parsed (``model_init_kwargs``, ``chat_template_kwargs``);
    raises ValueError naming ``name`` for text that is not a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, too deep, too long
            raise ValueError(f"{name}: not valid JSON ({exc}); pass a dict or a JSON object string") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name}: must be a mapping (or a JSON object string), got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------ cross-field rules
# Each rule reads the values (defaults filled in) and returns {field: message} for what it refuses;
# a value of the wrong type is skipped (the type check names it).
Rule = Callable[[Mapping[str, Any]], dict[str, str]]


def _unsupported(v: Mapping[str, Any]) -> dict[str, str]:
    """The combinations the spec's compatibility section rules out."""
    errors: dict[str, str] = {}
    if v.get("deepspeed"):
        errors["deepspeed"] = "DeepSpeed is not supported by AsyncGRPOTrainer; use FSDP2 (fsdp=...) instead"
    pc = v.get("parallelism_config")
    if pc is not None:
        for attr in ("cp_size", "sp_size"):
            # A ParallelismConfig (Python callers), or the mapping a RUN.yaml document carries.
            size = (pc.get(attr, 1) if isinstance(pc, Mapping) else getattr(pc, attr, 1)) or 1
            if not _is_number(size) or size > 1:
                errors["parallelism_config"] = (
                    f"{attr}={short_repr(size)}: context/sequence parallelism is not supported; set it to 1"
                )
                break
    if v.get("use_liger_kernel") is True:
        errors["use_liger_kernel"] = "is not supported by AsyncGRPOTrainer; remove it"
    if v.get("ignore_data_skip") is False:
        errors["ignore_data_skip"] = (
            "resume always skips via rollout_state.json, not by replaying batches; leave it at True"
        )
    if v.get("remove_unused_columns") is True:
        errors["remove_unused_columns"] = (
            "every dataset column is passed to the reward functions; keep it False"
        )
    return errors


def _sampling(v: Mapping[str, Any]) -> dict[str, str]:
    """top_p < 1 and min_p > 0 need top_k: vLLM returns at most top_k candidates per token."""
    errors: dict[str, str] = {}
    top_k, top_p, min_p = v.get("top_k"), v.get("top_p"), v.get("min_p")
    if top_k != 0 or isinstance(top_k, bool):
        return errors
    if _is_number(top_p) and top_p < 1:
        errors["top_p"] = (
            "needs top_k > 0: vLLM caps the returned candidate set at top_k, so without it the trainer "
            "cannot renormalise over the set the token was sampled from; set top_k (e.g. 512)"
        )
    if _is_number(min_p) and min_p > 0:
        errors["min_p"] = "needs top_k > 0 (the candidate set is capped at top_k); set top_k"
    return errors


def _server_url(v: Mapping[str, Any]) -> dict[str, str]:
    """One URL, or several separated by commas (one run's rollouts over several servers)."""
    from trainer.processes.server_checks import server_urls

    value = v.get("vllm_server_base_url")
    if not isinstance(value, str):
        return {}
    urls = server_urls(value)
    if not urls:
        return {"vllm_server_base_url": f"{short_repr(value)}: names no server; give http://HOST:PORT"}
    for url in urls:
        if not url.startswith(("http://", "https://")):
            return {"vllm_server_base_url": f"{short_repr(url)}: must start with http:// or https://"}
    if len(set(urls)) < len(urls):
        return {"vllm_server_base_url": f"{short_repr(value)}: names a server twice; give each URL once"}
    return {}


def _importance_sampling(v: Mapping[str, Any]) -> dict[str, str]:
    lo, hi = v.get("vllm_importance_sampling_clip_min"), v.get("vllm_importance_sampling_clip_max")
    if _is_number(lo) and _is_number(hi) and not 0 <= lo < hi:
        return {
            "vllm_importance_sampling_clip_min": (
                f"must be >= 0 and below vllm_importance_sampling_clip_max={hi!r}: need 0 <= min < max"
            )
        }
    return {}


def _score_centering(v: Mapping[str, Any]) -> dict[str, str]:
    n = v.get("num_sampler_logprobs")
    if v.get("score_centering") is True and _is_number(n) and n < 1:
        return {"num_sampler_logprobs": "must be >= 1 with score_centering=True (the expectation's support)"}
    return {}


def _json_kwargs(v: Mapping[str, Any]) -> dict[str, str]:
    errors: dict[str, str] = {}
    for name in ("model_init_kwargs", "chat_template_kwargs"):
        try:
            parse_json_object(name, v.get(name))
        except ValueError as exc:
            errors[name] = str(exc).split(": ", 1)[1]
    return errors


def _no_evaluation(v: Mapping[str, Any]) -> dict[str, str]:
    """Evaluation scores eval_dataset's prompts through the vLLM server (trainer/trainer/evaluation.py) and
    logs eval/* metrics; transformers' "best" checkpoints read metrics its own evaluation returns,
    which this one does not (whether eval_strategy has an eval_dataset is a rule of the run document:
    trainer.config.run_config)."""
    errors: dict[str, str] = {}
    if v.get("save_strategy") == "best":
        errors["save_strategy"] = (
            "'best' needs transformers' own evaluation metrics, which AsyncGRPOTrainer does not return "
            "(its eval/* metrics are logged, not ranked); use 'steps' or 'epoch'"
        )
    if v.get("load_best_model_at_end") is True:
        errors["load_best_model_at_end"] = (
            "needs transformers' own evaluation metrics, which AsyncGRPOTrainer does not return; leave it false"
        )
    return errors


def _fsdp_checkpointing(v: Mapping[str, Any]) -> dict[str, str]:
    """The trainer refuses FSDP's activation checkpointing together with gradient_checkpointing."""
    config = v.get("fsdp_config")
    if not v.get("fsdp") or not isinstance(config, Mapping) or v.get("gradient_checkpointing") is not True:
        return {}
    if config.get("activation_checkpointing") or config.get("fsdp_activation_checkpointing"):
        return {
            "gradient_checkpointing": (
                "fsdp_config's activation_checkpointing already recomputes activations and the trainer "
                "refuses both; set gradient_checkpointing false"
            )
        }
    return {}


RULES: tuple[Rule, ...] = (
    _unsupported,
    _sampling,
    _server_url,
    _importance_sampling,
    _score_centering,
    _json_kwargs,
    _no_evaluation,
    _fsdp_checkpointing,
)


def rule_errors(values: Mapping[str, Any]) -> dict[str, str]:
    """Every cross-field rule over ``values`` (defaults filled in for the fields it leaves out)."""
    merged = {**DEFAULTS, **values}
    if merged.get("epsilon_high") is None:
        merged["epsilon_high"] = merged.get("epsilon")
    errors: dict[str, str] = {}
    for rule in RULES:
        for name, message in rule(merged).items():
            errors.setdefault(name, message)
    return errors


# ---------------------------------------------------------------------------------- entry points
def args_errors(args: Mapping[Any, Any]) -> dict[str, str]:
    """Every problem of a run document's ``args`` as ``{field: message}`` (``{}``: valid): unknown
    names, JSON types, ranges, choices, then the cross-field rules over the values that passed."""
    errors: dict[str, str] = {}
    for key, value in args.items():
        spec = FIELDS.get(key) if isinstance(key, str) else None
        if spec is None:
            errors[str(key)] = "unknown AsyncGRPOConfig field (see docs/config.md)"
            continue
        message = _type_error(spec, value) or _choice_error(spec, value)
        if message:
            errors[key] = message
    typed = {k: v for k, v in args.items() if isinstance(k, str) and k in FIELDS and k not in errors}
    for name, message in range_errors(typed).items():
        errors.setdefault(name, message)
    checked = {k: v for k, v in typed.items() if k not in errors}
    for name, message in rule_errors(checked).items():
        errors.setdefault(name, message)
    return errors


def config_errors(values: Mapping[str, Any]) -> dict[str, str]:
    """What ``AsyncGRPOConfig.__post_init__`` refuses among its own (already typed) values: finite
    numbers, ranges, the spec fields' choices and the cross-field rules."""
    errors: dict[str, str] = {}
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            errors[name] = "must be a finite number"
    for name, message in range_errors({n: values.get(n) for n in FIELD_RANGES}).items():
        errors.setdefault(name, message.rsplit(", got", 1)[0])
    for spec in SPEC_FIELDS:
        message = _choice_error(spec, values.get(spec.name))
        if message:
            errors.setdefault(spec.name, message.rsplit(", got", 1)[0])
    for name, message in rule_errors(values).items():
        errors.setdefault(name, message)
    return errors
