"""trainer.reporting.diagnosis on recorded metric windows: one test per rule of the spec's tables.

tests/data/diagnosis_windows.json holds metrics.jsonl lines of recorded tiny-model runs ("recorded")
and, per window, the metrics replaced to make its case ("set"; see the file's "about"). Each window is
fed to ``diagnose`` in the shape the API feeds it: metric name -> [(step, value), ...].
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainer.reporting.diagnosis import Diagnosis, diagnose
from trainer.reporting.diagnosis_words import evidence_label, evidence_labels

DATA = json.loads((Path(__file__).parent / "data" / "diagnosis_windows.json").read_text())
WINDOWS = DATA["windows"]


def diagnosed(name: str) -> dict[str, Diagnosis]:
    """The window's verdicts by topic (the default 20-step window, the recorded run's config)."""
    window = WINDOWS[name]
    series: dict[str, list[tuple[int, float]]] = {}
    for i, recorded in enumerate(DATA["recorded"]):
        line = {**recorded, **{metric: values[i] for metric, values in window["set"].items()}}
        for metric, value in line.items():
            if metric != "step":
                series.setdefault(metric, []).append((line["step"], value))
    return {d.topic: d for d in diagnose(series, config=window["config"])}


def verdict(name: str, topic: str) -> tuple[str, str]:
    d = diagnosed(name)[topic]
    return d.verdict, d.severity


# ==== bottleneck and concurrency: one verdict from the same waits =====================================
def test_bottleneck_generation_bound_as_recorded():
    found = diagnosed("tiny_arithmetic")
    assert (found["bottleneck"].verdict, found["bottleneck"].severity) == ("generation_bound", "warn")
    assert found["bottleneck"].evidence["perf/rollout_wait_s:step_frac"] > 0.5


def test_concurrency_under_every_limit_explains_the_starved_trainer():
    # The recorded run: the trainer waits, yet no limit binds. The card says how both hold.
    found = diagnosed("tiny_arithmetic")
    assert found["concurrency"].verdict == "none"
    assert "generation-bound" in found["concurrency"].advice
    assert "rollout/generated_tokens_per_s" in found["concurrency"].advice


def test_concurrency_does_not_name_staleness_when_the_trainer_is_starved():
    # The trainer idles 40% of a step while generation waits 5% on staleness: the bottleneck card says
    # generation-bound, so the concurrency card must not say "generation is ahead of training".
    found = diagnosed("generation_bound_some_backpressure")
    assert found["bottleneck"].verdict == "generation_bound"
    assert found["concurrency"].verdict != "staleness_limit"  # what it said before issue 22
    assert "ahead of training" not in found["concurrency"].advice


def test_trainer_bound_and_staleness_limit_agree():
    found = diagnosed("trainer_bound")
    assert (found["bottleneck"].verdict, found["bottleneck"].severity) == ("trainer_bound", "info")
    assert found["concurrency"].verdict == "staleness_limit"


def test_bottleneck_staleness_too_tight_and_concurrency_says_so():
    found = diagnosed("staleness_too_tight")
    assert (found["bottleneck"].verdict, found["bottleneck"].severity) == ("staleness_too_tight", "warn")
    assert found["concurrency"].verdict == "staleness_limit"
    assert "too strict" in found["concurrency"].advice  # not "expected when inference is faster"


def test_bottleneck_balanced():
    assert verdict("balanced", "bottleneck") == ("balanced", "ok")
    assert verdict("balanced", "concurrency") == ("none", "ok")
    assert "generation-bound" not in diagnosed("balanced")["concurrency"].advice


def test_concurrency_server_load_with_a_starved_trainer():
    found = diagnosed("server_load")
    assert (found["concurrency"].verdict, found["concurrency"].severity) == ("server_load", "info")
    assert found["bottleneck"].verdict == "generation_bound"
    assert "vLLM server is full" in found["concurrency"].advice


def test_concurrency_max_concurrent_rollouts_ceiling():
    d = diagnosed("max_concurrent_rollouts_ceiling")["concurrency"]
    assert (d.verdict, d.severity) == ("max_concurrent_rollouts_ceiling", "warn")
    assert d.evidence["config/max_concurrent_rollouts"] == 64


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_bottleneck_and_concurrency_never_contradict(name):
    found = diagnosed(name)
    staleness_binds = found["bottleneck"].verdict in ("trainer_bound", "staleness_too_tight")
    assert staleness_binds == (found["concurrency"].verdict == "staleness_limit")


# ==== saturation ======================================================================================
def test_saturation_mixed_as_recorded():
    d = diagnosed("tiny_arithmetic")["saturation"]
    assert (d.verdict, d.severity) == ("mixed", "info")
    assert 0.2 < d.evidence["reward_dropped:position"] < 0.8


def test_saturation_reward_at_the_top_with_every_group_solved_is_saturated_at_the_top():
    # reward ~1, frac_reward_zero_std ~1 and flat (already saturated, no longer climbing): this read
    # "No saturation pattern matches clearly" before issue 22.
    d = diagnosed("tiny_arithmetic_solved")["saturation"]
    assert (d.verdict, d.severity) == ("saturated_top", "warn")
    assert d.title.startswith("Saturated at the top")
    assert "harder prompts" in d.advice


def test_saturation_healthy():
    assert verdict("saturation_healthy", "saturation") == ("healthy", "ok")


def test_saturation_stuck_bottom():
    d = diagnosed("stuck_bottom")["saturation"]
    assert (d.verdict, d.severity) == ("stuck_bottom", "warn")
    assert "completions/clipped_ratio" in d.advice


def test_saturation_regression():
    assert verdict("regression", "saturation") == ("regression", "warn")


# ==== duplicates ======================================================================================
def test_duplicates_short_correct_answers_are_not_called_non_random():
    # 6-token answers, 72% duplicates (G=4: ceiling 75%) from the first step, inside the solved groups:
    # "Sampling is no longer random" before issue 22.
    d = diagnosed("tiny_arithmetic_solved")["duplicates"]
    assert d.verdict == "short_answers" and d.severity == "ok"
    assert d.evidence["completions/mean_length"] < 10
    assert (
        d.evidence["completions/duplicate_frac:recent"]
        > 0.6 * d.evidence["completions/duplicate_frac:ceiling"]
    )


def test_duplicates_as_recorded_are_short_answers_not_unclear():
    d = diagnosed("tiny_arithmetic")["duplicates"]
    assert d.verdict == "short_answers"


def test_duplicates_a_jump_to_the_ceiling_is_non_random_even_with_short_answers():
    found = diagnosed("tiny_arithmetic_temperature_0")
    d = found["duplicates"]
    assert (d.verdict, d.severity) == ("not_random", "warn")
    assert d.evidence["completions/duplicate_frac:jump"] > 0.3
    # every group dropped: the saturation card points at the copies instead of the reward
    assert found["saturation"].verdict == "all_dropped"
    assert "copies of one rollout" in found["saturation"].advice


def test_duplicates_healthy():
    assert verdict("duplicates_healthy", "duplicates") == ("healthy", "ok")


def test_duplicates_collapse():
    d = diagnosed("collapse")["duplicates"]
    assert (d.verdict, d.severity) == ("collapse", "warn")
    assert d.evidence["entropy:change_rel"] < -0.1


# ==== clipping ========================================================================================
def test_clipping_ok_as_recorded_and_truncated():
    assert diagnosed("tiny_arithmetic")["clipping"].verdict == "ok"
    d = diagnosed("truncated")["clipping"]
    assert (d.verdict, d.severity) == ("truncated", "warn")
    assert "33%" in d.title


# ==== words ===========================================================================================
def test_evidence_reads_in_the_specs_names_and_plain_words():
    assert evidence_label("reward_range:lo") == "lowest reward (the reward range)"
    assert evidence_label("perf/rollout_wait_s") == "perf/rollout_wait_s"  # the spec's metric name
    assert evidence_label("perf/rollout_wait_s:step_frac").startswith("perf/rollout_wait_s as a share")
    assert evidence_label("config/max_staleness") == "max_staleness (config)"
    for name in WINDOWS:
        for d in diagnosed(name).values():
            for key, label in evidence_labels(d.evidence).items():
                assert not re.search(r"\w:\w", label), (key, label)  # no internal name:derived key
