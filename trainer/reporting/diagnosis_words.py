"""The words of the diagnosis panel: each verdict's title, severity and advice, and plain words for
the evidence keys (:mod:`trainer.reporting.diagnosis` holds the rules that pick them).

Titles use the spec's names for its cases ("Generation-bound", "Saturated at the top", "Collapse"...);
evidence keys are metric names (the spec's) or ``name:derived`` numbers the rules compute, which
:func:`evidence_label` turns into plain words for the page.
"""

from __future__ import annotations

__all__ = [
    "BOTH_HOLD",
    "BOTTLENECK",
    "CONCURRENCY",
    "DUPLICATES",
    "SATURATION",
    "evidence_label",
    "evidence_labels",
]

# Each table: verdict slug -> (title, severity "ok" | "info" | "warn", advice).

BOTTLENECK = {
    "generation_bound": (
        "Generation-bound: the trainer is starved",
        "warn",
        "The queue is nearly empty and the trainer waits for samples. Check "
        "rollout/generated_tokens_per_s, rollout/concurrency and rollout/score_queue_size.",
    ),
    "trainer_bound": (
        "Trainer-bound: generation is held back by max_staleness",
        "info",
        "The queue holds about max_staleness steps of samples and generation waits; "
        "sample/staleness_mean sits near the cap. Expected when inference is faster than training.",
    ),
    "staleness_too_tight": (
        "Both sides wait: max_staleness is too strict",
        "warn",
        "Rollouts in flight fill the staleness allowance before their samples reach the queue, so the "
        "trainer waits while generation is held back. Raise max_staleness.",
    ),
    "balanced": (
        "Balanced: neither side waits",
        "ok",
        "Nothing to do.",
    ),
}


CONCURRENCY = {
    "staleness_limit": (
        "Staleness limits generation",
        "info",
        "rollout/backpressure_s > 0: generation is ahead of training by max_staleness steps. Expected "
        "when inference is faster than training.",
    ),
    "server_load": (
        "vLLM server load limits concurrency",
        "info",
        "rollout/concurrency_cap is below max_concurrent_rollouts: the controller keeps the KV cache "
        "from overfilling. Lowering --max-model-len or adding server GPUs leaves room for more rollouts.",
    ),
    "max_concurrent_rollouts_ceiling": (
        "max_concurrent_rollouts is the ceiling",
        "warn",
        "Rollouts in flight sit at max_concurrent_rollouts while the KV cache has room and the trainer "
        "waits. Raise max_concurrent_rollouts if the environment and tools allow it.",
    ),
    "none": (
        "No concurrency limit is binding",
        "ok",
        "Nothing to do.",
    ),
}


# How a concurrency verdict and the bottleneck verdict hold together, appended to the advice.
BOTH_HOLD = {
    ("staleness_limit", "staleness_too_tight"): " The bottleneck card says both sides wait: here the "
    "staleness limit is too strict rather than expected; raise max_staleness.",
    ("server_load", "generation_bound"): " With the bottleneck card (generation-bound): the trainer waits "
    "because the vLLM server is full, not because too few rollouts are allowed.",
    ("none", "generation_bound"): " With the bottleneck card (generation-bound): the trainer waits although "
    "rollouts in flight stay under every limit, so each rollout is slow (long completions, slow tools or "
    "scoring). Check rollout/generated_tokens_per_s and rollout/score_queue_size.",
}


# Appended to the saturation card where dropped groups dominate and retirement is off.
SATURATION_RETIRE_ADVICE = (
    " Dropped groups cost {cost}: set retire_saturated_prompts (e.g. 2) to stop generating for prompts "
    "whose groups keep getting one reward (an extension beyond the spec; docs/config.md)."
)


SATURATION = {
    "all_dropped": (
        "Every group is dropped: no step can train",
        "warn",
        "Every completion of each group got the same reward (frac_reward_zero_std = 1), so no group gives a "
        "gradient and the trainer waits for one that does.",
    ),
    "saturated_top_stalled": (
        "Saturated at the top: every group is solved, so no step can train",
        "warn",
        "Reward is at the top of its range and frac_reward_zero_std is 1: every rollout solves its prompt, "
        "so no group gives a gradient. Successful runs usually end this way. Stop the run or switch to "
        "harder prompts.",
    ),
    "healthy": (
        "Healthy: most groups produce a gradient",
        "ok",
        "Nothing to do.",
    ),
    "saturated_top": (
        "Saturated at the top: prompts became too easy",
        "warn",
        "Almost every rollout solves its prompt; successful runs usually end this way. Stop the run or "
        "switch to harder prompts.",
    ),
    "stuck_bottom": (
        "Stuck at the bottom: prompts too hard or the reward gives no credit",
        "warn",
        "Check completions/clipped_ratio first (a completion cut before its answer scores 0), then read a "
        "few completions to see that the reward function parses them.",
    ),
    "regression": (
        "Regression: groups that used to pass now fail together",
        "warn",
        "Check completions/duplicate_frac and entropy for collapse.",
    ),
    "mixed": (
        "Mixed: some prompts too easy, some too hard",
        "info",
        "With 0/1 rewards some prompts are too easy and others too hard; with partial-credit rewards groups "
        "may sit on the same partial score. Read the rollouts.",
    ),
    "unclear": (
        "No saturation pattern matches clearly",
        "info",
        "Many groups are dropped but the curves match none of the spec's patterns; read "
        "frac_reward_zero_std, reward_dropped and reward together against the reward range.",
    ),
}


DUPLICATES = {
    "healthy": (
        "Healthy: rollouts of a group are sampled independently",
        "ok",
        "Nothing to do (a small baseline is normal when completions are short enough to repeat by chance).",
    ),
    "not_random": (
        "Sampling is no longer random: groups are copies of one rollout",
        "warn",
        "completions/duplicate_frac jumped toward (num_generations - 1) / num_generations. Check for "
        "temperature 0, or data-parallel vLLM engines sharing a sampling seed.",
    ),
    "short_answers": (
        "Short answers repeat: copies are the same (mostly correct) answer, not broken sampling",
        "ok",
        "Completions are short enough that every rollout which gets the answer right is the same text, so "
        "completions/duplicate_frac sits above the baseline without a jump. Non-random sampling shows as a "
        "jump toward (num_generations - 1) / num_generations; there is none in this window. (Only a run "
        "sampled at temperature 0 from its first step looks the same: check the temperature once.)",
    ),
    "collapse": (
        "Collapse: the policy converges to one answer per prompt",
        "warn",
        "completions/duplicate_frac rises slowly while entropy falls. Duplicates also raise "
        "frac_reward_zero_std, so fewer groups teach the policy anything.",
    ),
    "unclear": (
        "Duplicates above baseline, no clear pattern",
        "info",
        "completions/duplicate_frac is above the baseline but neither jumped to the ceiling nor rises with "
        "falling entropy; read a few groups.",
    ),
}


# name:derived suffix -> plain words, "{name}" standing for the metric it is derived from.
DERIVED_WORDS = {
    "step_frac": "{name} as a share of the step time (perf/step_s)",
    "fill": "{name} as a share of max_staleness steps of samples",
    "change": "{name}: change over the window (a share of the reward range for rewards)",
    "change_rel": "{name}: change over the window, relative to its mean",
    "position": "{name}: where it sits in the reward range (0 = lowest, 1 = highest)",
    "recent": "{name}: mean of the last steps",
    "ceiling": "{name} ceiling, (num_generations - 1) / num_generations",
    "jump": "{name}: rise from the window's first steps to its last",
}
PLAIN = {
    "reward_range:lo": "lowest reward (the reward range)",
    "reward_range:hi": "highest reward (the reward range)",
}


def evidence_label(key: str) -> str:
    """Plain words for an evidence key: a metric name stays the spec's name; ``config/x`` reads
    "x (config)"; ``name:derived`` reads as a phrase about ``name``."""
    if key in PLAIN:
        return PLAIN[key]
    if key.startswith("config/"):
        return f"{key.removeprefix('config/')} (config)"
    name, _, derived = key.partition(":")
    if derived in DERIVED_WORDS:
        return DERIVED_WORDS[derived].format(name=name)
    return key if not derived else f"{name} ({derived.replace('_', ' ')})"


def evidence_labels(evidence: dict[str, float | None]) -> dict[str, str]:
    """Evidence key -> plain words, for every key of ``evidence``."""
    return {key: evidence_label(key) for key in evidence}
