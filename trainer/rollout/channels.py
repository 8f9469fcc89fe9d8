"""``RolloutChannels``: every object the trainer and the rollout process share, in one value.

Created once, by :meth:`RolloutChannels.create` (``process.py``, before the spawn); the spawned
loop, the trainer's :class:`~trainer.rollout.process.RolloutWorkerHandle` and tests that run the
loop in a thread (queues/events of ``queue``/``threading`` then) all take it whole.

* ``rollout_buffer``: :class:`~trainer.rollout.types.GroupResult` per dispatched or filtered prompt;
* ``metrics_queue``: ``{"metrics": MetricWindow.state(), "completions": [...]}`` every 0.5 s (a kept
  group takes the window recorded up to it along, in ``GroupResult.metrics``);
* ``model_version_value`` (``'i'``): the trainer increments it after each weight sync;
* ``token_allowance`` (``'d'``): the cumulative raw-token ceiling (see ``flow.StalenessGate``);
* ``heartbeat_value`` (``'d'``): ``time.time()`` refreshed by the child every 0.25 s;
* ``failed_event`` + ``exception_info_queue``: the child's exception and traceback;
* ``stop_event``: asks the child to stop;
* ``oldest_pinned_version`` (``'i'``): the oldest policy version an in-flight rollout is pinned to
  (LoRA adapter serving: the trainer keeps that adapter's files until no rollout needs them);
* ``settled_tokens`` (``'d'``): the raw tokens of every group emitted so far while no group is in
  flight, -1 while one is: with the allowance, it tells the trainer the rollout side is held
  (nothing more comes until the trainer consumes), so a part-filled micro-batch can be trained
  at a point fixed by counts, not by a timer (``trainer.step.feed``);
* ``eval_requests``: trainer -> child, one :class:`~trainer.rollout.evaluation.EvalRequest` per eval
  pass asked for; its result comes back on ``metrics_queue`` as ``{"eval": EvalResult}``.

The first seven keep the names of the spec's ``AsyncRolloutLoop`` constructor arguments.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["RolloutChannels"]


class SharedValue(Protocol):
    """A ``multiprocessing.Value`` (or anything with a read/write ``value``)."""

    value: Any


class Signal(Protocol):
    """A ``multiprocessing.Event`` or ``threading.Event``."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...


class Channel(Protocol):
    """A ``multiprocessing.Queue`` or ``queue.Queue``."""

    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...

    def get_nowait(self) -> Any: ...


@dataclass(frozen=True)
class RolloutChannels:
    """The trainer <-> rollout process boundary (see the module docstring for each field)."""

    rollout_buffer: Channel
    metrics_queue: Channel
    exception_info_queue: Channel
    model_version_value: SharedValue
    token_allowance: SharedValue
    heartbeat_value: SharedValue
    failed_event: Signal
    stop_event: Signal | None = None
    oldest_pinned_version: SharedValue | None = None
    settled_tokens: SharedValue | None = None
    eval_requests: Channel | None = None

    @classmethod
    def create(
        cls, ctx: Any, *, initial_model_version: int = 0, initial_token_allowance: float = 0.0
    ) -> RolloutChannels:
        """Fresh channels from a ``multiprocessing`` context (``mp.get_context("spawn")``).

        ``initial_token_allowance``: raw tokens the rollout process may generate before the trainer
        publishes a ceiling; ``initial_model_version``: the policy version the server serves now.
        """
        return cls(
            rollout_buffer=ctx.Queue(),
            metrics_queue=ctx.Queue(),
            exception_info_queue=ctx.Queue(),
            model_version_value=ctx.Value("i", int(initial_model_version)),
            token_allowance=ctx.Value("d", float(initial_token_allowance)),
            heartbeat_value=ctx.Value("d", time.time()),
            failed_event=ctx.Event(),
            stop_event=ctx.Event(),
            oldest_pinned_version=ctx.Value("i", int(initial_model_version)),
            settled_tokens=ctx.Value("d", 0.0),
            eval_requests=ctx.Queue(),
        )

    def report_failure(self, exc: BaseException) -> None:
        """Send ``exc`` with its traceback to the trainer and raise ``failed_event`` (child side)."""
        info = {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
            "pid": os.getpid(),
        }
        try:
            self.exception_info_queue.put(info)
        finally:
            self.failed_event.set()

    def close_parent_write_ends(self) -> None:
        """Close the trainer's copies of the child->trainer queues' write ends (the trainer never puts).

        A ``multiprocessing.Queue`` keeps both pipe ends in the process that created it. If the child
        dies halfway through writing a message (SIGKILL, OOM), a reader waits for the rest forever: no
        EOF can come while the trainer itself still holds a write end. With it closed, the read fails
        with ``EOFError`` instead and the handle reports the dead worker. (``_writer`` is the Queue's
        pipe end; there is no public API for this.)
        """
        for q in (self.rollout_buffer, self.metrics_queue, self.exception_info_queue):
            writer = getattr(q, "_writer", None)
            if writer is not None:
                writer.close()

    def cancel_join_threads(self) -> None:
        """Child side, at exit: unread queue data must not keep the process alive."""
        for q in (self.rollout_buffer, self.metrics_queue):
            cancel = getattr(q, "cancel_join_thread", None)
            if cancel is not None:
                cancel()
