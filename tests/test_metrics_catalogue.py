"""The metric catalogue (trainer/reporting/metrics.py): one declaration per metric, the window rules read from
it, undeclared names (strict in tests, a one-time warning in production), producers using its names,
and docs/metrics.md generated from it."""

from __future__ import annotations

import ast
import logging
import math
from pathlib import Path

import pytest

from trainer.reporting import metrics
from trainer.reporting.metrics import (
    CATALOGUE,
    REDUCTIONS,
    MetricWindow,
    UnknownMetricError,
    catalogue_markdown,
    metric,
    reduction_rule,
    spec_naming_rule,
)

REPO = Path(__file__).resolve().parent.parent


def test_every_declaration_is_complete():
    for m in CATALOGUE.values():
        assert m.reduction in REDUCTIONS, m
        assert m.namespace in metrics.NAMESPACES, m
        assert m.help and "\n" not in m.help and m.help.endswith("."), m
        assert m.as_dict()["name"] == m.name


def test_reductions_agree_with_the_spec_naming_rule():
    """The spec's rule (count: sum; max / min: kept; else mean) still holds for every declared name;
    the exceptions are the rates, the cumulative values and what the Trainer itself logs once."""
    exceptions = {name: m.reduction for name, m in CATALOGUE.items() if m.reduction != spec_naming_rule(name)}
    rates = {name for name, r in exceptions.items() if r == metrics.RATE}
    assert rates == {
        "rollout/generated_tokens_per_s",
        "perf/fwd_bwd_forwarded_tokens_per_s",
        "perf/wall_clock_forwarded_tokens_per_s",
        "perf/wall_clock_trained_tokens_per_s",
    }
    lasts = {name for name, r in exceptions.items() if r == metrics.LAST}
    # the former LAST_VALUE_METRICS, plus the Trainer's own (grad_norm of the last step, final summary)
    assert {"num_tokens", "epoch", "learning_rate", "rollout/concurrency_cap", "grad_norm"} <= lasts
    assert set(exceptions) == rates | lasts


def test_lookup_resolves_patterns_and_refuses_unknown_names():
    assert metric("rewards/accuracy_reward/mean").name == "rewards/{name}/mean"
    assert metric("tools/calculator/call_count").reduction == "sum"
    assert metric("tools/latency_s").name == "tools/latency_s"  # the exact name, not the per-tool one
    assert metric("tools/calculator/latency_s").name == "tools/{tool}/latency_s"
    assert reduction_rule("sample/staleness_max") == "max"
    with pytest.raises(UnknownMetricError, match="rollout/no_such_metric"):
        metric("rollout/no_such_metric")


def test_window_rules_are_unchanged():
    window = MetricWindow()
    for value in (1, 2, 3):
        window.add("sample/dropped_stale_count", value)  # sum
        window.add("sample/staleness_max", value)  # max
        window.add("completions/min_length", value)  # min
        window.add("num_tokens", value * 10)  # last
        window.add("reward", value)  # mean
    window.add("reward", math.nan)  # means skip NaN
    window.add_rate("perf/wall_clock_trained_tokens_per_s", 30, 2)
    window.add_rate("perf/wall_clock_trained_tokens_per_s", 10, 2)
    assert window.reduce() == {
        "sample/dropped_stale_count": 6.0,
        "sample/staleness_max": 3.0,
        "completions/min_length": 1.0,
        "num_tokens": 30.0,
        "reward": 2.0,
        "perf/wall_clock_trained_tokens_per_s": 10.0,
    }


def test_undeclared_name_fails_in_tests(monkeypatch):
    monkeypatch.setenv(metrics.STRICT_ENV, "1")
    with pytest.raises(UnknownMetricError):
        MetricWindow().add("my_plugin/score", 1.0)
    with pytest.raises(ValueError, match="not a rate"):
        MetricWindow().add_rate("reward", 1.0, 1.0)


def test_undeclared_name_keeps_working_in_production_with_one_warning(monkeypatch, caplog):
    """A user's plugin logging its own metric: reduced by the spec's naming rule, warned about once."""
    monkeypatch.setenv(metrics.STRICT_ENV, "0")
    window = MetricWindow()
    with caplog.at_level(logging.WARNING, logger="trainer.reporting.metrics"):
        for value in (1, 2, 3):
            window.add("my_plugin/hit_count", value)
            window.add("my_plugin/score", value)
        logs = window.reduce()
    assert logs == {"my_plugin/hit_count": 6.0, "my_plugin/score": 2.0}
    warned = [r.getMessage() for r in caplog.records if "not in the catalogue" in r.getMessage()]
    assert len(warned) == 2 and any("my_plugin/hit_count" in w for w in warned), warned


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_producers_use_the_catalogue_names():
    """No namespaced metric name is spelled out as a literal in the trainer outside the catalogue
    (a literal there would be a second declaration that can drift)."""
    names = {name for name, m in CATALOGUE.items() if "/" in name and not m.templated}
    offenders = {}
    for path in sorted((REPO / "trainer").rglob("*.py")):
        if path.name == "metrics.py" and path.parent.name == "reporting":
            continue
        found = _string_constants(path) & names
        if found:
            offenders[str(path.relative_to(REPO))] = sorted(found)
    assert not offenders, offenders


def test_metric_reference_doc_is_current():
    doc = (REPO / "docs" / "metrics.md").read_text()
    assert doc == catalogue_markdown(), "regenerate docs/metrics.md (see its header)"
    for m in CATALOGUE.values():
        assert f"| `{m.name}` |" in doc
