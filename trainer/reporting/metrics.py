"""The metric catalogue: every metric the trainer logs, declared once, and the window that reduces them.

Each :class:`Metric` carries its name (a pattern such as ``rewards/{name}/mean`` for the per-function,
per-tool families), its window reduction, unit, namespace, a one-line help text from the spec
("Logged metrics") and the condition under which it is logged at all. Producers record under the
module constants below (``window.add(ROLLOUT_DURATION_S, ...)``, ``REWARD_FUNC_MEAN.format(name=...)``);
:func:`metric` resolves a concrete name to its declaration. The diagnosis, the progress bar, the
e2e test, ``GET /api/v1/metrics/catalogue/`` (the dashboard's chart groups and tooltips) and
``docs/metrics.md`` (:func:`catalogue_markdown`) all read it.

Metrics are logged once per logging window (everything recorded since the previous log). The
reductions, as the spec states them:

* ``sum``: counts (the spec: names whose last part contains the word ``count``);
* ``max`` / ``min``: the largest / smallest value (last part contains ``max`` / ``min``);
* ``rate``: total amount / total seconds (see :meth:`MetricWindow.add_rate`);
* ``last``: cumulative values and gauges that are a setting, not a sample (``num_tokens``);
* ``mean``: everything else, over the values recorded in the window (per rollout, sample or call).

An undeclared name (a user's rollout loop or plugin logging its own metric) keeps working: it is
reduced by the spec's naming rule above and warned about once per process. With
``GRPO_STRICT_METRICS=1`` (the test suite sets it, and its trainer subprocesses inherit it) recording
one raises :class:`UnknownMetricError` instead, so a producer's typo fails loudly.

Pure stdlib: the control plane imports this without torch/transformers.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

SUM, MAX, MIN, MEAN, RATE, LAST = "sum", "max", "min", "mean", "rate", "last"
REDUCTIONS = (SUM, MAX, MIN, MEAN, RATE, LAST)
# The spec's reading order of the namespaces ("train" = names without a slash); the dashboard's too.
NAMESPACES = (
    "train",
    "rewards",
    "completions",
    "sampling",
    "clip_ratio",
    "rollout",
    "sample",
    "batch",
    "perf",
    "tools",
    "env",
    "curriculum",
    "eval",
)
STRICT_ENV = "GRPO_STRICT_METRICS"


class UnknownMetricError(KeyError):
    """A metric name no declaration of the catalogue matches."""


@dataclass(frozen=True)
class Metric:
    """One declaration. ``name`` is a concrete name or a pattern with ``{placeholders}``;
    ``when`` is the condition under which it is logged ("" = every run, rollout-side metrics in the
    windows where a group was scored)."""

    name: str
    reduction: str
    unit: str
    help: str
    when: str = ""
    marks: bool = False  # each change of its value is marked on every chart of the run page

    @property
    def namespace(self) -> str:
        return self.name.split("/", 1)[0] if "/" in self.name else "train"

    @property
    def templated(self) -> bool:
        return "{" in self.name

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: name, reduction, unit, help, when, namespace, templated."""
        return {
            "name": self.name,
            "reduction": self.reduction,
            "unit": self.unit,
            "help": self.help,
            "when": self.when,
            "namespace": self.namespace,
            "templated": self.templated,
            "marks": self.marks,
        }


CATALOGUE: dict[str, Metric] = {}


def _m(name: str, reduction: str, unit: str, help: str, when: str = "", *, marks: bool = False) -> str:
    """Declare a metric; returns its name (or pattern) for the module constant."""
    assert name not in CATALOGUE and reduction in REDUCTIONS, name
    CATALOGUE[name] = Metric(name, reduction, unit, help, when, marks)
    return name


_TOOLS, _MULTI_TURN, _SERVER = "the trainer has tools", "multi-turn rollouts", "the server exposes /metrics"
_EOS, _END = "a completion ended with EOS", "once, at the end of training"
_MOE, _DROP = "a MoE model with router_aux_loss_coef != 0", "a group was dropped"
_MFU = "the device's peak FLOPs and the model's architecture are known"

# ---- reward, loss and training (names without a namespace) ---------------------------------------
NUM_TOKENS = _m(
    "num_tokens", LAST, "tokens", "Prompt and completion tokens forwarded so far (shared prefixes once)."
)
LOSS = _m("loss", MEAN, "", "Training loss, averaged over the window's steps (Trainer).")
GRAD_NORM = _m("grad_norm", LAST, "", "Gradient norm before clipping at the window's last step (Trainer).")
LEARNING_RATE = _m("learning_rate", LAST, "", "Learning rate at the window's last step (Trainer).")
EPOCH = _m(
    "epoch",
    LAST,
    "epochs",
    "Passes over the prompt dataset so far.",
    "the prompts come from a dataset with a length (not an environment's own, not an IterableDataset)",
)
REWARD = _m("reward", MEAN, "", "Mean summed reward over all scored completions, dropped groups too.")
REWARD_GROUP_STD = _m(
    "reward_group_std", MEAN, "", "Within-group std of the summed reward, over trained samples."
)
REWARD_KEPT = _m("reward_kept", MEAN, "", "Mean reward of the trained samples (dropped groups excluded).")
REWARD_DROPPED = _m("reward_dropped", MEAN, "", "Mean reward of the dropped groups.", _DROP)
FRAC_REWARD_ZERO_STD = _m(
    "frac_reward_zero_std", MEAN, "frac", "Share of groups dropped: zero std or < 2 scored."
)
ENTROPY = _m("entropy", MEAN, "nats", "Mean entropy of the token predictions on trained tokens.")
AUX_LOSS = _m("aux_loss", MEAN, "", "MoE load-balancing loss, before its coefficient.", _MOE)
TRAIN_RUNTIME = _m("train_runtime", LAST, "s", "Wall time of the whole training (Trainer).", _END)
TRAIN_SAMPLES_PER_SECOND = _m("train_samples_per_second", LAST, "1/s", "Samples per second (Trainer).", _END)
TRAIN_STEPS_PER_SECOND = _m(
    "train_steps_per_second", LAST, "1/s", "Optimizer steps per second (Trainer).", _END
)
TOTAL_FLOS = _m(
    "total_flos", LAST, "FLOPs", "Estimated floating point operations of the training (Trainer).", _END
)
TRAIN_LOSS = _m("train_loss", LAST, "", "Mean training loss over the whole training (Trainer).", _END)

# ---- rewards/ (one pair per reward function, or environment class owning the reward) -------------
REWARD_FUNC_MEAN = _m(
    "rewards/{name}/mean", MEAN, "", "Mean reward of one function over the completions it scored."
)
REWARD_FUNC_GROUP_STD = _m(
    "rewards/{name}/group_std", MEAN, "", "One function's within-group reward std, over trained samples."
)

# ---- completions/ (lengths in generated tokens, tool results excluded) ---------------------------
COMPLETIONS_MEAN_LENGTH = _m("completions/mean_length", MEAN, "tokens", "Mean completion length.")
COMPLETIONS_MIN_LENGTH = _m("completions/min_length", MIN, "tokens", "Shortest completion.")
COMPLETIONS_MAX_LENGTH = _m("completions/max_length", MAX, "tokens", "Longest completion.")
COMPLETIONS_MEAN_TERMINATED_LENGTH = _m(
    "completions/mean_terminated_length", MEAN, "tokens", "Mean length of completions ending with EOS.", _EOS
)
COMPLETIONS_MIN_TERMINATED_LENGTH = _m(
    "completions/min_terminated_length", MIN, "tokens", "Shortest completion ending with EOS.", _EOS
)
COMPLETIONS_MAX_TERMINATED_LENGTH = _m(
    "completions/max_terminated_length", MAX, "tokens", "Longest completion ending with EOS.", _EOS
)
COMPLETIONS_CLIPPED_RATIO = _m(
    "completions/clipped_ratio", MEAN, "frac", "Share of completions whose last turn lacks EOS."
)
COMPLETIONS_DUPLICATE_FRAC = _m(
    "completions/duplicate_frac", MEAN, "frac", "Share of rollouts equal to an earlier one of the group."
)

# ---- sampling/ (trained tokens: the sampler's logprobs against the trainer's) ---------------------
SAMPLING_LOGP_DIFF_MEAN = _m(
    "sampling/sampling_logp_difference/mean", MEAN, "nats", "Mean |sampler - trainer| logprob difference."
)
SAMPLING_LOGP_DIFF_MAX = _m(
    "sampling/sampling_logp_difference/max", MAX, "nats", "Largest |sampler - trainer| logprob difference."
)
SAMPLING_IS_RATIO_MIN = _m(
    "sampling/importance_sampling_ratio/min", MIN, "ratio", "Smallest importance ratio, before masking."
)
SAMPLING_IS_RATIO_MEAN = _m(
    "sampling/importance_sampling_ratio/mean", MEAN, "ratio", "Mean importance ratio."
)
SAMPLING_IS_RATIO_MAX = _m(
    "sampling/importance_sampling_ratio/max", MAX, "ratio", "Largest importance ratio."
)
SAMPLING_MASKED_MEAN = _m(
    "sampling/masked_mean", MEAN, "frac", "Share of trained tokens masked: ratio outside the clip range."
)
SAMPLING_SAMPLER_MASS = _m(
    "sampling/sampler_mass",
    MEAN,
    "frac",
    "Probability mass of the sampler's top-k logprobs.",
    "score_centering=True",
)

# ---- clip_ratio/ (with score_centering, the tokens outside the trust region) ----------------------
CLIP_RATIO_REGION_MEAN = _m(
    "clip_ratio/region_mean", MEAN, "frac", "Share of trained tokens clipped (trust region)."
)
CLIP_RATIO_LOW_MEAN = _m(
    "clip_ratio/low_mean", MEAN, "frac", "Share of tokens clipped at the low bound, 1 - epsilon."
)
CLIP_RATIO_LOW_MIN = _m(
    "clip_ratio/low_min", MIN, "frac", "Smallest per-completion share clipped at the low bound."
)
CLIP_RATIO_HIGH_MEAN = _m("clip_ratio/high_mean", MEAN, "frac", "Share of tokens clipped at the high bound.")
CLIP_RATIO_HIGH_MAX = _m(
    "clip_ratio/high_max", MAX, "frac", "Largest per-completion share clipped at the high bound."
)

# ---- rollout/ ------------------------------------------------------------------------------------
ROLLOUT_DURATION_S = _m("rollout/duration_s", MEAN, "s", "Wall time of a rollout, dispatch to collection.")
ROLLOUT_GENERATED_TOKENS_PER_S = _m(
    "rollout/generated_tokens_per_s", RATE, "tokens/s", "Generation throughput since the last report."
)
ROLLOUT_CONCURRENCY = _m(
    "rollout/concurrency", MEAN, "rollouts", "Rollouts running on the vLLM server at once."
)
ROLLOUT_CONCURRENCY_CAP = _m(
    "rollout/concurrency_cap", LAST, "rollouts", "Current limit on rollouts in flight, following server load."
)
ROLLOUT_TURNS_MEAN = _m("rollout/turns_mean", MEAN, "turns", "Mean turns per rollout.")
ROLLOUT_TURNS_MAX = _m("rollout/turns_max", MAX, "turns", "Most turns of a rollout.")
ROLLOUT_SAMPLES_PER_ROLLOUT = _m(
    "rollout/samples_per_rollout", MEAN, "samples", "Training samples per rollout (> 1: forks)."
)
ROLLOUT_FORK_FRAC = _m(
    "rollout/fork_frac", MEAN, "frac", "Share of turn transitions that started a new sample.", _MULTI_TURN
)
ROLLOUT_DRIFT_TOKENS_MEAN = _m(
    "rollout/drift_tokens_mean", MEAN, "tokens", "Held tokens a fork re-rendered, per turn.", _MULTI_TURN
)
ROLLOUT_DRIFT_TOKENS_MAX = _m(
    "rollout/drift_tokens_max", MAX, "tokens", "Most held tokens a fork re-rendered.", _MULTI_TURN
)
ROLLOUT_SCORE_QUEUE_SIZE = _m(
    "rollout/score_queue_size", MEAN, "groups", "Finished groups waiting to be scored."
)
ROLLOUT_QUEUE_SIZE = _m("rollout/queue_size", MEAN, "samples", "Scored samples waiting in the rollout queue.")
ROLLOUT_SCORE_S = _m("rollout/score_s", MEAN, "s", "Time to score a group.")
ROLLOUT_SCORE_WAIT_S = _m("rollout/score_wait_s", MEAN, "s", "Time a finished group waited to be scored.")
ROLLOUT_SCORE_BLOCK_S = _m(
    "rollout/score_block_s", MEAN, "s", "Time generation blocked on a full scoring queue."
)
ROLLOUT_BACKPRESSURE_S = _m(
    "rollout/backpressure_s", MEAN, "s", "Time generation waited, max_staleness steps ahead of training."
)
ROLLOUT_VLLM_RETRY_COUNT = _m("rollout/vllm_retry_count", SUM, "requests", "Retried vLLM requests.")
_RETIRING = "retire_saturated_prompts is set (an extension beyond the spec)"
ROLLOUT_RETIRED_PROMPTS = _m(
    "rollout/retired_prompts", LAST, "prompts", "Prompts retired for all-equal rewards in a row.", _RETIRING
)
ROLLOUT_RETIRED_FRACTION = _m(
    "rollout/retired_fraction",
    LAST,
    "frac",
    "Retired prompts over the distinct prompts dispatched.",
    _RETIRING,
)
ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC = _m(
    "rollout/vllm_kv_cache_usage_frac", MEAN, "frac", "KV-cache usage (max over engines) per poll.", _SERVER
)
ROLLOUT_VLLM_RUNNING_REQUESTS = _m(
    "rollout/vllm_running_requests", MEAN, "requests", "Requests the server's engines are decoding.", _SERVER
)
ROLLOUT_VLLM_QUEUED_REQUESTS = _m(
    "rollout/vllm_queued_requests", MEAN, "requests", "Requests accepted but not yet scheduled.", _SERVER
)
ROLLOUT_VLLM_PREEMPTION_COUNT = _m(
    "rollout/vllm_preemption_count", SUM, "requests", "Requests the server preempted (syncs too).", _SERVER
)

_SERVERS = "vllm_server_base_url names several servers"
ROLLOUT_SERVER_REQUESTS = _m(
    "rollout/server/{server}/request_count",
    SUM,
    "requests",
    "Generation requests this server answered.",
    _SERVERS,
)
ROLLOUT_SERVER_KV_CACHE_USAGE_FRAC = _m(
    "rollout/server/{server}/kv_cache_usage_frac",
    MEAN,
    "frac",
    "This server's KV-cache usage (max over its engines) per poll.",
    _SERVERS,
)

# ---- tools/ --------------------------------------------------------------------------------------
TOOLS_CALL_FREQUENCY = _m("tools/call_frequency", MEAN, "calls", "Tool calls per completion.", _TOOLS)
TOOLS_FAILURE_FREQUENCY = _m(
    "tools/failure_frequency", MEAN, "frac", "Share of tool calls that failed; NaN without calls.", _TOOLS
)
TOOLS_LATENCY_S = _m("tools/latency_s", MEAN, "s", "Time to run a tool call.", _TOOLS)
TOOL_LATENCY_S = _m("tools/{tool}/latency_s", MEAN, "s", "Time to run a call of this tool.", _TOOLS)
TOOL_CALL_COUNT = _m("tools/{tool}/call_count", SUM, "calls", "Calls of this tool.", _TOOLS)
TOOL_FAILURE_COUNT = _m("tools/{tool}/failure_count", SUM, "calls", "Failed calls of this tool.", _TOOLS)
TOOLS_UNKNOWN_NAME_COUNT = _m(
    "tools/unknown_name_count", SUM, "calls", "Calls to a tool that does not exist (a policy error).", _TOOLS
)
TOOLS_PARALLEL_CALLS_MEAN = _m(
    "tools/parallel_calls_mean", MEAN, "calls", "Tool calls per assistant message that calls tools.", _TOOLS
)
TOOLS_LOOP_EXHAUSTED_FRAC = _m(
    "tools/loop_exhausted_frac", MEAN, "frac", "Share of rollouts cut at max_tool_calling_iterations.", _TOOLS
)

# ---- env/ ----------------------------------------------------------------------------------------
ENV_RESET_S = _m("env/reset_s", MEAN, "s", "Time in the environment's reset().", "an environment_factory")
ENV_REWARD_S = _m(
    "env/reward_s", MEAN, "s", "Time in the environment's get_reward().", "an environment get_reward"
)

# ---- curriculum/ (a rollout loop that serves levels: trainer.tasks.curriculum) --------------------
CURRICULUM_LEVEL = _m(
    "curriculum/level",
    LAST,
    "level",
    "The curriculum's stage: the index of the level served (easiest first; the number of levels once "
    "every level is served again). Each change is marked on the run page's charts.",
    "the run's loop_cls is a curriculum (trainer.tasks.curriculum.LevelCurriculumLoop)",
    marks=True,
)

# ---- sample/ -------------------------------------------------------------------------------------
SAMPLE_FORWARDED_TOKENS_MEAN = _m(
    "sample/forwarded_tokens_mean", MEAN, "tokens", "Forwarded tokens per sample."
)
SAMPLE_FORWARDED_TOKENS_MAX = _m(
    "sample/forwarded_tokens_max", MAX, "tokens", "Most forwarded tokens of a sample."
)
SAMPLE_TRAINED_TOKENS_MEAN = _m("sample/trained_tokens_mean", MEAN, "tokens", "Trained tokens per sample.")
SAMPLE_TIME_IN_QUEUE_S = _m("sample/time_in_queue_s", MEAN, "s", "Time a sample waited in the rollout queue.")
SAMPLE_STALENESS_MEAN = _m(
    "sample/staleness_mean", MEAN, "steps", "Weight updates between generating and training."
)
SAMPLE_STALENESS_MAX = _m(
    "sample/staleness_max", MAX, "steps", "Most weight updates between generating and training."
)
SAMPLE_DROPPED_STALE_COUNT = _m(
    "sample/dropped_stale_count", SUM, "samples", "Samples dropped: over max_staleness."
)

# ---- batch/ --------------------------------------------------------------------------------------
BATCH_FORWARDED_TOKENS_PER_STEP = _m(
    "batch/forwarded_tokens_per_step", MEAN, "tokens", "Tokens forwarded per step, all processes."
)
BATCH_TRAINED_TOKENS_PER_STEP = _m(
    "batch/trained_tokens_per_step", MEAN, "tokens", "Tokens trained per step, all processes."
)
BATCH_SAMPLES_PER_STEP = _m("batch/samples_per_step", MEAN, "samples", "Samples per step.")
BATCH_GROUPS_PER_STEP = _m("batch/groups_per_step", MEAN, "groups", "Distinct groups per step.")
BATCH_MICROBATCHES_PER_STEP = _m(
    "batch/microbatches_per_step", MEAN, "micro-batches", "Micro-batches per step."
)
BATCH_MASKED_TOKEN_FRAC = _m(
    "batch/masked_token_frac", MEAN, "frac", "Share of forwarded tokens not trained."
)
BATCH_SAMPLES_PER_ROW = _m("batch/samples_per_row", MEAN, "samples", "Samples per packed row.")
BATCH_ROW_TOKENS_MEAN = _m("batch/row_tokens_mean", MEAN, "tokens", "Forwarded tokens per row.")
BATCH_ROW_TOKENS_MAX = _m("batch/row_tokens_max", MAX, "tokens", "Most forwarded tokens of a row.")
BATCH_ROW_FILL_FRAC = _m("batch/row_fill_frac", MEAN, "frac", "Share of token_budget a row fills.")
BATCH_ROW_IMBALANCE = _m(
    "batch/row_imbalance", MEAN, "ratio", "Costliest row's attention cost over the mean row's (1.0 = even)."
)
BATCH_PACKING_RATIO = _m(
    "batch/packing_ratio", MEAN, "ratio", "Tokens before packing per forwarded token (1.0 = none shared)."
)
BATCH_PAD_FRAC = _m(
    "batch/pad_frac", MEAN, "frac", "Padding that evens row lengths (removed before forward)."
)
BATCH_DROPPED_OVERSIZE_COUNT = _m(
    "batch/dropped_oversize_count", SUM, "samples", "Samples dropped: longer than token_budget."
)

# ---- perf/ ---------------------------------------------------------------------------------------
PERF_STEP_S = _m("perf/step_s", MEAN, "s", "Wall time of a step: optimizer, weight sync, waits included.")
PERF_FWD_BWD_S = _m("perf/fwd_bwd_s", MEAN, "s", "Time in the step's forward and backward passes.")
PERF_FWD_S = _m("perf/fwd_s", MEAN, "s", "Time in the step's forward passes.")
PERF_OPTIMIZER_S = _m("perf/optimizer_s", MEAN, "s", "Time in the optimizer step.")
PERF_ROLLOUT_WAIT_S = _m("perf/rollout_wait_s", MEAN, "s", "Time training waited on an empty rollout queue.")
PERF_WEIGHT_SYNC_S = _m("perf/weight_sync_s", MEAN, "s", "Weight sync time: pause, barrier and transfer.")
PERF_EVAL_WAIT_S = _m(
    "perf/eval_wait_s",
    MEAN,
    "s",
    "Time a weight sync waited for the eval pass of the weights it replaces.",
    "the run evaluates (eval_dataset, eval_strategy) and an eval pass was running at a sync",
)
PERF_WEIGHT_SYNC_PAUSE_S = _m(
    "perf/weight_sync_pause_s", MEAN, "s", "Weight sync: waiting for vLLM to pause."
)
PERF_WEIGHT_SYNC_BARRIER_S = _m(
    "perf/weight_sync_barrier_s", MEAN, "s", "Weight sync: waiting for the other processes."
)
PERF_WEIGHT_SYNC_TRANSFER_S = _m(
    "perf/weight_sync_transfer_s", MEAN, "s", "Weight sync: sending the weights."
)
PERF_FWD_BWD_FORWARDED_TOKENS_PER_S = _m(
    "perf/fwd_bwd_forwarded_tokens_per_s", RATE, "tokens/s", "Forwarded tokens/s of forward + backward."
)
PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S = _m(
    "perf/wall_clock_forwarded_tokens_per_s", RATE, "tokens/s", "Forwarded tokens per second of whole steps."
)
PERF_WALL_CLOCK_TRAINED_TOKENS_PER_S = _m(
    "perf/wall_clock_trained_tokens_per_s", RATE, "tokens/s", "Trained tokens per second of whole steps."
)
PERF_FWD_BWD_MFU = _m(
    "perf/fwd_bwd_mfu", MEAN, "frac", "Model FLOPs utilisation of forward + backward.", _MFU
)
PERF_WALL_CLOCK_MFU = _m("perf/wall_clock_mfu", MEAN, "frac", "Model FLOPs utilisation of whole steps.", _MFU)


# ==== lookup ==========================================================================================
# ---- eval/ (an extension: eval_dataset scored during training; one row per eval step) -------------
_EVAL = "the run evaluates: eval_dataset with eval_strategy 'steps' or 'epoch'"
EVAL_REWARD = _m(
    "eval/reward",
    LAST,
    "",
    "Mean total reward of the eval completions (held-out prompts, eval_temperature).",
    _EVAL,
)
EVAL_REWARD_STD = _m("eval/reward_std", LAST, "", "Std of the eval completions' total rewards.", _EVAL)
EVAL_REWARDS_MEAN = _m(
    "eval/rewards/{name}/mean", LAST, "", "Mean reward of one function over the eval completions.", _EVAL
)
EVAL_PASS_AT_K = _m(
    "eval/pass@{k}",
    LAST,
    "frac",
    "Share of eval prompts with at least one of k (eval_num_generations) completions whose total reward "
    "is at least eval_pass_threshold.",
    _EVAL,
)
EVAL_COMPLETIONS_MEAN_LENGTH = _m(
    "eval/completions/mean_length", LAST, "tokens", "Mean length of the eval completions.", _EVAL
)
EVAL_COMPLETIONS_CLIPPED_RATIO = _m(
    "eval/completions/clipped_ratio",
    LAST,
    "frac",
    "Eval completions that hit max_completion_length (no EOS).",
    _EVAL,
)
EVAL_DURATION_S = _m(
    "eval/duration_s", LAST, "s", "Wall time of the eval pass, first request to last score.", _EVAL
)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """``rewards/{name}/mean`` -> ``^rewards/(?P<name>.+)/mean$`` (a placeholder may hold slashes)."""
    parts = re.split(r"\{(\w+)\}", pattern)
    return re.compile(
        "^" + "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>.+)" for i, p in enumerate(parts)) + "$"
    )


_PATTERNS = [(_pattern_regex(m.name), m) for m in CATALOGUE.values() if m.templated]


@cache
def metric(name: str) -> Metric:
    """The declaration of a concrete name (exact names first, then patterns); raises
    :class:`UnknownMetricError` when none matches."""
    if name in CATALOGUE and not CATALOGUE[name].templated:
        return CATALOGUE[name]
    for regex, declared in _PATTERNS:
        if regex.match(name):
            return declared
    raise UnknownMetricError(f"{name!r} is not in the metric catalogue (trainer/reporting/metrics.py)")


def is_declared(name: str) -> bool:
    try:
        metric(name)
    except UnknownMetricError:
        return False
    return True


def spec_naming_rule(name: str) -> str:
    """The spec's window rule read from a name's words: what an undeclared name is reduced by."""
    words = name.rsplit("/", 1)[-1].split("_")
    for word, rule in (("count", SUM), ("max", MAX), ("min", MIN)):
        if word in words:
            return rule
    return MEAN


def strict() -> bool:
    """Undeclared names raise (tests) instead of warning once (production)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


@cache
def _undeclared_rule(name: str) -> str:
    # cached: the warning is logged once per name and process
    logger.warning(
        "metric %r is not in the catalogue (trainer/reporting/metrics.py): reduced by the spec's naming rule (%s)",
        name,
        spec_naming_rule(name),
    )
    return spec_naming_rule(name)


def reduction_rule(name: str) -> str:
    """The window reduction of a concrete name: ``sum``, ``max``, ``min``, ``mean``, ``rate`` or
    ``last`` from its declaration; an undeclared one raises under :func:`strict`, else gets the
    spec's naming rule (and a one-time warning)."""
    try:
        return metric(name).reduction
    except UnknownMetricError:
        if strict():
            raise
        return _undeclared_rule(name)


def counts_in(logs: Mapping[str, Any]) -> set[str]:
    """The names in ``logs`` that are counts (summed over a window): what :func:`fill_absent` fills
    with 0 in later windows."""
    return {name for name in logs if reduction_rule(name) == SUM}


def always_logged() -> list[str]:
    """Concrete names every default run logs (no tools, environment, MoE; full-weight sync), in
    catalogue order; rollout-side ones only in windows where a group was scored."""
    return [m.name for m in CATALOGUE.values() if not m.templated and not m.when]


def catalogue_payload() -> dict[str, Any]:
    """What ``GET /api/v1/metrics/catalogue/`` answers: the namespaces in reading order and every
    declaration (:meth:`Metric.as_dict`), in catalogue order."""
    return {"namespaces": list(NAMESPACES), "metrics": [m.as_dict() for m in CATALOGUE.values()]}


# ==== logged values the window did not see ===============================================================
# Counts every logging window reports: with no event in the window the spec's count rule (a sum of
# the events since the last log) gives 0, so "none happened" reads 0, not a gap in the chart.
# (rollout/vllm_preemption_count is not here: it is only known where the server exposes /metrics.)
ALWAYS_COUNTS = (SAMPLE_DROPPED_STALE_COUNT, BATCH_DROPPED_OVERSIZE_COUNT, ROLLOUT_VLLM_RETRY_COUNT)


def fill_absent(
    logs: dict[str, float], *, has_tools: bool, tool_names: list[str], counts_seen: Iterable[str] = ()
) -> dict[str, float]:
    """``logs`` with the spec's values for what the window did not see: 0 for :data:`ALWAYS_COUNTS`
    and for ``counts_seen`` (counts an earlier window of the run logged: a count the window did not
    see happened 0 times, e.g. ``rollout/vllm_preemption_count`` between two polls of the server,
    an environment's tool never called); when the trainer has tools, 0 for the tool counts
    (``tools/unknown_name_count``, each named tool's ``call_count`` / ``failure_count``) and NaN for
    ``tools/failure_frequency`` (no calls)."""
    out = dict(logs)
    for name in (*ALWAYS_COUNTS, *counts_seen):
        out.setdefault(name, 0.0)
    if has_tools:
        out.setdefault(TOOLS_UNKNOWN_NAME_COUNT, 0.0)
        out.setdefault(TOOLS_FAILURE_FREQUENCY, math.nan)
        for tool in tool_names:
            out.setdefault(TOOL_CALL_COUNT.format(tool=tool), 0.0)
            out.setdefault(TOOL_FAILURE_COUNT.format(tool=tool), 0.0)
    return out


# ==== the window ========================================================================================
class MetricWindow:
    """Accumulates raw metric values for one logging window and reduces them by the catalogue's rules.

    Both processes record into one; the rollout process ships its raw :meth:`state` through a queue
    and the trainer :meth:`merge` s it, so the reduction happens once, here.
    """

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)
        self._rates: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def add(self, name: str, value: float | int | None) -> None:
        """Record one observation (one rollout, sample, call or step). ``None`` is ignored."""
        reduction_rule(name)  # an undeclared name fails here, at its producer, under strict()
        if value is None:
            return
        self._values[name].append(float(value))

    def extend(self, name: str, values: list[float]) -> None:
        """Record many observations of one metric."""
        reduction_rule(name)
        self._values[name].extend(float(v) for v in values if v is not None)

    def add_rate(self, name: str, amount: float, seconds: float) -> None:
        """Record ``amount`` units over ``seconds``; the window reports sum(amount) / sum(seconds)."""
        if reduction_rule(name) != RATE and strict():
            raise ValueError(f"{name!r} is declared {reduction_rule(name)!r}, not a rate")
        acc = self._rates[name]
        acc[0] += float(amount)
        acc[1] += float(seconds)

    def state(self) -> dict[str, Any]:
        """A picklable snapshot of the raw observations (to ship across processes)."""
        return {"values": {k: list(v) for k, v in self._values.items()}, "rates": dict(self._rates)}

    def merge(self, state: dict[str, Any]) -> None:
        """Fold another window's :meth:`state` into this one."""
        for name, values in state.get("values", {}).items():
            self._values[name].extend(values)
        for name, (amount, seconds) in state.get("rates", {}).items():
            self.add_rate(name, amount, seconds)

    def clear(self) -> None:
        self._values.clear()
        self._rates.clear()

    def __bool__(self) -> bool:
        return bool(self._values) or bool(self._rates)

    def reduce(self) -> dict[str, float]:
        """Apply the window rules; returns ``{name: value}`` (NaN where a mean had no finite value).
        Values recorded with :meth:`add` under a rate's name are averaged."""
        out: dict[str, float] = {}
        for name, values in self._values.items():
            if not values:
                continue
            rule = reduction_rule(name)
            if rule == SUM:
                out[name] = float(sum(values))
            elif rule == MAX:
                out[name] = float(max(values))
            elif rule == MIN:
                out[name] = float(min(values))
            elif rule == LAST:
                out[name] = values[-1]
            else:
                finite = [v for v in values if not math.isnan(v)]
                out[name] = float(sum(finite) / len(finite)) if finite else math.nan
        for name, (amount, seconds) in self._rates.items():
            out[name] = amount / seconds if seconds > 0 else 0.0
        return out


# ==== docs/metrics.md ===================================================================================
def catalogue_markdown() -> str:
    """docs/metrics.md: one table per namespace (a test keeps the file equal to this text)."""
    lines = [
        "# Metric reference",
        "",
        "Generated from the catalogue in `trainer/reporting/metrics.py` (`catalogue_markdown()`); a test keeps it",
        'current. Regenerate: `python -c "from trainer.reporting.metrics import catalogue_markdown as m; '
        "open('docs/metrics.md', 'w').write(m())\"`.",
        "",
        "Reductions over a logging window: `sum` (counts), `max` / `min` (extremes), `mean` (over the",
        "rollouts, samples, calls or steps recorded), `rate` (total amount / total seconds), `last` (the",
        "latest value). A name in braces stands for each reward function, environment or tool. A name",
        "the catalogue does not declare (a plugin's own) is reduced by the spec's naming rule (`count` in",
        "its last part: sum; `max` / `min`: max / min; else mean) with a one-time warning.",
    ]
    for namespace in NAMESPACES:
        members = [m for m in CATALOGUE.values() if m.namespace == namespace]
        title = "reward, loss and training (no namespace)" if namespace == "train" else f"`{namespace}/`"
        lines += [
            "",
            f"## {title}",
            "",
            "| name | reduction | unit | logged when | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        for m in members:
            lines.append(f"| `{m.name}` | {m.reduction} | {m.unit} | {m.when or 'always'} | {m.help} |")
    return "\n".join(lines) + "\n"
