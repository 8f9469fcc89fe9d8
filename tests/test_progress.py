"""The trainer's progress bar says when steps slow because groups are dropped (issue 34 item 4), by
the run page's rule: the last ten logged step times against the first ten."""

from __future__ import annotations

from types import SimpleNamespace

from trainer.reporting.progress import RunProgressCallback, slowing_note


def test_slowing_is_said_only_when_steps_slowed_and_most_groups_were_dropped():
    early, late = [1.0] * 10, [4.0] * 10
    assert slowing_note(early + late, [0.2] * 10 + [0.8] * 10) == "4x, 80% dropped"
    assert slowing_note(early + late, [0.2] * 20) is None  # slower for another reason
    assert slowing_note(early + [1.2] * 10, [0.9] * 20) is None  # not slower
    assert slowing_note(early, [0.9] * 10) is None  # too few steps to compare


def test_the_bar_postfix_carries_the_note_and_keeps_only_the_windows():
    callback = RunProgressCallback()
    shown = {}
    callback.bar = SimpleNamespace(set_postfix=lambda postfix, refresh: shown.update(postfix))
    args = SimpleNamespace(max_steps=100)
    for step in range(1, 41):
        logs = {"perf/step_s": 1.0 if step <= 10 else 3.0, "frac_reward_zero_std": 0.1 if step <= 10 else 0.7}
        callback.on_log(args, None, None, logs=logs)
    assert shown["slowing"] == "3x, 70% dropped"
    assert len(callback.step_s) == 20 and callback.step_s[:10] == [1.0] * 10
