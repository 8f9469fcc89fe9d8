"""A logging window without events reports the spec's values, not a gap (issue 23 item 6)."""

from __future__ import annotations

import math

from trainer.reporting.metrics import MetricWindow, counts_in, fill_absent


def test_counts_without_events_are_zero_and_tool_frequency_is_nan():
    window = MetricWindow()
    window.add("reward", 0.5)
    logs = fill_absent(window.reduce(), has_tools=True, tool_names=["calculator"])
    assert logs["sample/dropped_stale_count"] == 0.0
    assert logs["batch/dropped_oversize_count"] == 0.0
    assert logs["rollout/vllm_retry_count"] == 0.0
    assert logs["tools/unknown_name_count"] == 0.0
    assert logs["tools/calculator/call_count"] == 0.0 and logs["tools/calculator/failure_count"] == 0.0
    assert math.isnan(logs["tools/failure_frequency"])
    assert "rollout/vllm_preemption_count" not in logs  # unknown without the server's /metrics


def test_recorded_values_win_and_tool_metrics_need_tools():
    window = MetricWindow()
    window.add("sample/dropped_stale_count", 1)
    window.add("sample/dropped_stale_count", 2)
    window.add("tools/failure_frequency", 0.25)
    logs = fill_absent(window.reduce(), has_tools=True, tool_names=[])
    assert logs["sample/dropped_stale_count"] == 3.0 and logs["tools/failure_frequency"] == 0.25
    plain = fill_absent({}, has_tools=False, tool_names=[])
    assert not any(name.startswith("tools/") for name in plain)


def test_a_count_seen_once_is_zero_in_every_later_window_not_missing():
    """Issue 35 item 1: ``rollout/vllm_preemption_count`` (the server is polled every 5 s, so a short
    window may hold no poll) and an environment's tool counts (announced as 0 when first offered)
    were absent from windows that did not see them."""
    first = MetricWindow()
    first.add("rollout/vllm_preemption_count", 2)
    first.add("tools/increment/call_count", 0)
    first.add("rollout/vllm_kv_cache_usage_frac", 0.5)  # a mean: not a count, never filled
    first.add("reward", 1.0)
    seen = counts_in(first.reduce())
    assert seen == {"rollout/vllm_preemption_count", "tools/increment/call_count"}
    later = fill_absent({"reward": 0.0}, has_tools=True, tool_names=[], counts_seen=seen)
    assert later["rollout/vllm_preemption_count"] == 0.0 and later["tools/increment/call_count"] == 0.0
    assert "rollout/vllm_kv_cache_usage_frac" not in later
    kept = fill_absent(
        {"rollout/vllm_preemption_count": 4.0}, has_tools=False, tool_names=[], counts_seen=seen
    )
    assert kept["rollout/vllm_preemption_count"] == 4.0  # what the window saw wins
