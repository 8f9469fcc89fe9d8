"""Rollout loops used by tests; module-level so the spawned rollout process can import them."""

from __future__ import annotations

import json
import os

from trainer import AsyncGRPOTrainer, AsyncRolloutLoop


class RecordingRolloutLoop(AsyncRolloutLoop):
    """Appends each prompt the loop considers (epoch, row_index) to ``$GRPO_TEST_PROMPT_LOG``."""

    def filter_prompt(self, row_index, row, epoch):
        path = os.environ.get("GRPO_TEST_PROMPT_LOG")
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps({"epoch": epoch, "row_index": row_index}) + "\n")
        return super().filter_prompt(row_index, row, epoch)


class RecordingTrainer(AsyncGRPOTrainer):
    loop_cls = RecordingRolloutLoop


_REWARD_CALLS = [0]
CONSTANT_GROUPS = 48


def constant_then_varying_reward(completions, **kwargs):
    """The first ``CONSTANT_GROUPS`` groups (calls, in this rollout process) all get 0.5: dropped for
    identical rewards; later groups get 0/1 alternately, so a step can train."""
    _REWARD_CALLS[0] += 1
    if _REWARD_CALLS[0] <= CONSTANT_GROUPS:
        return [0.5] * len(completions)
    return [float(i % 2) for i in range(len(completions))]


VARYING_GROUPS = 2


def varying_then_constant_reward(completions, **kwargs):
    """The first ``VARYING_GROUPS`` groups (calls, in this rollout process) get 0/1 alternately (kept:
    one step of two groups at 16 samples a row); every later group gets 0.5 (dropped)."""
    _REWARD_CALLS[0] += 1
    if _REWARD_CALLS[0] <= VARYING_GROUPS:
        return [float(i % 2) for i in range(len(completions))]
    return [0.5] * len(completions)
