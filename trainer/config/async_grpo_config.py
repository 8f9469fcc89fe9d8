"""``AsyncGRPOConfig``: ``transformers.TrainingArguments`` plus the spec's async-GRPO fields.

Every field, default and changed ``TrainingArguments`` default follows the spec's signature.
Combinations the spec rules out fail here, at construction, with a message naming the option.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from trainer.config import run_schema

_SPEC = {spec.name: spec for spec in run_schema.SPEC_FIELDS}


def _spec_field(name: str) -> Any:
    """A dataclass field whose default and help are the schema's (trainer/config/run_schema.py): one table."""
    spec = _SPEC[name]
    return field(default=spec.default, metadata={"help": spec.help})


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    """Configuration of :class:`trainer.AsyncGRPOTrainer` (see ``docs/config.md``)."""

    # --- TrainingArguments defaults the spec changes -------------------------------------------
    output_dir: str | None = _spec_field("output_dir")
    logging_steps: float = _spec_field("logging_steps")
    gradient_checkpointing: bool = _spec_field("gradient_checkpointing")
    bf16: bool | None = _spec_field("bf16")
    torch_compile: bool | None = _spec_field("torch_compile")
    activation_memory_budget: float = _spec_field("activation_memory_budget")
    learning_rate: float = _spec_field("learning_rate")
    lr_scheduler_type: str = _spec_field("lr_scheduler_type")
    ignore_data_skip: bool = _spec_field("ignore_data_skip")
    remove_unused_columns: bool = _spec_field("remove_unused_columns")
    report_to: None | str | list[str] = _spec_field("report_to")

    # --- model ---------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = _spec_field("model_init_kwargs")
    dtype: str = _spec_field("dtype")
    trust_remote_code: bool = _spec_field("trust_remote_code")
    router_aux_loss_coef: float | None = _spec_field("router_aux_loss_coef")

    # --- generation ----------------------------------------------------------------------------
    num_generations: int = _spec_field("num_generations")
    max_completion_length: int = _spec_field("max_completion_length")
    temperature: float = _spec_field("temperature")
    top_p: float = _spec_field("top_p")
    top_k: int = _spec_field("top_k")
    min_p: float | None = _spec_field("min_p")
    repetition_penalty: float = _spec_field("repetition_penalty")
    chat_template_kwargs: dict | str | None = _spec_field("chat_template_kwargs")
    max_tool_calling_iterations: int | None = _spec_field("max_tool_calling_iterations")

    # --- vLLM server ---------------------------------------------------------------------------
    vllm_server_base_url: str = _spec_field("vllm_server_base_url")
    vllm_server_timeout: float = _spec_field("vllm_server_timeout")

    # --- training ------------------------------------------------------------------------------
    epsilon: float = _spec_field("epsilon")
    epsilon_high: float | None = _spec_field("epsilon_high")
    score_centering: bool = _spec_field("score_centering")
    vllm_importance_sampling_clip_min: float = _spec_field("vllm_importance_sampling_clip_min")
    vllm_importance_sampling_clip_max: float = _spec_field("vllm_importance_sampling_clip_max")
    num_sampler_logprobs: int = _spec_field("num_sampler_logprobs")
    token_budget: int | None = _spec_field("token_budget")
    max_samples_per_row: int | None = _spec_field("max_samples_per_row")
    tree_min_shared_tokens: int | None = _spec_field("tree_min_shared_tokens")

    # --- async pipeline ------------------------------------------------------------------------
    max_concurrent_rollouts: int = _spec_field("max_concurrent_rollouts")
    max_staleness: int = _spec_field("max_staleness")
    weight_sync_steps: int = _spec_field("weight_sync_steps")
    rollout_worker_timeout: float = _spec_field("rollout_worker_timeout")
    idle_log_s: float = _spec_field("idle_log_s")
    dropped_groups_warning: int = _spec_field("dropped_groups_warning")
    max_dropped_groups: int | None = _spec_field("max_dropped_groups")
    retire_saturated_prompts: int | None = _spec_field("retire_saturated_prompts")

    # --- evaluation during training (extension; when: TrainingArguments' eval_strategy) ----------
    eval_num_generations: int = _spec_field("eval_num_generations")
    eval_temperature: float = _spec_field("eval_temperature")
    eval_max_prompts: int | None = _spec_field("eval_max_prompts")
    eval_pass_threshold: float = _spec_field("eval_pass_threshold")

    # --- logging -------------------------------------------------------------------------------
    log_completions: bool = _spec_field("log_completions")
    num_completions_to_print: int | None = _spec_field("num_completions_to_print")

    def __post_init__(self) -> None:
        if self.bf16 is None:
            # Spec: True unless fp16. On a machine with no bf16-capable accelerator (the CPU test
            # machines) transformers refuses bf16 without use_cpu, so the default falls back to fp32.
            self.bf16 = not self.fp16 and _bf16_accelerator_available()
            if not self.bf16 and not self.fp16 and self.dtype in ("bfloat16", "float16"):
                warnings.warn(
                    f"dtype={self.dtype} weights with bf16 mixed precision off: the spec's bf16 default "
                    "(True unless fp16) applies only where a bf16-capable accelerator is present, and "
                    "there is none here; set dtype: float32 (or bf16: true with use_cpu: true)",
                    stacklevel=2,
                )
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        if self.report_to is None:
            # The schema lets a document write null for "no integrations"; transformers' Trainer
            # refuses None ("None is not supported"), so it is the spec's "none".
            self.report_to = "none"
        on_cuda = compile_by_default(use_cpu=self.use_cpu)  # a CUDA run: both GPU defaults apply
        if self.torch_compile is None:
            self.torch_compile = on_cuda
        if self.tree_min_shared_tokens is None:
            self.tree_min_shared_tokens = CUDA_MIN_SHARED_TOKENS if on_cuda else 0
        for name in ("model_init_kwargs", "chat_template_kwargs"):
            setattr(self, name, run_schema.parse_json_object(name, getattr(self, name)))
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        _validate_ranges(self)
        if not self.use_cpu and _cpu_only_multiprocess():
            # transformers sets up a distributed CPU run (DDP over gloo) only with use_cpu; without
            # it every rank of `torch.distributed.run` believed it was the main process.
            self.use_cpu = True
        super().__post_init__()


# On CUDA, FlexAttention evaluates the tree mask in 128-token blocks: a completion's query blocks
# each visit its group prompt's block besides their own. Below ~32 prompt tokens that costs more than
# sharing saves (H200, docs/benchmarks.md: a 16-token prompt made the tree step 2-3% slower).
CUDA_MIN_SHARED_TOKENS = 32


def compile_by_default(*, use_cpu: bool, cuda_available: bool | None = None) -> bool:
    """``torch_compile``'s value when unset: on for a CUDA run, where compiling the norm and MLP
    blocks made the Qwen3-1.7B step 1.29x faster at the same peak memory (docs/benchmarks.md); off
    on CPU, where the first steps would pay minutes of compilation for little."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    return bool(cuda_available and not use_cpu)


def _cpu_only_multiprocess() -> bool:
    """True under a multi-process launcher (``WORLD_SIZE`` > 1) on a host without CUDA devices."""
    import torch

    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world_size > 1 and not torch.cuda.is_available()


def _bf16_accelerator_available() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _validate_ranges(args: AsyncGRPOConfig) -> None:
    """The schema's checks (trainer/config/run_schema.py: ranges, choices, the spec's refused combinations)
    on the built values; the first refusal is raised as ``field=value: why``."""
    values = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(args)}
    refused = run_schema.config_errors(values)
    if refused:
        name, message = next(iter(refused.items()))
        raise ValueError(f"{name}={values.get(name)!r:.40}: {message}")
    if args.weight_sync_steps > 1 and args.max_staleness < args.weight_sync_steps - 1:
        warnings.warn(
            f"weight_sync_steps={args.weight_sync_steps} > max_staleness+1={args.max_staleness + 1}: samples "
            "generated between syncs may be dropped as stale",
            stacklevel=3,
        )


def config_reference_markdown() -> str:
    """The spec-specific fields of AsyncGRPOConfig as a Markdown table (docs/config.md is generated)."""
    import dataclasses

    from transformers import TrainingArguments as _Base

    base = {f.name: f for f in dataclasses.fields(_Base)}
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(AsyncGRPOConfig):
        if not f.init or (f.name in base and f.default == base[f.name].default):
            continue
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        rows.append(f"| `{f.name}` | `{default!r}` | {f.metadata.get('help', '')} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------------
# trainer/config/training_args_fields.py is generated from the installed transformers by the functions below
# (tests/test_run_schema.py fails when it is stale): the web validates run documents from it without
# importing transformers.
GENERATED_FIELDS_PATH = Path(__file__).with_name("training_args_fields.py")
# TrainingArguments fields whose mapping is turned into a dataclass: only its fields are accepted.
_MAPPING_DATACLASSES = {
    "accelerator_config": ("transformers.trainer_pt_utils", "AcceleratorConfig"),
    "parallelism_config": ("accelerate.parallelism_config", "ParallelismConfig"),
}
_JSON_KIND_NAMES = {bool: "bool", int: "int", float: "float", str: "str", dict: "dict", list: "list"}


def json_kinds(annotation: Any) -> tuple[set[type], bool, bool] | None:
    """What JSON a field's annotation accepts: the kinds (bool, int, float, str, dict, list), whether
    None is allowed and whether list items must be strings; None when the annotation is not
    understood (then any JSON value passes the schema and AsyncGRPOConfig decides)."""
    import enum
    import types
    import typing

    args = (
        typing.get_args(annotation)
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
        else (annotation,)
    )
    kinds: set[type] = set()
    str_items = False
    for arg in args:
        origin = typing.get_origin(arg) or arg
        if arg is type(None):
            continue
        if arg in _JSON_KIND_NAMES:
            kinds.add(arg)
        elif origin is typing.Literal:
            kinds.update(type(v) for v in typing.get_args(arg))
        elif isinstance(origin, type) and issubclass(origin, enum.Enum):
            kinds.add(str)
        elif origin is dict:
            kinds.add(dict)
        elif origin is list:
            kinds.add(list)
            item = typing.get_args(arg)
            str_items = bool(item) and (
                item[0] is str or (isinstance(item[0], type) and issubclass(item[0], str))
            )
        elif getattr(arg, "__name__", "") == "ParallelismConfig":
            kinds.add(dict)  # a document carries it as a mapping
        else:
            return None
    return (kinds, type(None) in args, str_items) if kinds else None


def _enum_values(annotation: Any, *, in_list: bool) -> tuple[str, ...] | None:
    """The values of the Enum in ``annotation`` (``Enum | str``; with ``in_list``, ``list[Enum] | str``)."""
    import enum
    import typing

    for arg in typing.get_args(annotation):
        if in_list and typing.get_origin(arg) is list:
            arg = (typing.get_args(arg) or (None,))[0]
        elif in_list:
            continue
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return tuple(str(member.value) for member in arg)
    return None


def training_args_fields() -> dict[str, dict[str, Any]]:
    """Every ``TrainingArguments`` field a run may set, from the installed transformers:
    ``{name: {"kinds": ("int", ...) | None, "nullable", "default", "help", and where they apply
    "str_items", "choices" (an Enum's values), "item_choices" (list of Enum), "keys" (a mapping
    turned into a dataclass)}}``."""
    import importlib
    import typing

    hints = typing.get_type_hints(TrainingArguments)
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(TrainingArguments):
        if not f.init:
            continue
        annotation = hints[f.name]
        understood = json_kinds(annotation)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        entry: dict[str, Any] = {
            "kinds": tuple(sorted(_JSON_KIND_NAMES[k] for k in understood[0])) if understood else None,
            "nullable": bool(understood and understood[1]),
            "default": getattr(default, "value", default),
            "help": " ".join(str(f.metadata.get("help", "")).split()),
        }
        if understood and understood[2]:
            entry["str_items"] = True
        choices = _enum_values(annotation, in_list=False)
        if choices:
            entry["choices"] = choices
        item_choices = _enum_values(annotation, in_list=True)
        if item_choices:
            entry["item_choices"] = item_choices
        if f.name in _MAPPING_DATACLASSES:
            module, name = _MAPPING_DATACLASSES[f.name]
            cls = getattr(importlib.import_module(module), name)
            entry["keys"] = tuple(g.name for g in dataclasses.fields(cls) if g.init)
        out[f.name] = entry
    return out


def training_args_fields_source() -> str:
    """The text of trainer/config/training_args_fields.py (run ``ruff format`` on it after writing)."""
    import pprint

    import transformers

    body = pprint.pformat(training_args_fields(), width=110, sort_dicts=True)
    return (
        '"""GENERATED from transformers.TrainingArguments; do not edit. Regenerate with\n'
        "``python -c 'from trainer.config.async_grpo_config import write_training_args_fields as w; w()'`` and\n"
        "``ruff format``; tests/test_run_schema.py fails when this is stale. Pure data: the web reads it\n"
        'without importing transformers (trainer/config/run_schema.py)."""\n\n'
        "from typing import Any\n\n"
        f'TRANSFORMERS_VERSION = "{transformers.__version__}"\n\n'
        f"TRAINING_ARGS_FIELDS: dict[str, dict[str, Any]] = {body}\n"
    )


def write_training_args_fields() -> Path:
    """Regenerate trainer/config/training_args_fields.py from the installed transformers."""
    GENERATED_FIELDS_PATH.write_text(training_args_fields_source(), encoding="utf-8")
    return GENERATED_FIELDS_PATH
