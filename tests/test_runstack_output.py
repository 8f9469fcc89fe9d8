"""Issue 28 item 7a: ``make run > log`` (or ``| tee``) gets runstack's lines as they are printed, the
dashboard URL while the stack runs, not at its exit, without PYTHONUNBUFFERED in the environment;
the processes it starts get PYTHONUNBUFFERED=1, so that their logs are written as they happen.

The real command in a process of its own with its stdout to a pipe, its web and worker replaced by
two sleeping Python processes (under the real guard) and its migrations and health probe left out:
no database, no daphne, no Celery, a few seconds. ``tests/test_make_run.py`` runs the whole stack.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

from tests.conftest import PYTHON, REPO

STUB = """
import os, sys
from pathlib import Path

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django.setup()
from django.core.management import call_command

from controlplane.core.management.commands import runstack

logs = Path(sys.argv[1])
child = "import os, time; print('PYTHONUNBUFFERED=%s' % os.environ.get('PYTHONUNBUFFERED')); time.sleep(60)"
guarded = runstack.Command._guarded
runstack.Command._guarded = staticmethod(lambda name, argv, _logs: guarded(name, ["-c", child], logs))
runstack.call_command = lambda *args, **kwargs: None  # no migrations
runstack.http_ok = lambda url: True  # the web "answers" at once
call_command("runstack", "--no-demo", "--no-tiny", "--port", "8999")
"""


def _read_until(proc: subprocess.Popen, marker: bytes, timeout_s: float) -> bytes:
    """What ``proc`` wrote to its stdout pipe until ``marker`` (or the timeout, or its exit)."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while marker not in out and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
    return out


def test_runstack_lines_reach_a_pipe_as_they_are_printed(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(
        [PYTHON, "-c", STUB, str(tmp_path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out = _read_until(proc, b"dashboard:", timeout_s=40)
        assert b"dashboard: http://127.0.0.1:8999/" in out, out.decode(errors="replace")
        assert proc.poll() is None, "the lines came only with the exit"
        assert b"web: pid " in out and b"worker: pid " in out
        # The started processes' environment: their own output is not held back either.
        deadline = time.monotonic() + 20
        logs = [tmp_path / "web.log", tmp_path / "worker.log"]
        while time.monotonic() < deadline and not all(
            log.exists() and "PYTHONUNBUFFERED=" in log.read_text() for log in logs
        ):
            time.sleep(0.1)
        for log in logs:
            assert "PYTHONUNBUFFERED=1" in log.read_text(), log
        proc.send_signal(signal.SIGTERM)
        rest = _read_until(proc, b"stopped", timeout_s=40)
        assert b"stopping web and worker (received SIGTERM)" in rest and b"stopped" in rest
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its guarded children follow it
            proc.wait()


def test_output_line_buffered_sets_line_buffering_and_leaves_other_streams_alone():
    import io

    from controlplane.core.management.commands.runstack import child_env, output_line_buffered

    piped = io.TextIOWrapper(io.BytesIO())
    assert not piped.line_buffering
    other = io.StringIO()
    output_line_buffered(piped, other)
    assert piped.line_buffering
    piped.write("dashboard: http://127.0.0.1:8000/\n")
    assert piped.buffer.getvalue() == b"dashboard: http://127.0.0.1:8000/\n"  # there, not buffered
    assert child_env()["PYTHONUNBUFFERED"] == "1"
