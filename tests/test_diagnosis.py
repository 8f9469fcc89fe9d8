"""trainer.reporting.diagnosis: the spec's diagnosis tables over synthetic metric windows (no DB, no processes)."""

from __future__ import annotations

import json
import math
import random

import pytest

from trainer.reporting.diagnosis import TOPICS, Diagnosis, diagnose, infer_reward_range

N = 30  # steps per synthetic window


def const(value: float, n: int = N, start: int = 1, noise: float = 0.0, seed: int = 0) -> list:
    """n steps of a constant, with optional deterministic uniform noise."""
    rng = random.Random(seed)
    return [(start + i, value + rng.uniform(-noise, noise)) for i in range(n)]


def ramp(a: float, b: float, n: int = N, start: int = 1) -> list:
    """n steps going linearly from a to b."""
    return [(start + i, a + (b - a) * i / (n - 1)) for i in range(n)]


def by_topic(series: dict, **kwargs) -> dict[str, Diagnosis]:
    found = diagnose(series, window=N, **kwargs)
    assert len({d.topic for d in found}) == len(found), "at most one diagnosis per topic"
    return {d.topic: d for d in found}


def one(series: dict, topic: str, **kwargs) -> Diagnosis:
    found = by_topic(series, **kwargs)
    assert topic in found, f"{topic} missing from {list(found)}"
    return found[topic]


# ==== bottleneck ======================================================================================
def pipeline(rollout_wait: float, backpressure: float, queue: float, step_s: float | None = 10.0) -> dict:
    """Queue metrics; samples_per_step=64 and the default max_staleness=4 make a full queue 256."""
    series = {
        "perf/rollout_wait_s": const(rollout_wait),
        "rollout/backpressure_s": const(backpressure),
        "rollout/queue_size": const(queue),
        "batch/samples_per_step": const(64.0),
    }
    if step_s is not None:
        series["perf/step_s"] = const(step_s)
    return series


def test_bottleneck_generation_bound():
    d = one(pipeline(rollout_wait=4.0, backpressure=0.0, queue=3.0), "bottleneck")
    assert (d.verdict, d.severity) == ("generation_bound", "warn")
    assert d.evidence["perf/rollout_wait_s"] == pytest.approx(4.0)
    assert d.evidence["perf/rollout_wait_s:step_frac"] == pytest.approx(0.4)
    assert d.evidence["rollout/queue_size:fill"] == pytest.approx(3.0 / 256)
    assert "rollout/generated_tokens_per_s" in d.advice


def test_bottleneck_trainer_bound():
    series = pipeline(rollout_wait=0.0, backpressure=2.0, queue=200.0)
    series["sample/staleness_mean"] = const(3.8)
    d = one(series, "bottleneck")
    assert (d.verdict, d.severity) == ("trainer_bound", "info")
    assert d.evidence["rollout/backpressure_s:step_frac"] == pytest.approx(0.2)
    assert d.evidence["rollout/queue_size:fill"] == pytest.approx(200 / 256)
    assert d.evidence["sample/staleness_mean"] == pytest.approx(3.8)
    assert d.evidence["config/max_staleness"] == 4


def test_bottleneck_staleness_too_tight():
    d = one(pipeline(rollout_wait=3.0, backpressure=3.0, queue=10.0), "bottleneck")
    assert (d.verdict, d.severity) == ("staleness_too_tight", "warn")
    assert d.evidence["perf/rollout_wait_s"] == pytest.approx(3.0)
    assert d.evidence["rollout/backpressure_s"] == pytest.approx(3.0)
    assert "max_staleness" in d.advice


def test_bottleneck_balanced():
    d = one(pipeline(rollout_wait=0.05, backpressure=0.0, queue=60.0), "bottleneck")
    assert (d.verdict, d.severity) == ("balanced", "ok")
    assert d.evidence["perf/rollout_wait_s:step_frac"] == pytest.approx(0.005)


def test_bottleneck_grey_zone_leans_on_the_queue():
    # 5% of a step waited: neither near 0 nor high; an empty queue names the generation side
    d = one(pipeline(rollout_wait=0.5, backpressure=0.0, queue=5.0), "bottleneck")
    assert (d.verdict, d.severity) == ("generation_bound", "info")
    assert d.title.startswith("Leaning")
    d = one(pipeline(rollout_wait=0.0, backpressure=0.5, queue=220.0), "bottleneck")
    assert (d.verdict, d.severity) == ("trainer_bound", "info")
    # the queue outranks the larger of two middling waits
    assert (
        one(pipeline(rollout_wait=0.5, backpressure=0.8, queue=5.0), "bottleneck").verdict
        == "generation_bound"
    )
    assert (
        one(pipeline(rollout_wait=0.8, backpressure=0.5, queue=220.0), "bottleneck").verdict
        == "trainer_bound"
    )
    # no queue reading: the larger wait decides
    assert (
        one(pipeline(rollout_wait=0.5, backpressure=0.8, queue=100.0), "bottleneck").verdict
        == "trainer_bound"
    )


def test_bottleneck_waits_relative_to_step_time():
    # 4 s of waiting is nothing in a 400 s step
    assert one(pipeline(4.0, 0.0, 3.0, step_s=400.0), "bottleneck").verdict == "balanced"
    # without perf/step_s, absolute seconds decide
    d = one(pipeline(4.0, 0.0, 3.0, step_s=None), "bottleneck")
    assert d.verdict == "generation_bound"
    assert "perf/rollout_wait_s:step_frac" not in d.evidence


def test_bottleneck_queue_fill_uses_max_staleness():
    d = one(pipeline(0.0, 2.0, 64.0), "bottleneck", config={"max_staleness": 0})
    assert d.evidence["rollout/queue_size:fill"] == pytest.approx(1.0)  # max(max_staleness, 1) steps
    assert d.evidence["config/max_staleness"] == 0


def test_bottleneck_needs_both_waits():
    series = pipeline(4.0, 0.0, 3.0)
    del series["rollout/backpressure_s"]
    assert "bottleneck" not in by_topic(series)


# ==== concurrency =====================================================================================
def rollouts(
    concurrency: float, cap: float, kv: float, rollout_wait: float, backpressure: float = 0.0
) -> dict:
    return {
        "rollout/concurrency": const(concurrency),
        "rollout/concurrency_cap": const(cap),
        "rollout/vllm_kv_cache_usage_frac": const(kv),
        "perf/rollout_wait_s": const(rollout_wait),
        "rollout/backpressure_s": const(backpressure),
        "perf/step_s": const(10.0),
    }


def test_concurrency_staleness_limit():
    d = one(rollouts(concurrency=40, cap=512, kv=0.3, rollout_wait=0.0, backpressure=2.0), "concurrency")
    assert (d.verdict, d.severity) == ("staleness_limit", "info")
    assert d.evidence["rollout/backpressure_s"] == pytest.approx(2.0)


def test_concurrency_server_load():
    d = one(rollouts(concurrency=95, cap=100, kv=0.75, rollout_wait=3.0), "concurrency")
    assert (d.verdict, d.severity) == ("server_load", "info")
    assert d.evidence["rollout/concurrency_cap"] == pytest.approx(100)
    assert d.evidence["config/max_concurrent_rollouts"] == 512


def test_concurrency_max_concurrent_rollouts_ceiling():
    series = rollouts(concurrency=63, cap=64, kv=0.3, rollout_wait=4.0)
    d = one(series, "concurrency", config={"max_concurrent_rollouts": 64})
    assert (d.verdict, d.severity) == ("max_concurrent_rollouts_ceiling", "warn")
    assert d.evidence["rollout/concurrency"] == pytest.approx(63)
    assert d.evidence["rollout/vllm_kv_cache_usage_frac"] == pytest.approx(0.3)
    assert d.evidence["config/max_concurrent_rollouts"] == 64
    assert "max_concurrent_rollouts" in d.advice


def test_concurrency_ceiling_needs_low_kv_and_a_waiting_trainer():
    config = {"max_concurrent_rollouts": 64}
    assert one(rollouts(63, 64, kv=0.9, rollout_wait=4.0), "concurrency", config=config).verdict == "none"
    assert one(rollouts(63, 64, kv=0.3, rollout_wait=0.0), "concurrency", config=config).verdict == "none"


def test_concurrency_none():
    d = one(rollouts(concurrency=30, cap=512, kv=0.2, rollout_wait=0.0), "concurrency")
    assert (d.verdict, d.severity) == ("none", "ok")
    assert d.evidence["rollout/concurrency"] == pytest.approx(30)


# ==== saturation ======================================================================================
def saturation(frac: list, dropped: list, reward: list) -> dict:
    return {"frac_reward_zero_std": frac, "reward_dropped": dropped, "reward": reward}


def test_saturation_healthy():
    series = saturation(const(0.1, noise=0.05), const(0.5, noise=0.3), const(0.5, noise=0.2))
    d = one(series, "saturation")
    assert (d.verdict, d.severity) == ("healthy", "ok")
    assert d.evidence["frac_reward_zero_std"] == pytest.approx(0.1, abs=0.02)


def test_saturation_saturated_top():
    d = one(saturation(ramp(0.5, 0.9), const(0.95, noise=0.02), ramp(0.6, 0.9)), "saturation")
    assert (d.verdict, d.severity) == ("saturated_top", "warn")
    assert d.evidence["frac_reward_zero_std:change"] == pytest.approx(0.4)
    assert d.evidence["reward_dropped:position"] == pytest.approx(0.95, abs=0.01)
    assert d.evidence["reward:change"] == pytest.approx(0.3)


def test_saturation_recommends_retiring_prompts_with_the_tokens_dropped_groups_cost():
    """Issue 34 item 2: most groups dropped, some still training, retirement off: the card says to set
    retire_saturated_prompts and what the dropped groups cost (rate x step time x dropped share)."""
    series = saturation(const(0.8), const(0.95, noise=0.02), const(0.9))
    series.update({"rollout/generated_tokens_per_s": const(500.0), "perf/step_s": const(4.0)})
    d = one(series, "saturation")
    assert "retire_saturated_prompts" in d.advice and "about 1,600 generated tokens a step (80%" in d.advice
    assert d.evidence["config/retire_saturated_prompts"] == 0.0
    assert (
        "retire_saturated_prompts"
        not in one(series, "saturation", config={"retire_saturated_prompts": 2}).advice
    )
    healthy = saturation(const(0.1, noise=0.05), const(0.5, noise=0.3), const(0.5, noise=0.2))
    assert "retire_saturated_prompts" not in one(healthy, "saturation").advice
    stalled = saturation(const(1.0), const(1.0), const(1.0))  # nothing trains: retiring would not help
    assert "retire_saturated_prompts" not in one(stalled, "saturation").advice


@pytest.mark.parametrize(("dropped", "cause"), [(0.5, "constant reward"), (0.0, "too hard")])
def test_saturation_every_group_dropped_names_the_stall_and_its_cause(dropped, cause):
    # Recorded as a stalled run logs it: only the waiting lines' rollout metrics, no reward of kept groups.
    series = {"frac_reward_zero_std": const(1.0, n=3), "reward_dropped": const(dropped, n=3)}
    d = one(series, "saturation", reward_range=(0.0, 1.0))
    assert (d.verdict, d.severity) == ("all_dropped", "warn")
    assert "no step can train" in d.title and cause in d.advice


def test_saturation_every_group_dropped_at_the_top_is_saturated_at_the_top():
    # Issue 22: reward ~ 1 with frac_reward_zero_std ~ 1 is the spec's "saturated at the top" case,
    # named so in the verdict and the title (it used to be the generic "all_dropped" stall).
    series = {"frac_reward_zero_std": const(1.0, n=3), "reward_dropped": const(1.0, n=3)}
    d = one(series, "saturation", reward_range=(0.0, 1.0))
    assert (d.verdict, d.severity) == ("saturated_top", "warn")
    assert d.title.startswith("Saturated at the top") and "no step can train" in d.title
    assert "harder prompts" in d.advice


def test_saturation_stuck_bottom():
    d = one(saturation(const(0.9), const(0.02), const(0.05, noise=0.01)), "saturation")
    assert (d.verdict, d.severity) == ("stuck_bottom", "warn")
    assert d.evidence["reward_dropped:position"] == pytest.approx(0.02)
    assert d.evidence["reward"] == pytest.approx(0.05, abs=0.005)
    assert "completions/clipped_ratio" in d.advice


def test_saturation_regression():
    d = one(saturation(ramp(0.3, 0.7), ramp(0.8, 0.4), ramp(0.7, 0.4)), "saturation")
    assert (d.verdict, d.severity) == ("regression", "warn")
    assert d.evidence["reward_dropped:change"] == pytest.approx(-0.4)
    assert d.evidence["reward:change"] == pytest.approx(-0.3)
    assert "completions/duplicate_frac" in d.advice


def test_saturation_mixed():
    d = one(saturation(const(0.6), const(0.5, noise=0.1), const(0.5, noise=0.1)), "saturation")
    assert (d.verdict, d.severity) == ("mixed", "info")
    assert d.evidence["reward_dropped:position"] == pytest.approx(0.5, abs=0.05)


def test_saturation_partial_match_names_the_nearest_rule():
    # frac flat at a moderate level, dropped near the top, reward climbing: 2 of 3 for saturated_top
    d = one(saturation(const(0.4), const(0.9), ramp(0.5, 0.8)), "saturation")
    assert (d.verdict, d.severity) == ("saturated_top", "info")
    assert d.title.startswith("Partly")


def test_saturation_unclear_when_no_rule_is_near():
    d = one(saturation(const(0.4), const(0.5), const(0.5)), "saturation")
    assert (d.verdict, d.severity) == ("unclear", "info")
    assert d.evidence["frac_reward_zero_std"] == pytest.approx(0.4)


def test_saturation_without_reward_metrics_still_reads_frac():
    d = one({"frac_reward_zero_std": const(0.05)}, "saturation")
    assert d.verdict == "healthy"
    assert "reward" not in d.evidence


def test_reward_range_inferred_for_non_unit_rewards():
    # rewards in [-1, 3]: a dropped mean of -0.9 is near the bottom of that range, not below [0, 1]
    history = saturation(const(0.9), const(-0.9), const(-0.8))
    history["reward"] = [(0, 3.0)] + history["reward"]  # the top of the range, seen once
    assert infer_reward_range(history) == (-0.9, 3.0)  # observed min..max
    d = one(history, "saturation")
    assert d.verdict == "stuck_bottom"
    assert (d.evidence["reward_range:lo"], d.evidence["reward_range:hi"]) == (-0.9, 3.0)
    assert d.evidence["reward_dropped:position"] == pytest.approx(0.0)


def test_reward_range_defaults_to_unit_interval_and_can_be_passed():
    series = saturation(const(0.9), const(0.5), const(0.5))
    assert infer_reward_range(series) == (0.0, 1.0)
    assert one(series, "saturation").verdict == "mixed"
    # the same numbers on a 0..10 scale sit at the bottom
    d = one(series, "saturation", reward_range=(0.0, 10.0))
    assert d.verdict == "stuck_bottom"
    assert d.evidence["reward_dropped:position"] == pytest.approx(0.05)


def test_reward_range_single_value_is_not_empty():
    assert infer_reward_range({"reward": [(1, 2.0), (2, 2.0)]}) == (0.0, 2.0)
    with pytest.raises(ValueError):
        diagnose({"frac_reward_zero_std": const(0.5)}, reward_range=(1.0, 1.0))


# ==== duplicates ======================================================================================
def test_duplicates_healthy():
    series = {"completions/duplicate_frac": const(0.02, noise=0.02), "entropy": const(0.8, noise=0.05)}
    d = one(series, "duplicates")
    assert (d.verdict, d.severity) == ("healthy", "ok")
    assert d.evidence["completions/duplicate_frac"] == pytest.approx(0.02, abs=0.01)


def test_duplicates_not_random_after_a_jump():
    # independent for 25 steps, then every group is one rollout copied (G=8 -> 7/8)
    dup = const(0.01, n=25) + const(0.875, n=5, start=26)
    d = one({"completions/duplicate_frac": dup}, "duplicates")
    assert (d.verdict, d.severity) == ("not_random", "warn")
    assert d.evidence["completions/duplicate_frac:recent"] == pytest.approx(0.875)
    assert d.evidence["completions/duplicate_frac:ceiling"] == pytest.approx(0.875)
    assert "temperature" in d.advice


def test_duplicates_ceiling_follows_num_generations():
    series = {"completions/duplicate_frac": const(0.5)}
    assert one(series, "duplicates", config={"num_generations": 4}).verdict == "not_random"  # ceiling 0.75
    d = one(series, "duplicates", config={"num_generations": 16})  # ceiling 0.94: 0.5 is not near it
    assert d.verdict == "unclear"
    assert d.evidence["config/num_generations"] == 16


def test_duplicates_collapse():
    series = {"completions/duplicate_frac": ramp(0.05, 0.3), "entropy": ramp(1.0, 0.6)}
    d = one(series, "duplicates")
    assert (d.verdict, d.severity) == ("collapse", "warn")
    assert d.evidence["completions/duplicate_frac:change"] == pytest.approx(0.25)
    assert d.evidence["entropy:change_rel"] == pytest.approx(-0.4 / 0.8)


def test_duplicates_rising_without_falling_entropy_is_not_collapse():
    series = {"completions/duplicate_frac": ramp(0.05, 0.3), "entropy": const(0.8)}
    assert one(series, "duplicates").verdict == "unclear"


# ==== clipping ========================================================================================
def test_clipping_truncated():
    d = one({"completions/clipped_ratio": const(0.3)}, "clipping")
    assert (d.verdict, d.severity) == ("truncated", "warn")
    assert d.evidence["completions/clipped_ratio"] == pytest.approx(0.3)
    assert "max_completion_length" in d.advice


def test_clipping_ok():
    d = one({"completions/clipped_ratio": const(0.01)}, "clipping")
    assert (d.verdict, d.severity) == ("ok", "ok")


# ==== general =========================================================================================
def test_absent_metrics_omit_the_topic():
    assert diagnose({}) == []
    assert [d.topic for d in diagnose({"completions/clipped_ratio": const(0.0)})] == ["clipping"]
    assert [d.topic for d in diagnose({"loss": const(1.0)})] == []


def test_none_and_nan_values_are_ignored():
    clipped = [(i, v) for i, v in const(0.3)]
    clipped[3] = (clipped[3][0], None)
    clipped[7] = (clipped[7][0], float("nan"))
    clipped[9] = (clipped[9][0], math.inf)
    d = one({"completions/clipped_ratio": clipped}, "clipping")
    assert d.evidence["completions/clipped_ratio"] == pytest.approx(0.3)
    # a metric with no usable value is absent
    assert diagnose({"completions/clipped_ratio": [(1, None), (2, float("nan"))]}) == []


def test_window_uses_only_the_last_steps():
    # 100 steps of heavy truncation, then 30 clean ones: the last 20 steps say "ok"
    clipped = const(0.9, n=100) + const(0.0, n=30, start=101)
    assert diagnose({"completions/clipped_ratio": clipped}, window=20)[0].verdict == "ok"
    assert diagnose({"completions/clipped_ratio": clipped}, window=200)[0].verdict == "truncated"
    # an old starved regime before the window does not make the pipeline generation-bound
    old, new = pipeline(8.0, 0.0, 1.0), pipeline(0.0, 0.0, 60.0)
    series = {name: old[name] + [(s + N, v) for s, v in new[name]] for name in old}
    assert diagnose(series, window=N)[0].verdict == "balanced"
    assert diagnose(series, window=2 * N)[0].verdict != "balanced"


def test_window_drops_metrics_not_logged_recently():
    series = {"completions/clipped_ratio": const(0.5, n=5), "frac_reward_zero_std": const(0.1, n=100)}
    assert [d.topic for d in diagnose(series, window=20)] == ["saturation"]


def test_all_topics_in_order_and_json_ready():
    series = {
        **pipeline(0.0, 0.0, 60.0),
        "rollout/concurrency": const(30),
        **saturation(const(0.1), const(0.5), const(0.5)),
        "completions/duplicate_frac": const(0.01),
        "completions/clipped_ratio": const(0.0),
    }
    found = diagnose(series, config={"max_staleness": None})  # None falls back to the default
    assert tuple(d.topic for d in found) == TOPICS
    assert [d.severity for d in found] == ["ok"] * 5
    payload = json.loads(json.dumps([d.as_dict() for d in found]))
    assert payload[0]["topic"] == "bottleneck"
    assert set(payload[0]) == {"topic", "verdict", "title", "severity", "evidence", "advice"}
    assert payload[0]["evidence"]["config/max_staleness"] == 4
