"""Child processes started and ended as a unit: each in its own session (process group), so that
stopping one also ends everything it spawned (vLLM's engine core, the trainer's rollout process).

Also the small pieces every launcher of such processes needs: a free local port, an HTTP health
probe, waiting for a started server to become healthy, and :class:`VLLMServer` (a ``python -m
trainer serve`` process and its base URL).

And the Linux ``/proc`` readers about processes the launchers ask for (:func:`process_alive`,
:func:`group_members`, :func:`descendants`, :func:`caught_signals`, :func:`process_name`): one
place parses ``/proc/<pid>/stat`` and ``status``.

Used by the run supervisor, ``worker.guard``, ``manage.py runstack``, the tests' fixtures and the
benchmarks. Stdlib only: ``worker.guard`` (the parent of every run process) imports it and must load
neither Django nor Celery.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from worker import log_records

_REPO = Path(__file__).resolve().parent.parent


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

    def terminate(self) -> None:
        """SIGTERM the whole process group and return at once (``stop`` then waits and kills)."""
        if self.proc is not None and self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)

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
        """About the last ``lines`` lines of the log file (for failure reasons and exit events), in
        whole records (:func:`worker.log_records.log_tail`: the last traceback whole, httpx request
        lines left out)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            start = max(0, fh.tell() - 64_000)
            fh.seek(start)
            data = fh.read()
        if start > 0:
            data = data[data.find(b"\n") + 1 :]  # from the first whole line
        return log_records.log_tail(data, max_lines=lines)


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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_in(low: int, high: int) -> int | None:
    """The first port of ``low..high`` free on every interface of this host right now, or None."""
    for port in range(low, high + 1):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    return None


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_healthy(process: ManagedProcess, url: str, *, timeout_s: float, what: str = "vLLM server") -> float:
    """Wait until ``url`` answers 200; returns the seconds waited. If ``process`` exits first or
    ``timeout_s`` passes, it is stopped and the error carries its log tail."""
    started = time.monotonic()
    try:
        while time.monotonic() - started < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited ({process.poll()}):\n{process.log_tail(60)}")
            if http_ok(url):
                return time.monotonic() - started
            time.sleep(1.0)
        raise TimeoutError(f"{what} not healthy after {timeout_s:.0f}s:\n{process.log_tail(60)}")
    except BaseException:
        process.stop(grace_s=10)
        raise


class VLLMServer:
    """A ``python -m trainer serve MODEL --port PORT *extra`` process and its base URL."""

    def __init__(
        self,
        model_dir: str | Path,
        port: int,
        log_path: Path,
        extra: list[str],
        *,
        prefix: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        argv = [
            *(prefix or []),
            sys.executable,
            "-m",
            "trainer",
            "serve",
            str(model_dir),
            "--port",
            str(port),
        ]
        cwd = cwd if cwd is not None else _REPO  # where `python -m trainer` resolves without an install
        self.process = ManagedProcess("vllm", [*argv, *extra], env=env, cwd=cwd, log_path=log_path)

    @property
    def log_path(self) -> Path | None:
        """Where the server's output goes."""
        return self.process.log_path

    def start(self, timeout_s: float = 420) -> VLLMServer:
        """Start it and wait until ``/health`` answers (the error names why it did not)."""
        self.process.start()
        wait_healthy(self.process, self.base_url + "/health", timeout_s=timeout_s)
        return self

    def stop(self) -> None:
        self.process.stop(grace_s=20)

    def restart(self, timeout_s: float = 420) -> VLLMServer:
        """Stop it and start it again on the same port and log (appended)."""
        self.stop()
        return self.start(timeout_s)


# ---------------------------------------------------------------------------------------- /proc
def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a SIGKILLed process is one until it is reaped)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (zombies included)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def caught_signals(pid: int) -> int | None:
    """The ``SigCgt`` mask of ``pid`` (bit ``n - 1`` set = signal ``n`` has a handler), or None."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        return None
    return None


def process_argv(pid: int | str) -> list[str]:
    """``/proc/<pid>/cmdline`` as arguments, or [] when the process is gone or not readable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def process_name(pid: int) -> str:
    """``/proc/<pid>/comm`` (the executable's short name), or "" when the process is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# ------------------------------------------------------------------- a run's processes, as launched
# The control plane's settings that must not reach the run's processes (the trainer runs user code:
# rewards, tools, environments, plugins); it reports through files (trainer.reporting.sinks) instead.
CONTROL_PLANE_ENV = frozenset(
    {
        "DATABASE_URL",
        "REDIS_URL",
        "DJANGO_SETTINGS_MODULE",
        "GRPO_CHANNEL_PREFIX",
        "GRPO_CACHE_PREFIX",
        "SECRET_KEY",
        "GRPO_DEMO_PASSWORD",
    }
)


def child_environment(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """``environ`` less the control plane's settings (``CONTROL_PLANE_ENV``): what the run's
    processes inherit from the worker."""
    return {name: value for name, value in environ.items() if name not in CONTROL_PLANE_ENV}


def start_guarded(
    name: str, argv: list[str], env: dict[str, str] | None, *, log_path: Path, grace_s: float
) -> ManagedProcess:
    """``argv`` started under :mod:`worker.guard` (its own process group, ended if this process dies),
    with this worker's environment less the control plane's (``env`` added), its output to ``log_path``;
    the guard gives it ``grace_s`` between SIGTERM and SIGKILL."""
    full_env = {
        **child_environment(os.environ),
        "PYTHONUNBUFFERED": "1",
        "GRPO_GUARD_GRACE_S": str(grace_s),
    }
    full_env.update(env or {})
    guarded = [sys.executable, "-m", "worker.guard", "--parent", str(os.getpid()), "--", *argv]
    return ManagedProcess(name, guarded, env=full_env, cwd=_REPO, log_path=log_path).start()


def install_shutdown_flag(supervisor: Any) -> Any:
    """On SIGTERM (the worker's warm shutdown), set ``supervisor.shutdown_signal`` (its loop then
    interrupts the run); returns the previous handler, or None off the main thread (no handler set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_signal(signum: int, frame: Any) -> None:
        supervisor.shutdown_signal = signum

    return signal.signal(signal.SIGTERM, on_signal)


def wait_group_gone(pgid: int, *, timeout_s: float) -> bool:
    """Wait until process group ``pgid`` is empty, SIGKILLing stragglers; False if it never empties."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.1)
    return True


def describe_exit(code: int | None) -> str:
    """An exit status for people: ``143 (SIGTERM)``; the guard reports signal N as 128 + N."""
    if code is None:
        return "unknown"
    signum = code - 128 if code > 128 else -code if code < 0 else 0
    try:
        return f"{code} ({signal.Signals(signum).name})" if signum else str(code)
    except ValueError:
        return str(code)
