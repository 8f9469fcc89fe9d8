"""A logging window without events reports the spec's values, not a gap (issue 23 item 6)."""

from __future__ import annotations

import math

from trainer.metrics import MetricWindow, fill_absent


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
