"""The range of every numeric AsyncGRPOConfig field: one table, checked in one place.

:func:`range_errors` reports each field outside its range (``{field: message}``); the run document's
validation (``trainer/config/run_config.py``, the web and the CLI alike) reports them per field, and
``AsyncGRPOConfig.__post_init__`` refuses them for Python callers. The ranges are wide enough for
any real run and narrow enough that no value overflows a tensor, a sampler or a worker (``max_steps:
2**62``, ``dataloader_num_workers: 100000`` were accepted before). The README's table is generated
from :data:`FIELD_RANGES` (:func:`ranges_markdown`; a test keeps it current).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["FIELD_RANGES", "Range", "range_errors", "ranges_markdown"]

BIG = 10**9  # steps, counts: far beyond any run
DAY_S = 24 * 3600


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (``low_open``: ``low < value``), or one of ``also`` (e.g. -1 = unset)."""

    low: float
    high: float
    low_open: bool = False
    also: tuple[float, ...] = ()
    note: str = ""

    def contains(self, value: float) -> bool:
        if value in self.also:
            return True
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def text(self) -> str:
        def fmt(x: float) -> str:
            if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 1):
                x = int(x)
                if x >= 10**6 and x == 10 ** round(math.log10(x)):
                    return f"10^{round(math.log10(x))}"
                if x == 2**32 - 1:
                    return "2^32-1"
            return str(x)

        interval = f"{'(' if self.low_open else '['}{fmt(self.low)}, {fmt(self.high)}]"
        extra = "".join(f" or {fmt(v)}" for v in self.also)
        return interval + extra


FIELD_RANGES: dict[str, Range] = {
    # how long
    "max_steps": Range(1, BIG, also=(-1,), note="-1: num_train_epochs decides"),
    "num_train_epochs": Range(0, 10**4, low_open=True),
    "per_device_train_batch_size": Range(1, 4096),
    "per_device_eval_batch_size": Range(1, 4096),
    "gradient_accumulation_steps": Range(1, 4096),
    "eval_accumulation_steps": Range(1, 10**6),
    # optimisation
    "learning_rate": Range(0, 1),
    "warmup_steps": Range(0, BIG, note="< 1: a fraction of the steps"),
    "weight_decay": Range(0, 10),
    "adam_beta1": Range(0, 0.999999),
    "adam_beta2": Range(0, 0.999999999),
    "adam_epsilon": Range(0, 1, low_open=True),
    "max_grad_norm": Range(0, 10**6),
    "label_smoothing_factor": Range(0, 0.999),
    "neftune_noise_alpha": Range(0, 100),
    "router_aux_loss_coef": Range(0, 100),
    "epsilon": Range(0, 10),
    "epsilon_high": Range(0, 10),
    "vllm_importance_sampling_clip_min": Range(0, 10**6),
    "vllm_importance_sampling_clip_max": Range(0, 10**6, low_open=True),
    # sampling
    "num_generations": Range(2, 1024, note="GRPO needs at least 2 completions per prompt"),
    "max_completion_length": Range(1, 2**20),
    "temperature": Range(0, 100, low_open=True),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(0, 10**6, note="0: off"),
    "min_p": Range(0, 1),
    "repetition_penalty": Range(0, 100, low_open=True),
    "max_tool_calling_iterations": Range(0, 1000),
    "num_sampler_logprobs": Range(0, 1024),
    # the async pipeline
    "token_budget": Range(1, 2**24),
    "max_samples_per_row": Range(1, 2**24, note="samples; null: no cap"),
    "tree_min_shared_tokens": Range(0, 2**24, note="None: 32 on CUDA, 0 on CPU"),
    "activation_memory_budget": Range(0, 1, low_open=True, note="share of the activations kept"),
    "max_concurrent_rollouts": Range(1, 10**6),
    "max_staleness": Range(0, 10**6),
    "weight_sync_steps": Range(1, 10**6),
    "vllm_server_timeout": Range(0, 7 * DAY_S, low_open=True, note="seconds"),
    "rollout_worker_timeout": Range(0, 7 * DAY_S, low_open=True, note="seconds"),
    "idle_log_s": Range(0, 7 * DAY_S, low_open=True, note="seconds"),
    "dropped_groups_warning": Range(0, 10**9, note="0: never"),
    "max_dropped_groups": Range(1, 10**9, note="groups in a row; null: never"),
    "retire_saturated_prompts": Range(1, 10**9, note="groups in a row; null: off"),
    # evaluation during training
    "eval_num_generations": Range(1, 1024, note="k of eval/pass@k"),
    "eval_temperature": Range(0, 100, note="0: greedy"),
    "eval_max_prompts": Range(1, 10**9, note="null: every prompt"),
    "eval_pass_threshold": Range(-1e9, 1e9, note="total reward"),
    # logging and checkpoints
    "logging_steps": Range(0, BIG, low_open=True, note="< 1: a fraction of the steps"),
    "save_steps": Range(0, BIG, low_open=True, note="< 1: a fraction of the steps"),
    "eval_steps": Range(0, BIG, low_open=True),
    "eval_delay": Range(0, BIG),
    "save_total_limit": Range(1, 10**6),
    "num_completions_to_print": Range(0, 10**6),
    "torch_empty_cache_steps": Range(1, BIG),
    # the machine
    "seed": Range(0, 2**32 - 1),
    "data_seed": Range(0, 2**32 - 1),
    "dataloader_num_workers": Range(0, 64),
    "dataloader_prefetch_factor": Range(1, 1024),
    "ddp_bucket_cap_mb": Range(1, 10**5),
    "ddp_timeout": Range(1, 7 * DAY_S, note="seconds"),
    "local_rank": Range(0, 4096, also=(-1,), note="set by the launcher"),
}


def range_errors(values: dict[str, Any]) -> dict[str, str]:
    """``{field: message}`` for each numeric value of ``values`` outside its range (None and
    non-numbers are left to the type checks)."""
    errors: dict[str, str] = {}
    for name, value in values.items():
        bounds = FIELD_RANGES.get(name)
        if bounds is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not (math.isfinite(value) and bounds.contains(value)):
            note = f" ({bounds.note})" if bounds.note else ""
            errors[name] = f"must be in {bounds.text()}{note}, got {value!r:.40}"
    return errors


def ranges_markdown() -> str:
    """The README's table: every numeric field and its range."""
    lines = ["| field | range | note |", "| --- | --- | --- |"]
    for name in sorted(FIELD_RANGES):
        bounds = FIELD_RANGES[name]
        lines.append(f"| `{name}` | {bounds.text()} | {bounds.note} |")
    return "\n".join(lines) + "\n"
