"""`make run` serves the home page on $PORT and stops everything it started on Ctrl-C / SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, free_port, http_ok


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_make_run_serves_and_stops_cleanly(tiny_model_dir, sig):
    port = free_port()
    proc = subprocess.Popen(
        ["make", "run", f"PORT={port}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PORT": str(port)},
    )
    output: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            output.append(line)
            if "dashboard:" in line:
                break
        text = "".join(output)
        assert f"http://127.0.0.1:{port}/" in text, text
        assert http_ok(f"http://127.0.0.1:{port}/")
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        assert len(pids) == 2, text  # web + worker
        # Ctrl-C reaches the whole foreground group; a supervisor's SIGTERM reaches it the same way.
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.5)
        assert not any(_alive(p) for p in pids), f"left behind: {[p for p in pids if _alive(p)]}"
        assert not http_ok(f"http://127.0.0.1:{port}/")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
