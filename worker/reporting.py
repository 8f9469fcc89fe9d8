"""The TrainerCallback the supervisor installs in the trainer process (``--callback``).

It reads ``GRPO_RUN_ID`` (and ``DATABASE_URL`` / ``REDIS_URL`` through Django's settings), sets up
Django in the trainer process and, on the main process only, writes through the control plane's
services: one ``bulk_create`` of metrics per logging step (``on_log``), one of sampled completions
(``on_completions``, the trainer's custom event when ``log_completions=True``), and a checkpoint
row per save (``on_save``). Each is also published to the run's channel-layer group.

A database hiccup must not kill training: failed writes stay pending (bounded) and are retried at
the next event; ``metrics.jsonl`` / ``completions.jsonl`` in the output directory keep everything.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

MAX_PENDING = 1000
MAX_ATTEMPTS = 5  # events on which one write is retried before it is dropped (the .jsonl files keep it)


def _setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()


class ControlPlaneCallback(TrainerCallback):
    """Reports one run's metrics, completions and checkpoints to Postgres + the channel layer."""

    def __init__(self, run_id: int | None = None) -> None:
        self.run_id = int(run_id if run_id is not None else os.environ["GRPO_RUN_ID"])
        _setup_django()
        # (kind, step, payload) waiting to be written, oldest first
        self._pending: deque[tuple[str, int, Any]] = deque(maxlen=MAX_PENDING)
        self._failures = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self._pending.append(("metrics", int(state.global_step), dict(logs)))
            self._flush()

    def on_completions(self, args, state, control, completions=None, **kwargs):
        if state.is_world_process_zero and completions:
            self._pending.append(("completions", int(state.global_step), list(completions)))
            self._flush()

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self._pending.append(("checkpoint", int(state.global_step), str(path)))
            self._flush()

    def on_train_end(self, args, state, control, **kwargs):
        self._flush()

    def _flush(self) -> None:
        from django.db import close_old_connections

        from controlplane.runs import services

        while self._pending:
            kind, step, payload = self._pending[0]
            try:
                if kind == "metrics":
                    services.metric_points_ingest(run_id=self.run_id, step=step, values=payload)
                elif kind == "completions":
                    services.completion_samples_ingest(run_id=self.run_id, step=step, items=payload)
                else:
                    services.checkpoint_record(run_id=self.run_id, step=step, path=payload)
            except Exception:
                close_old_connections()  # a broken connection is replaced on the next attempt
                self._failures += 1
                if self._failures < MAX_ATTEMPTS:
                    logger.warning(
                        "control plane: could not store %s of step %s (will retry)", kind, step, exc_info=True
                    )
                    return
                # Persistently refused (not a passing outage): drop it so later steps still get through.
                logger.error(
                    "control plane: dropping %s of step %s after %d attempts", kind, step, self._failures
                )
            self._failures = 0
            self._pending.popleft()
