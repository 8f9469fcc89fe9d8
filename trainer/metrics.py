"""The metric catalogue's window rules, in one place.

Metrics are logged once per logging window (everything recorded since the previous log). Within a
window, following the spec:

* names whose last part contains the word ``count`` are summed;
* names whose last part contains ``max`` / ``min`` keep the largest / smallest value;
* rates (``*tokens_per_s``) are total amount / total seconds (see :meth:`MetricWindow.add_rate`);
* everything else is the mean of the values recorded in the window (per rollout, sample or call);
* a few cumulative values (``num_tokens``) keep the last value.

Both processes record into a :class:`MetricWindow`; the rollout process ships its raw
:meth:`MetricWindow.state` through a queue and the trainer :meth:`MetricWindow.merge` s it, so the
reduction happens once, here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

LAST_VALUE_METRICS = frozenset({"num_tokens", "epoch", "learning_rate", "rollout/concurrency_cap"})
# Counts every logging window reports: with no event in the window the spec's count rule (a sum of
# the events since the last log) gives 0, so "none happened" reads 0, not a gap in the chart.
# (rollout/vllm_preemption_count is not here: it is only known where the server exposes /metrics.)
ALWAYS_COUNTS = ("sample/dropped_stale_count", "batch/dropped_oversize_count", "rollout/vllm_retry_count")


def fill_absent(logs: dict[str, float], *, has_tools: bool, tool_names: list[str]) -> dict[str, float]:
    """``logs`` with the spec's values for what the window did not see: 0 for :data:`ALWAYS_COUNTS`
    and, when the trainer has tools, 0 for the tool counts (``tools/unknown_name_count``, each named
    tool's ``call_count`` / ``failure_count``) and NaN for ``tools/failure_frequency`` (no calls)."""
    out = dict(logs)
    for name in ALWAYS_COUNTS:
        out.setdefault(name, 0.0)
    if has_tools:
        out.setdefault("tools/unknown_name_count", 0.0)
        out.setdefault("tools/failure_frequency", math.nan)
        for tool in tool_names:
            out.setdefault(f"tools/{tool}/call_count", 0.0)
            out.setdefault(f"tools/{tool}/failure_count", 0.0)
    return out


def reduction_rule(name: str) -> str:
    """The window rule for a metric name: ``sum``, ``max``, ``min``, ``last`` or ``mean``."""
    if name in LAST_VALUE_METRICS:
        return "last"
    words = name.rsplit("/", 1)[-1].split("_")
    if "count" in words:
        return "sum"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


class MetricWindow:
    """Accumulates raw metric values for one logging window and reduces them by the spec's rules."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)
        self._rates: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def add(self, name: str, value: float | int | None) -> None:
        """Record one observation (one rollout, sample, call or step). ``None`` is ignored."""
        if value is None:
            return
        self._values[name].append(float(value))

    def extend(self, name: str, values: list[float]) -> None:
        """Record many observations of one metric."""
        self._values[name].extend(float(v) for v in values if v is not None)

    def add_rate(self, name: str, amount: float, seconds: float) -> None:
        """Record ``amount`` units over ``seconds``; the window reports sum(amount) / sum(seconds)."""
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
        """Apply the window rules; returns ``{name: value}`` (NaN where a mean had no finite value)."""
        out: dict[str, float] = {}
        for name, values in self._values.items():
            if not values:
                continue
            rule = reduction_rule(name)
            if rule == "sum":
                out[name] = float(sum(values))
            elif rule == "max":
                out[name] = float(max(values))
            elif rule == "min":
                out[name] = float(min(values))
            elif rule == "last":
                out[name] = values[-1]
            else:
                finite = [v for v in values if not math.isnan(v)]
                out[name] = float(sum(finite) / len(finite)) if finite else math.nan
        for name, (amount, seconds) in self._rates.items():
            out[name] = amount / seconds if seconds > 0 else 0.0
        return out
