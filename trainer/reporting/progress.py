"""A terminal progress bar for training runs: steps, reward and tokens/s instead of raw log dicts."""

from __future__ import annotations

from tqdm.auto import tqdm
from transformers import TrainerCallback

from trainer.reporting.metrics import (
    EPOCH,
    FRAC_REWARD_ZERO_STD,
    LOSS,
    PERF_STEP_S,
    PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S,
    REWARD,
)

POSTFIX = ((REWARD, "reward"), (PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S, "tok/s"), (LOSS, "loss"))
# The run page's rule too (static/runs/dashboard.js): the last WINDOW logged step times against the
# first WINDOW; SLOWING_RATIO times slower with at least SLOWING_DROPPED_FRAC of groups dropped is
# "slowing" for dropped groups.
WINDOW = 10
SLOWING_RATIO = 1.5
SLOWING_DROPPED_FRAC = 0.5


def slowing_note(step_s: list[float], dropped_frac: list[float]) -> str | None:
    """``"4x, 80% dropped"`` when the last ``WINDOW`` step times are ``SLOWING_RATIO`` times the first
    ``WINDOW``'s and at least ``SLOWING_DROPPED_FRAC`` of the recent groups were dropped; else None."""
    if len(step_s) < 2 * WINDOW or not dropped_frac:
        return None
    first = sum(step_s[:WINDOW]) / WINDOW
    recent = sum(step_s[-WINDOW:]) / WINDOW
    dropped = sum(dropped_frac[-WINDOW:]) / len(dropped_frac[-WINDOW:])
    if first <= 0 or recent <= SLOWING_RATIO * first or dropped < SLOWING_DROPPED_FRAC:
        return None
    return f"{recent / first:.2g}x, {dropped:.0%} dropped"


class RunProgressCallback(TrainerCallback):
    """One bar per run (total = max_steps when set), updated per step; the last log in the postfix.
    tqdm's remaining time follows the recent rate (its exponential smoothing); the postfix says
    ``slowing`` when steps slowed while most groups were dropped (:func:`slowing_note`)."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.last_step = 0
        self.step_s: list[float] = []
        self.dropped_frac: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            total = args.max_steps if args.max_steps > 0 else None
            self.bar = tqdm(
                total=total, initial=state.global_step, desc="train", unit="step", dynamic_ncols=True
            )
            self.last_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.last_step)
            self.last_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is None or not logs:
            return
        postfix = {}
        for key, label in POSTFIX:
            value = logs.get(key)
            if isinstance(value, int | float):
                postfix[label] = f"{value:.4g}"
        if EPOCH in logs and args.max_steps <= 0:
            postfix["epoch"] = f"{logs[EPOCH]:.2f}"
        for key, seen in ((PERF_STEP_S, self.step_s), (FRAC_REWARD_ZERO_STD, self.dropped_frac)):
            if isinstance(logs.get(key), int | float):
                seen.append(float(logs[key]))
                del seen[WINDOW:-WINDOW]  # only the first and the last WINDOW are read
        note = slowing_note(self.step_s, self.dropped_frac)
        if note:
            postfix["slowing"] = note
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
