"""``manage.py runstack``: the whole local stack in the foreground (what ``make run`` starts).

Migrates, starts the ASGI web server (daphne) and a Celery worker, prints the dashboard URL as soon
as the web answers, then starts the demo run (whose page shows the model being prepared and the
vLLM server starting as events). Ctrl-C / SIGTERM / SIGHUP stop everything it started within
:func:`stop_deadline_s` (the demo run is left ``interrupted``, and resumes at the next start).

Stopping promptly, whoever is signalled:

* runstack itself (a terminal's Ctrl-C reaches the whole foreground group; ``kill PID``);
* ``make``, its parent: make passes SIGTERM on to its child but, on SIGINT, only waits for the child
  to end. A SIGINT sent to make's pid alone is therefore seen here by watching make's signal
  dispositions: make resets its handler to the default before waiting (``/proc/PID/status``
  ``SigCgt`` loses the bit), which is the cue to stop;
* nobody: if the parent dies (SIGKILL), runstack is re-parented and stops.

The web and the worker run under :mod:`worker.guard` with runstack as their named parent, so even a
SIGKILL of runstack itself leaves no daphne or Celery worker behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

from controlplane.core.web_server import daphne_args
from worker.processes import ManagedProcess, caught_signals, http_ok, process_name


def stop_deadline_s() -> float:
    """Everything started is gone within this many seconds of a stop (SIGTERM to every process group
    at once, SIGKILL to what is left at the deadline). Inside the worker each live run's trainer gets
    GRPO_STOP_GRACE_S to save a checkpoint, then its vLLM server and trainer get as long again to
    exit, and the run is recorded ``interrupted``: two graces and 5 s for the records."""
    return 2 * settings.GRPO_STOP_GRACE_S + 5.0


WEB_START_TIMEOUT_S = 60.0
POLL_S = 0.25
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def output_line_buffered(*streams: object) -> None:
    """Each line printed reaches a pipe or a file at once (``make run > log``, ``| tee``), not when
    the block buffer fills or the process exits: the dashboard and demo URLs are in the log while the
    stack runs. Python line-buffers only a terminal unless PYTHONUNBUFFERED is set. Default: stdout
    and stderr (streams without ``reconfigure``, e.g. a test's StringIO, are left alone)."""
    for stream in streams or (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def child_env() -> dict[str, str]:
    """The environment of the processes runstack starts: its own, with PYTHONUNBUFFERED=1 so that
    their logs (``var/log/*.log``) are written as they happen, too."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


class ParentWatch:
    """Tells when the parent process wants us gone without signalling us (see the module docstring)."""

    def __init__(self) -> None:
        self.parent = os.getppid()
        self.is_make = process_name(self.parent) in ("make", "gmake")
        self.baseline = caught_signals(self.parent) if self.is_make else None

    def reason(self) -> str | None:
        """Why to stop now, or None."""
        if os.getppid() != self.parent:
            return f"parent process {self.parent} exited"
        if self.baseline is None:
            return None
        mask = caught_signals(self.parent)
        if mask is None:
            return None
        for sig in _STOP_SIGNALS:
            bit = 1 << (sig - 1)
            if self.baseline & bit and not mask & bit:
                return f"make received {signal.Signals(sig).name}"
        return None


class Command(BaseCommand):
    help = "Run web (ASGI) + Celery worker in the foreground; Ctrl-C stops both."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--no-tiny", action="store_true", help="do not prepare the embedded tiny model")
        parser.add_argument("--no-demo", action="store_true", help="do not start the demo run")

    def handle(self, *args, **opts):
        output_line_buffered()
        started = time.monotonic()
        self.stop_reason: str | None = None
        self.watch = ParentWatch()

        def on_signal(signum, frame):
            self.stop_reason = self.stop_reason or f"received {signal.Signals(signum).name}"

        for sig in _STOP_SIGNALS:
            signal.signal(sig, on_signal)

        port, host = opts["port"], opts["host"]
        call_command("migrate", interactive=False, verbosity=0)
        logs = settings.BASE_DIR / "var" / "log"
        processes = [
            self._guarded(
                "web",
                daphne_args(host=host, port=port),
                logs,
            ),
            self._guarded(
                "worker",
                [
                    "-m",
                    "celery",
                    "-A",
                    "worker",
                    "worker",
                    "-Q",
                    f"default,{settings.GRPO_RUNS_QUEUE}",
                    "-c",
                    "2",
                    "--loglevel",
                    "INFO",
                ],
                logs,
            ),
        ]
        try:
            for process in processes:
                process.start()
                self.stdout.write(f"{process.name}: pid {process.pid}, log {process.log_path}")
            url = f"http://{host}:{port}/"
            if not self._wait(lambda: http_ok(url + "healthz"), WEB_START_TIMEOUT_S, processes):
                return None
            self.stdout.write(
                self.style.SUCCESS(
                    f"dashboard: {url}  ({time.monotonic() - started:.0f} s; logs in {logs}; "
                    "Ctrl-C stops everything)"
                )
            )
            if not opts["no_demo"]:
                self._start_demo_run(url)
            elif not opts["no_tiny"]:
                self._prepare_tiny(processes, logs)
            self._wait(lambda: False, None, processes)
        finally:
            self.stdout.write(f"stopping web and worker ({self.stop_reason or 'exiting'})...")
            stop_together(processes, deadline_s=stop_deadline_s())
            self.stdout.write("stopped")
        return None

    # ------------------------------------------------------------------------------ pieces
    @staticmethod
    def _guarded(name: str, argv: list[str], logs: Path) -> ManagedProcess:
        """``python ARGV`` under ``worker.guard``, which takes it down if runstack dies."""
        guard = [sys.executable, "-m", "worker.guard", "--parent", str(os.getpid()), "--", sys.executable]
        return ManagedProcess(
            name, guard + argv, env=child_env(), cwd=settings.BASE_DIR, log_path=logs / f"{name}.log"
        )

    def _wait(self, done, timeout_s: float | None, processes: list[ManagedProcess]) -> bool:
        """Poll until ``done()``; False when a stop was asked for or a child exited first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done():
            self.stop_reason = self.stop_reason or self.watch.reason()
            if self.stop_reason:
                return False
            for process in processes:
                if process.poll() is not None:
                    self.stderr.write(f"{process.name} exited ({process.poll()}):\n{process.log_tail(20)}")
                    self.stop_reason = f"{process.name} exited"
                    return False
            if deadline is not None and time.monotonic() > deadline:
                self.stderr.write(f"the web server did not answer within {timeout_s:.0f} s")
                self.stop_reason = "web start timed out"
                return False
            time.sleep(POLL_S)
        return True

    def _prepare_tiny(self, processes: list[ManagedProcess], logs: Path) -> None:
        """Without a demo run: prepare the tiny model in a child process (stoppable at any point)."""
        prepare = "from trainer.plugins.registry import resolve_model; print(resolve_model('tiny'))"
        builder = ManagedProcess(
            "tiny",
            [sys.executable, "-c", prepare],
            env=child_env(),
            cwd=settings.BASE_DIR,
            log_path=logs / "tiny.log",
        ).start()
        self.stdout.write("preparing the embedded tiny model...")
        try:
            self._wait(lambda: builder.poll() is not None, None, processes)
        finally:
            builder.stop(grace_s=2)

    def _start_demo_run(self, url: str) -> None:
        from controlplane.runs.services import demo_run_start

        run = demo_run_start()
        login = "demo / demo" if settings.GRPO_DEMO_PASSWORD == "demo" else "demo / $GRPO_DEMO_PASSWORD"
        self.stdout.write(f"demo run #{run.pk}: {url}runs/{run.pk}/ (log in as {login})")


def stop_together(processes: list[ManagedProcess], *, deadline_s: float) -> None:
    """SIGTERM every process group at once, SIGKILL what is left after ``deadline_s`` seconds."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + deadline_s
    for process in processes:
        process.stop(grace_s=max(0.0, deadline - time.monotonic()))
