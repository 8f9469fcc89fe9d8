"""``AsyncGRPOConfig``: ``transformers.TrainingArguments`` plus the spec's async-GRPO fields.

Every field, default and changed ``TrainingArguments`` default follows the spec's signature.
Combinations the spec rules out fail here, at construction, with a message naming the option.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from trainer.config_ranges import FIELD_RANGES, range_errors

_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    """Configuration of :class:`trainer.AsyncGRPOTrainer` (see ``docs/config.md``)."""

    # --- TrainingArguments defaults the spec changes -------------------------------------------
    output_dir: str | None = field(default=None, metadata={"help": "Where checkpoints and metrics.jsonl go."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    gradient_checkpointing: bool = field(
        default=True, metadata={"help": "Recompute activations in backward."}
    )
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision; None = True unless fp16."}
    )
    torch_compile: bool | None = field(
        default=None,
        metadata={
            "help": "Compile the norm and MLP blocks; None = on when training on CUDA (measured "
            "faster at the same memory), off on CPU."
        },
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate."})
    lr_scheduler_type: str = field(
        default="constant", metadata={"help": "Constant: epochs have no known length."}
    )
    ignore_data_skip: bool = field(
        default=True, metadata={"help": "Always True: resume uses rollout_state.json."}
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: columns feed rewards."}
    )
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Integrations to report to."})

    # --- model ---------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained (JSON string accepted)."}
    )
    dtype: str = field(
        default="float32", metadata={"help": "Weight dtype: auto, bfloat16, float16, float32."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom code from the Hub."})
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "MoE load-balancing loss weight; None = the model config's."}
    )

    # --- generation ----------------------------------------------------------------------------
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (group size G)."})
    max_completion_length: int = field(
        default=2048, metadata={"help": "Max tokens per vLLM request (per turn)."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(
        default=1.0, metadata={"help": "Nucleus sampling; < 1 needs top_k and server flags."}
    )
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 = off."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling; > 0 needs top_k."})
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Sampler repetition penalty (named by the spec's generate_one_turn)."}
    )
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra kwargs for apply_chat_template (JSON string accepted)."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "Max tool-calling turns per rollout; None = unlimited."}
    )

    # --- vLLM server ---------------------------------------------------------------------------
    vllm_server_base_url: str = field(default="http://localhost:8000", metadata={"help": "vLLM server URL."})
    vllm_server_timeout: float = field(
        default=1800.0, metadata={"help": "Seconds per server call/startup wait."}
    )

    # --- training ------------------------------------------------------------------------------
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping epsilon."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping epsilon; None = epsilon."}
    )
    score_centering: bool = field(
        default=True, metadata={"help": "Score centering instead of clipped surrogate."}
    )
    vllm_importance_sampling_clip_min: float = field(default=0.5, metadata={"help": "IS ratio lower bound."})
    vllm_importance_sampling_clip_max: float = field(default=5.0, metadata={"help": "IS ratio upper bound."})
    num_sampler_logprobs: int = field(default=8, metadata={"help": "Top sampler logprobs per token."})
    token_budget: int | None = field(
        default=None, metadata={"help": "Tokens per packed row; None = max_model_len."}
    )
    tree_min_shared_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Shorter shared prefixes are forwarded once per sample; None = 32 on CUDA "
            "(a short prompt costs the tree mask more than it saves), 0 on CPU."
        },
    )

    # --- async pipeline ------------------------------------------------------------------------
    max_concurrent_rollouts: int = field(default=512, metadata={"help": "Hard cap on rollouts in flight."})
    max_staleness: int = field(default=4, metadata={"help": "Max weight updates a sample may lag."})
    weight_sync_steps: int = field(default=1, metadata={"help": "Sync weights to vLLM every N steps."})
    rollout_worker_timeout: float = field(
        default=300.0, metadata={"help": "Heartbeat timeout of the rollout worker."}
    )
    idle_log_s: float = field(
        default=30.0,
        metadata={
            "help": "Seconds the trainer may wait for samples before it logs the rollout metrics "
            "anyway (at the step in progress), so a run whose groups are all dropped is not silent."
        },
    )
    dropped_groups_warning: int = field(
        default=32,
        metadata={
            "help": "Warn after this many groups in a row were dropped (identical rewards); 0 = never."
        },
    )

    # --- logging -------------------------------------------------------------------------------
    log_completions: bool = field(default=False, metadata={"help": "Log sampled (prompt, completion) pairs."})
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Completions printed per log."}
    )

    def __post_init__(self) -> None:
        _reject_unsupported(self)
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
        on_cuda = compile_by_default(use_cpu=self.use_cpu)  # a CUDA run: both GPU defaults apply
        if self.torch_compile is None:
            self.torch_compile = on_cuda
        if self.tree_min_shared_tokens is None:
            self.tree_min_shared_tokens = CUDA_MIN_SHARED_TOKENS if on_cuda else 0
        for name in ("model_init_kwargs", "chat_template_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    setattr(self, name, json.loads(value))
                except (ValueError, RecursionError) as exc:  # JSONDecodeError, too deep, too long
                    raise ValueError(
                        f"{name}: not valid JSON ({exc}); pass a dict or a JSON object string"
                    ) from None
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ValueError(
                    f"{name}: must be a mapping (or a JSON object string), got {type(value).__name__}"
                )
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


def _reject_unsupported(args: AsyncGRPOConfig) -> None:
    """Raise for the combinations the spec's compatibility section rules out."""
    if args.deepspeed:
        raise ValueError(
            "deepspeed: DeepSpeed is not supported by AsyncGRPOTrainer; use FSDP2 (fsdp=...) instead"
        )
    pc = args.parallelism_config
    if pc is not None:
        for attr in ("cp_size", "sp_size"):
            # A ParallelismConfig, or the mapping a RUN.yaml document can carry.
            size = (pc.get(attr, 1) if isinstance(pc, Mapping) else getattr(pc, attr, 1)) or 1
            if not isinstance(size, int | float) or isinstance(size, bool) or size > 1:
                raise ValueError(
                    f"parallelism_config.{attr}={size}: context/sequence parallelism is not supported; set it to 1"
                )
    if args.use_liger_kernel:
        raise ValueError("use_liger_kernel=True is not supported by AsyncGRPOTrainer; remove it")
    if args.ignore_data_skip is False:
        raise ValueError(
            "ignore_data_skip=False: resume always skips via rollout_state.json, not by replaying batches; "
            "leave ignore_data_skip at True"
        )
    if args.remove_unused_columns:
        raise ValueError(
            "remove_unused_columns=True: every dataset column is passed to the reward functions; keep it False"
        )


# numpy / torch seeds are unsigned 32-bit.
_SEED_MAX = 2**32 - 1


def _validate_ranges(args: AsyncGRPOConfig) -> None:
    """Field-level checks; each message names the field and the fix.

    Comparisons are written so that NaN fails them (``not x > 0`` rather than ``x <= 0``).
    """
    for f in dataclasses.fields(args):
        value = getattr(args, f.name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name}={value}: must be a finite number")
    # Every numeric field's range (trainer/config_ranges.py, the one table; run documents report
    # these per field before the config is built).
    out_of_range = range_errors({name: getattr(args, name, None) for name in FIELD_RANGES})
    if out_of_range:
        name, message = next(iter(out_of_range.items()))
        raise ValueError(f"{name}={getattr(args, name)!r:.40}: {message.rsplit(', got', 1)[0]}")
    if not args.learning_rate >= 0:
        raise ValueError(f"learning_rate={args.learning_rate}: must be >= 0")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)}: must be >= 1")
    for name in ("seed", "data_seed"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= _SEED_MAX:
            raise ValueError(f"{name}={value}: must be in [0, {_SEED_MAX}]")
    if args.dtype not in _DTYPES:
        raise ValueError(f"dtype={args.dtype!r}: must be one of {', '.join(_DTYPES)}")
    if args.num_generations < 2:
        raise ValueError(
            f"num_generations={args.num_generations}: GRPO needs at least 2 completions per prompt"
        )
    if args.max_completion_length < 1:
        raise ValueError(f"max_completion_length={args.max_completion_length}: must be >= 1")
    if not args.temperature > 0:
        raise ValueError(
            f"temperature={args.temperature}: must be > 0 (0 makes every rollout of a group identical)"
        )
    if not 0 < args.top_p <= 1:
        raise ValueError(f"top_p={args.top_p}: must be in (0, 1]")
    if args.top_k < 0:
        raise ValueError(f"top_k={args.top_k}: must be >= 0 (0 disables top-k)")
    if args.top_p < 1 and args.top_k == 0:
        raise ValueError(
            f"top_p={args.top_p} needs top_k > 0: vLLM caps the returned candidate set at top_k, so without it "
            "the trainer cannot renormalise over the set the token was sampled from; set top_k (e.g. 512)"
        )
    if args.min_p is not None:
        if not 0 <= args.min_p <= 1:
            raise ValueError(f"min_p={args.min_p}: must be in [0, 1]")
        if args.min_p > 0 and args.top_k == 0:
            raise ValueError(
                f"min_p={args.min_p} needs top_k > 0 (the candidate set is capped at top_k); set top_k"
            )
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 0:
        raise ValueError(
            f"max_tool_calling_iterations={args.max_tool_calling_iterations}: must be >= 0 or None"
        )
    if not args.vllm_server_base_url.startswith(("http://", "https://")):
        raise ValueError(
            f"vllm_server_base_url={args.vllm_server_base_url!r}: must start with http:// or https://"
        )
    if not args.vllm_server_timeout > 0:
        raise ValueError(f"vllm_server_timeout={args.vllm_server_timeout}: must be > 0 seconds")
    if not (args.epsilon >= 0 and args.epsilon_high >= 0):
        raise ValueError(f"epsilon={args.epsilon}, epsilon_high={args.epsilon_high}: must be >= 0")
    lo, hi = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if not 0 <= lo < hi:
        raise ValueError(
            f"vllm_importance_sampling_clip_min={lo}, vllm_importance_sampling_clip_max={hi}: need 0 <= min < max"
        )
    if args.num_sampler_logprobs < 0:
        raise ValueError(f"num_sampler_logprobs={args.num_sampler_logprobs}: must be >= 0")
    if args.score_centering and args.num_sampler_logprobs < 1:
        raise ValueError(
            "score_centering=True needs num_sampler_logprobs >= 1 (the expectation's support); set it"
        )
    if args.token_budget is not None and args.token_budget < 1:
        raise ValueError(
            f"token_budget={args.token_budget}: must be >= 1 or None (= the server's max_model_len)"
        )
    if args.max_concurrent_rollouts < 1:
        raise ValueError(f"max_concurrent_rollouts={args.max_concurrent_rollouts}: must be >= 1")
    if args.max_staleness < 0:
        raise ValueError(f"max_staleness={args.max_staleness}: must be >= 0")
    if args.weight_sync_steps < 1:
        raise ValueError(f"weight_sync_steps={args.weight_sync_steps}: must be >= 1")
    if not args.rollout_worker_timeout > 0:
        raise ValueError(f"rollout_worker_timeout={args.rollout_worker_timeout}: must be > 0 seconds")
    if args.router_aux_loss_coef is not None and not args.router_aux_loss_coef >= 0:
        raise ValueError(f"router_aux_loss_coef={args.router_aux_loss_coef}: must be >= 0")
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
