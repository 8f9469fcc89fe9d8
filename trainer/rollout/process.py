"""Start the rollout loop in a spawned process and watch it from the trainer.

The child runs with ``CUDA_VISIBLE_DEVICES=""`` (the rollout process never uses a GPU; spec). It
talks to the trainer only through the objects :func:`start_rollout_process` creates:

* ``rollout_buffer``: :class:`~trainer.rollout.types.GroupResult` per dispatched or filtered prompt;
* ``metrics_queue``: ``{"metrics": MetricWindow.state(), "completions": [...]}`` every 0.5 s;
* ``model_version_value`` (``'i'``): the trainer increments it after each weight sync;
* ``token_allowance`` (``'d'``): the cumulative token ceiling (see ``flow.StalenessGate``);
* ``heartbeat_value`` (``'d'``): ``time.time()`` refreshed by the child every 0.25 s;
* ``oldest_pinned_version`` (``'i'``): the oldest policy version an in-flight rollout is pinned to
  (LoRA adapter serving: the trainer keeps that adapter's files until no rollout needs them);
* ``failed_event`` + ``exception_info_queue``: the child's exception and traceback;
* ``stop_event``: asks the child to stop.

:class:`RolloutWorkerHandle` turns a dead, failed or hung child into a ``RuntimeError`` that names
the rollout process and carries the child's traceback, instead of an unexplained queue timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from trainer.rollout.scoring import check_picklable
from trainer.rollout.types import GroupResult
from trainer.spawn_startup import STARTUP_ERROR_ENV, mark_started, startup_failure

__all__ = ["RolloutWorkerHandle", "start_rollout_process", "check_rollout_picklable"]

_PASSED_BY_HANDLE = (
    "rollout_buffer",
    "model_version_value",
    "token_allowance",
    "heartbeat_value",
    "failed_event",
    "exception_info_queue",
    "metrics_queue",
)


def check_rollout_picklable(
    loop_cls: type,
    reward_funcs: list[Callable] | None = None,
    tools: list[Callable] | None = None,
    environment_factory: Callable | dict[str, Callable] | None = None,
) -> None:
    """Raise ``TypeError`` for anything that cannot be pickled into the rollout process."""
    check_picklable(loop_cls, "loop_cls")
    for func in reward_funcs or []:
        check_picklable(func, "reward function")
    for tool in tools or []:
        check_picklable(tool, "tool")
    if isinstance(environment_factory, dict):
        for name, factory in environment_factory.items():
            check_picklable(factory, f"environment_factory[{name!r}]")
    elif environment_factory is not None:
        check_picklable(environment_factory, "environment_factory")


def _close_parent_write_end(q: Any) -> None:
    """Close the trainer's copy of a child->trainer queue's write end (the trainer never puts).

    A ``multiprocessing.Queue`` keeps both pipe ends in the process that created it. If the child
    dies halfway through writing a message (SIGKILL, OOM), a reader waits for the rest forever: no
    EOF can come while the trainer itself still holds a write end. With it closed, the read fails
    with ``EOFError`` instead and the handle reports the dead worker. (``_writer`` is the Queue's
    pipe end; there is no public API for this.)
    """
    writer = getattr(q, "_writer", None)
    if writer is not None:
        writer.close()


def _rollout_main(loop_cls: type, kwargs: dict[str, Any], stop_event: Any, pinned_value: Any = None) -> None:
    """Child entry point: build the loop and run it until stopped."""
    mark_started()  # from here on the loop reports its own errors (exception_info_queue)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Ctrl-C reaches the whole process group; the trainer decides when the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        loop = loop_cls(**kwargs)
    except BaseException as exc:
        kwargs["exception_info_queue"].put(
            {
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": "".join(traceback.format_exception(exc)),
                "pid": os.getpid(),
            }
        )
        kwargs["failed_event"].set()
        raise
    loop.stop_event = stop_event
    loop.pins.oldest_pinned_version = pinned_value
    loop.run()


class RolloutWorkerHandle:
    """The trainer's side of the rollout process.

    Attributes:
        process: the ``multiprocessing`` process.
        model_version_value, token_allowance, heartbeat_value: the shared values (see module doc).
        timeout: ``rollout_worker_timeout`` (seconds without heartbeat before the worker counts as hung).
    """

    def __init__(
        self,
        process: Any,
        *,
        rollout_buffer: Any,
        metrics_queue: Any,
        exception_info_queue: Any,
        model_version_value: Any,
        token_allowance: Any,
        heartbeat_value: Any,
        failed_event: Any,
        stop_event: Any,
        timeout: float,
        oldest_pinned_version: Any = None,
        startup_error_path: str | None = None,
    ) -> None:
        self.process = process
        self.startup_error_path = startup_error_path
        self.rollout_buffer = rollout_buffer
        self.metrics_queue = metrics_queue
        self.exception_info_queue = exception_info_queue
        self.model_version_value = model_version_value
        self.token_allowance = token_allowance
        self.heartbeat_value = heartbeat_value
        self.failed_event = failed_event
        self.stop_event = stop_event
        self.timeout = timeout
        self._oldest_pinned = oldest_pinned_version
        self._stopped = False
        self._failure: str | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    # --- trainer -> worker -----------------------------------------------------------------------
    def set_token_allowance(self, tokens: float) -> None:
        """Set the cumulative token ceiling (raw tokens consumed so far + allowed lead)."""
        self.token_allowance.value = float(tokens)

    def set_model_version(self, version: int) -> None:
        """Publish the policy version now served (after a weight sync)."""
        self.model_version_value.value = int(version)

    # --- worker -> trainer -----------------------------------------------------------------------
    def oldest_pinned_version(self) -> int | None:
        """The oldest policy version an in-flight rollout still generates with (None: not tracked)."""
        return None if self._oldest_pinned is None else int(self._oldest_pinned.value)

    def check_health(self) -> None:
        """Raise ``RuntimeError`` naming the rollout process if it failed, died or stopped beating."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self.failed_event.is_set():
            try:
                info = self.exception_info_queue.get(timeout=5.0)
                detail = f"{info['type']}: {info['message']}\n\nTraceback in the rollout process:\n{info['traceback']}"
            except (queue.Empty, EOFError, OSError):
                detail = "(no traceback was received)"
            self._failure = f"rollout process (pid {self.pid}) failed: {detail}"
            raise RuntimeError(self._failure)
        if not self.process.is_alive():
            code = self.process.exitcode
            how = f"exit code {code}"
            if code is not None and code < 0:
                with contextlib.suppress(ValueError):
                    how += f", killed by {signal.Signals(-code).name}"
            startup = startup_failure(self.startup_error_path)
            if startup is not None:
                self._failure = f"rollout process (pid {self.pid}) died at start-up ({how}): {startup}"
                raise RuntimeError(self._failure)
            state = "was stopped" if self._stopped else "died unexpectedly"
            self._failure = f"rollout process (pid {self.pid}) {state} ({how}) without reporting an error"
            raise RuntimeError(self._failure)
        age = time.time() - self.heartbeat_value.value
        if age > self.timeout:
            self._failure = (
                f"rollout process (pid {self.pid}) is hung: no heartbeat for {age:.0f} s "
                f"(rollout_worker_timeout={self.timeout:g} s)"
            )
            raise RuntimeError(self._failure)

    def get(self, timeout: float | None = None) -> GroupResult | None:
        """The next :class:`GroupResult`; None after ``timeout`` seconds (None = wait forever).

        Checks the worker's health at least every 0.5 s while waiting and raises ``RuntimeError``
        (with the child's traceback) when it failed, died or hung.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check_health()
            wait = 0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic()))
            try:
                return self.rollout_buffer.get(timeout=wait) if wait > 0 else self.rollout_buffer.get_nowait()
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
            except (EOFError, OSError):  # the child died mid-message: let check_health name it
                self.process.join(1.0)
                self.check_health()
                raise

    def drain_metrics(self) -> list[dict[str, Any]]:
        """Every metrics payload the worker sent since the last call (oldest first)."""
        payloads = []
        while True:
            try:
                payloads.append(self.metrics_queue.get_nowait())
            except (queue.Empty, EOFError, OSError):
                return payloads

    # --- shutdown --------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the worker: ask, wait ``grace_s``, then SIGTERM, then SIGKILL. Idempotent."""
        atexit.unregister(self.stop)
        self._stopped = True
        self.stop_event.set()
        deadline = time.monotonic() + grace_s
        while self.process.is_alive() and time.monotonic() < deadline:
            self._discard_queued()  # a child blocked on a full pipe could not exit
            self.process.join(0.1)
        for action in (self.process.terminate, self.process.kill):
            if not self.process.is_alive():
                break
            action()
            self.process.join(5.0)
        self._discard_queued()
        if self.startup_error_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.startup_error_path)

    def _discard_queued(self, limit: int = 10_000) -> None:
        for q in (self.rollout_buffer, self.metrics_queue):
            with contextlib.suppress(queue.Empty, OSError, ValueError, EOFError):
                for _ in range(limit):  # bounded: a live producer may refill it
                    q.get_nowait()


def start_rollout_process(
    loop_cls: type,
    *,
    initial_token_allowance: float = 0.0,
    initial_model_version: int = 0,
    **loop_kwargs: Any,
) -> RolloutWorkerHandle:
    """Spawn the rollout process running ``loop_cls(**loop_kwargs, <queues and values>)``.

    ``loop_kwargs`` are :class:`~trainer.rollout.loop.AsyncRolloutLoop` constructor arguments except
    the queues, values and events, which are created here and exposed on the handle. Reward
    functions, tools, environment factories and ``loop_cls`` are checked for picklability first
    (``TypeError`` naming the callable and the fix).
    """
    clash = [k for k in _PASSED_BY_HANDLE if k in loop_kwargs]
    if clash:
        raise TypeError(f"start_rollout_process creates {', '.join(clash)} itself; do not pass them")
    check_rollout_picklable(
        loop_cls,
        loop_kwargs.get("reward_funcs"),
        loop_kwargs.get("tools"),
        loop_kwargs.get("environment_factory"),
    )
    ctx = mp.get_context("spawn")
    shared = {
        "rollout_buffer": ctx.Queue(),
        "model_version_value": ctx.Value("i", int(initial_model_version)),
        "token_allowance": ctx.Value("d", float(initial_token_allowance)),
        "heartbeat_value": ctx.Value("d", time.time()),
        "failed_event": ctx.Event(),
        "exception_info_queue": ctx.Queue(),
        "metrics_queue": ctx.Queue(),
    }
    stop_event = ctx.Event()
    pinned_value = ctx.Value("i", int(initial_model_version))
    process = ctx.Process(
        target=_rollout_main,
        args=(loop_cls, {**loop_kwargs, **shared}, stop_event, pinned_value),
        name="rollout-worker",
    )
    # The spawned interpreter inherits the environment at start: hide every GPU from it, and name
    # the file where it writes an error of its start-up phase (trainer/spawn_startup.py).
    fd, startup_error_path = tempfile.mkstemp(prefix="grpo-rollout-startup-", suffix=".txt")
    os.close(fd)
    child_env = {"CUDA_VISIBLE_DEVICES": "", STARTUP_ERROR_ENV: startup_error_path}
    previous = {name: os.environ.get(name) for name in child_env}
    os.environ.update(child_env)
    try:
        process.start()
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    for name in ("rollout_buffer", "metrics_queue", "exception_info_queue"):
        _close_parent_write_end(shared[name])
    config = loop_kwargs.get("config")
    handle = RolloutWorkerHandle(
        process,
        rollout_buffer=shared["rollout_buffer"],
        metrics_queue=shared["metrics_queue"],
        exception_info_queue=shared["exception_info_queue"],
        model_version_value=shared["model_version_value"],
        token_allowance=shared["token_allowance"],
        heartbeat_value=shared["heartbeat_value"],
        failed_event=shared["failed_event"],
        stop_event=stop_event,
        timeout=float(getattr(config, "rollout_worker_timeout", 300.0)),
        oldest_pinned_version=pinned_value,
        startup_error_path=startup_error_path,
    )
    atexit.register(handle.stop)  # never leave an orphan behind a trainer that forgot stop()
    return handle
