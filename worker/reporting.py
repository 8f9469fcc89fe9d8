"""The TrainerCallback the supervisor installs in the trainer process (``--callback``).

It reads ``GRPO_RUN_ID`` (and ``DATABASE_URL`` / ``REDIS_URL`` through Django's settings), sets up
Django in the trainer process and, on the main process only, writes through the control plane's
services: metrics of each logging step (``on_log``), sampled completions (``on_completions``, the
trainer's custom event when ``log_completions=True``), and a checkpoint row per save (``on_save``).
Each is also published to the run's channel-layer group. Writes are batched (at most one per
~250 ms, consecutive metric steps in one statement) by a flusher thread, so a fast run does not
flood Postgres or the channel layer.

A database hiccup must not kill training: failed writes stay pending (bounded) and are retried with
backoff; ``metrics.jsonl`` / ``completions.jsonl`` in the output directory keep everything.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

MAX_PENDING = 1000
MAX_ATTEMPTS = 5  # attempts at one write before it is dropped (the .jsonl files keep it)
DEFAULT_BATCH_S = 0.25


def _setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()


class ControlPlaneCallback(TrainerCallback):
    """Reports one run's metrics, completions and checkpoints to Postgres + the channel layer.

    Events are queued in order and written by a flusher thread at most once per ``batch_s``
    (``GRPO_REPORT_BATCH_S``, default 0.25 s): a run logging 50 steps a second costs 4 database
    statements and 4 channel-layer messages a second, not 50. ``batch_s=0`` writes inline, on the
    event itself. A refused write is retried with backoff (1, 2, 4, ... s), then dropped.
    """

    def __init__(self, run_id: int | None = None, *, batch_s: float | None = None) -> None:
        self.run_id = int(run_id if run_id is not None else os.environ["GRPO_RUN_ID"])
        if batch_s is None:
            batch_s = float(os.environ.get("GRPO_REPORT_BATCH_S", DEFAULT_BATCH_S))
        self.batch_s = batch_s
        _setup_django()
        # (kind, step, payload) waiting to be written, oldest first
        self._pending: deque[tuple[str, int, Any]] = deque(maxlen=MAX_PENDING)
        self._failures = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._thread: threading.Thread | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self._enqueue("metrics", int(state.global_step), dict(logs))

    def on_completions(self, args, state, control, completions=None, **kwargs):
        if state.is_world_process_zero and completions:
            self._enqueue("completions", int(state.global_step), list(completions))

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self._enqueue("checkpoint", int(state.global_step), str(path))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is pending (the flusher thread drains, then stops)."""
        with self._lock:
            self._closing = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        with self._lock:
            self._flush()

    # ---- queue -----------------------------------------------------------------------------------
    def _enqueue(self, kind: str, step: int, payload: Any) -> None:
        with self._lock:
            self._pending.append((kind, step, payload))
            if self.batch_s <= 0:
                self._flush()
                return
            if self._thread is None or not self._thread.is_alive():
                self._closing = False
                self._thread = threading.Thread(
                    target=self._flush_forever, name="control-plane-report", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _flush_forever(self) -> None:
        """The flusher thread: wait for events, let a batch gather for ``batch_s``, write it."""
        from django.db import connection

        try:
            while True:
                with self._lock:
                    while not self._pending and not self._closing:
                        self._wake.wait()
                    if not self._pending:
                        return
                    # Let a batch gather (new events do not cut the wait short; close() does); a
                    # refused write backs off (1, 2, 4, ... s).
                    delay = self.batch_s if not self._failures else min(2.0 ** (self._failures - 1), 30.0)
                    deadline = time.monotonic() + delay
                    while not self._closing and (left := deadline - time.monotonic()) > 0:
                        self._wake.wait(left)
                    self._flush()
                    if self._closing and self._failures:
                        return  # close() makes one last attempt; do not spin on a dead database
        finally:
            connection.close()  # this thread's connection

    def _flush(self) -> None:
        """Write pending events in order (caller holds the lock); consecutive metrics go together."""
        from django.db import close_old_connections

        from controlplane.runs import ingest

        while self._pending:
            kind, step, payload = self._pending[0]
            count = 1
            try:
                if kind == "metrics":
                    # After a refusal, one step at a time: a bad step must not take good ones with it.
                    batch = self._leading_metrics() if not self._failures else [(step, payload)]
                    count = len(batch)
                    ingest.metric_steps_ingest(run_id=self.run_id, steps=batch)
                elif kind == "completions":
                    ingest.completion_samples_ingest(run_id=self.run_id, step=step, items=payload)
                else:
                    ingest.checkpoint_record(run_id=self.run_id, step=step, path=payload)
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
                count = 1
            self._failures = 0
            for _ in range(count):
                self._pending.popleft()

    def _leading_metrics(self) -> list[tuple[int, Any]]:
        """The run of consecutive ``metrics`` events at the head of the queue, as (step, values)."""
        batch = []
        for kind, step, payload in self._pending:
            if kind != "metrics":
                break
            batch.append((step, payload))
        return batch
