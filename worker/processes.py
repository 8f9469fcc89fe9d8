"""Child processes started and ended as a unit: each in its own session (process group), so that
stopping one also ends everything it spawned (vLLM's engine core, the trainer's rollout process).

Used by the run supervisor and by ``manage.py runstack``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any


@dataclass
class ManagedProcess:
    """One child process in its own process group, with its output teed to a log file."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | Path | None = None
    log_path: Path | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False, repr=False)

    def start(self) -> ManagedProcess:
        stdout: int | IO[bytes] = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            stdout = self._log
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        """Exit status, or ``None`` while running."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL it after ``grace_s``; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Grandchildren that ignored SIGTERM or outlived their parent still hold the group id.
        _signal_group(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log file (for failure reasons)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64_000))
            tail = deque(fh.read().decode("utf-8", "replace").splitlines(), maxlen=lines)
        return "\n".join(tail)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_all(processes: list[ManagedProcess], grace_s: float = 10.0) -> None:
    """Stop processes in reverse start order (dependents first)."""
    for process in reversed(processes):
        process.stop(grace_s=grace_s)


def wait_for(predicate, *, timeout_s: float, interval_s: float = 0.5, what: str = "condition") -> Any:
    """Poll ``predicate()`` until it returns something true, and return that; raise ``TimeoutError``
    naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
