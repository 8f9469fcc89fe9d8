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
