"""Start the rollout loop in a spawned process and watch it from the trainer.

The child runs with ``CUDA_VISIBLE_DEVICES=""`` (the rollout process never uses a GPU; spec). It
talks to the trainer only through the :class:`~trainer.rollout.channels.RolloutChannels`
:func:`start_rollout_process` creates (queues, shared values, events; see that module).

:class:`RolloutWorkerHandle` turns a dead, failed or hung child into a ``RuntimeError`` that names
the rollout process and carries the child's traceback, instead of an unexplained queue timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from trainer.processes.spawn_startup import STARTUP_ERROR_ENV, mark_started, startup_failure
from trainer.rollout.channels import RolloutChannels
from trainer.rollout.scoring import check_picklable
from trainer.rollout.types import GroupResult

__all__ = [
    "RolloutWorkerHandle",
    "check_rollout_importable",
    "check_rollout_picklable",
    "start_rollout_process",
]

# start_rollout_process creates these itself (the loop receives them as one RolloutChannels).
_CREATED_HERE = ("channels", *(f.name for f in fields(RolloutChannels)))


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


def _main_path_spawn_cannot_run() -> str | None:
    """The parent's ``__main__.__file__`` when it names no file (``<stdin>``: a script fed on standard
    input), which spawn would try to re-run in the child and fail on; None otherwise."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path if path is not None and not os.path.exists(path) else None


def _defined_in_main(obj: Any) -> bool:
    """Whether ``obj`` (a function, class, partial or callable instance) comes from ``__main__``."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    return "__main__" in (getattr(obj, "__module__", None), getattr(type(obj), "__module__", None))


def check_rollout_importable(loop_cls: type, **loop_kwargs: Any) -> None:
    """Raise ``RuntimeError`` naming the fix when the spawned child could not import what it is sent:
    callables defined in a script read from standard input (its ``__main__`` is no file to re-import).
    A stdin script whose callables all live in modules is fine (``start_rollout_process`` then spawns
    without re-running it)."""
    path = _main_path_spawn_cannot_run()
    if path is None:
        return
    factories = loop_kwargs.get("environment_factory")
    candidates = [
        loop_cls,
        *(loop_kwargs.get("reward_funcs") or []),
        *(loop_kwargs.get("tools") or []),
        *(factories.values() if isinstance(factories, dict) else [factories] if factories else []),
    ]
    names = [getattr(c, "__name__", type(c).__name__) for c in candidates if _defined_in_main(c)]
    if names:
        raise RuntimeError(
            f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} defined in a script read from {path!r}, "
            "which the spawned rollout process cannot import: save the script to a file and run it as "
            '`python FILE.py`, with the training code under `if __name__ == "__main__":`'
        )


@contextlib.contextmanager
def _main_path_hidden():
    """Spawn without re-running a ``__main__`` that is no file (see ``check_rollout_importable``)."""
    main = sys.modules.get("__main__")
    path = _main_path_spawn_cannot_run()
    if path is None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _rollout_main(loop_cls: type, loop_kwargs: dict[str, Any], channels: RolloutChannels) -> None:
    """Child entry point: build the loop and run it until stopped."""
    mark_started()  # from here on the loop reports its own errors (exception_info_queue)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Ctrl-C reaches the whole process group; the trainer decides when the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        loop = loop_cls(**loop_kwargs, channels=channels)
    except BaseException as exc:
        channels.report_failure(exc)
        raise
    loop.run()


class RolloutWorkerHandle:
    """The trainer's side of the rollout process.

    Attributes:
        process: the ``multiprocessing`` process.
        channels: what the trainer and the child share (:class:`RolloutChannels`).
        timeout: ``rollout_worker_timeout`` (seconds without heartbeat before the worker counts as hung).
        startup_error_path: the file the child writes an error of its start-up phase to (or None).
    """

    def __init__(
        self,
        process: Any,
        channels: RolloutChannels,
        *,
        timeout: float,
        startup_error_path: str | None = None,
    ) -> None:
        self.process = process
        self.channels = channels
        self.timeout = timeout
        self.startup_error_path = startup_error_path
        self._stopped = False
        self._carried: list[dict[str, Any]] = []  # windows that came with kept groups, not yet drained
        self._failure: str | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    # --- trainer -> worker -----------------------------------------------------------------------
    def set_token_allowance(self, tokens: float) -> None:
        """Set the cumulative token ceiling (raw tokens consumed so far + allowed lead)."""
        self.channels.token_allowance.value = float(tokens)

    def set_model_version(self, version: int) -> None:
        """Publish the policy version now served (after a weight sync)."""
        self.channels.model_version_value.value = int(version)

    def request_eval(self, request: Any) -> None:
        """Ask for one eval pass (:class:`~trainer.rollout.evaluation.EvalRequest`); its result comes
        back through :meth:`drain_metrics` as ``{"eval": EvalResult}``."""
        if self.channels.eval_requests is None:
            raise RuntimeError("these rollout channels carry no eval requests")
        self.channels.eval_requests.put(request)

    # --- worker -> trainer -----------------------------------------------------------------------
    def settled_tokens(self) -> float:
        """Raw tokens emitted so far if no group is in flight, else -1 (``RolloutChannels``)."""
        settled = self.channels.settled_tokens
        return -1.0 if settled is None else float(settled.value)

    def oldest_pinned_version(self) -> int | None:
        """The oldest policy version an in-flight rollout still generates with (None: not tracked)."""
        pinned = self.channels.oldest_pinned_version
        return None if pinned is None else int(pinned.value)

    def check_health(self) -> None:
        """Raise ``RuntimeError`` naming the rollout process if it failed, died or stopped beating."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self.channels.failed_event.is_set():
            try:
                info = self.channels.exception_info_queue.get(timeout=5.0)
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
            if not self._stopped:
                self._failure += (
                    "; its output above says why. A common cause: the spawned process could not import "
                    "the training script (read from standard input or a notebook): run it from a file, "
                    'with the training code under `if __name__ == "__main__":`'
                )
            raise RuntimeError(self._failure)
        age = time.time() - self.channels.heartbeat_value.value
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
                buffer = self.channels.rollout_buffer
                result = buffer.get(timeout=wait) if wait > 0 else buffer.get_nowait()
                if result.metrics:  # the window up to this kept group: drained with the rest
                    self._carried.append({"metrics": result.metrics})
                    result.metrics = None
                return result
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
            except (EOFError, OSError):  # the child died mid-message: let check_health name it
                self.process.join(1.0)
                self.check_health()
                raise

    def drain_metrics(self) -> list[dict[str, Any]]:
        """Every metrics payload the worker sent since the last call: the windows kept groups took
        along (``GroupResult.metrics``, in the order :meth:`get` returned them), then those flushed
        to ``metrics_queue``."""
        payloads, self._carried = self._carried, []
        while True:
            try:
                payloads.append(self.channels.metrics_queue.get_nowait())
            except (queue.Empty, EOFError, OSError):
                return payloads

    # --- shutdown --------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the worker: ask, wait ``grace_s``, then SIGTERM, then SIGKILL. Idempotent."""
        atexit.unregister(self.stop)
        self._stopped = True
        self.channels.stop_event.set()
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
        for q in (self.channels.rollout_buffer, self.channels.metrics_queue):
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
    """Spawn the rollout process running ``loop_cls(**loop_kwargs, channels=<RolloutChannels>)``.

    ``loop_kwargs`` are :class:`~trainer.rollout.loop.AsyncRolloutLoop` constructor arguments except
    the channels (queues, values and events), which are created here and exposed on the handle.
    ``initial_token_allowance``: raw tokens the child may generate before the trainer publishes its
    first ceiling. Reward functions, tools, environment factories and ``loop_cls`` are checked for
    picklability first (``TypeError`` naming the callable and the fix).
    """
    clash = [k for k in _CREATED_HERE if k in loop_kwargs]
    if clash:
        raise TypeError(f"start_rollout_process creates {', '.join(clash)} itself; do not pass them")
    check_rollout_picklable(
        loop_cls,
        loop_kwargs.get("reward_funcs"),
        loop_kwargs.get("tools"),
        loop_kwargs.get("environment_factory"),
    )
    check_rollout_importable(loop_cls, **loop_kwargs)
    ctx = mp.get_context("spawn")
    channels = RolloutChannels.create(
        ctx, initial_model_version=initial_model_version, initial_token_allowance=initial_token_allowance
    )
    process = ctx.Process(target=_rollout_main, args=(loop_cls, loop_kwargs, channels), name="rollout-worker")
    # The spawned interpreter inherits the environment at start: hide every GPU from it, and name
    # the file where it writes an error of its start-up phase (trainer/processes/spawn_startup.py).
    fd, startup_error_path = tempfile.mkstemp(prefix="grpo-rollout-startup-", suffix=".txt")
    os.close(fd)
    child_env = {"CUDA_VISIBLE_DEVICES": "", STARTUP_ERROR_ENV: startup_error_path}
    previous = {name: os.environ.get(name) for name in child_env}
    os.environ.update(child_env)
    try:
        with _main_path_hidden():
            process.start()
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    channels.close_parent_write_ends()
    config = loop_kwargs.get("config")
    handle = RolloutWorkerHandle(
        process,
        channels,
        timeout=float(getattr(config, "rollout_worker_timeout", 300.0)),
        startup_error_path=startup_error_path,
    )
    atexit.register(handle.stop)  # never leave an orphan behind a trainer that forgot stop()
    return handle
