"""A terminal progress bar for training runs: steps, reward and tokens/s instead of raw log dicts."""

from __future__ import annotations

from tqdm.auto import tqdm
from transformers import TrainerCallback

from trainer.metrics import EPOCH, LOSS, PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S, REWARD

POSTFIX = ((REWARD, "reward"), (PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S, "tok/s"), (LOSS, "loss"))


class RunProgressCallback(TrainerCallback):
    """One bar per run (total = max_steps when set), updated per step; the last log in the postfix."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.last_step = 0

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
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
