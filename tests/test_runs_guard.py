"""worker.guard: children of a run die with their supervisor, and exit statuses come through.

Real processes (a Python child that spawns a grandchild), no Django needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO
from worker.processes import ManagedProcess, group_members

CHILD_WITH_GRANDCHILD = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
    "time.sleep(300)"
)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_guard_takes_its_group_down_when_the_supervisor_is_killed():
    # A stand-in supervisor: starts the guard in a new session, like RunSupervisor, then is SIGKILLed
    # (what happens to a Celery pool process killed by the OOM killer or `kill -9`).
    supervisor_code = (
        "import subprocess, sys, time;"
        f"p = subprocess.Popen([sys.executable, '-m', 'worker.guard', '--', sys.executable, '-c', {CHILD_WITH_GRANDCHILD!r}],"
        " start_new_session=True);"
        "print(p.pid, flush=True); time.sleep(300)"
    )
    supervisor = subprocess.Popen(
        [sys.executable, "-c", supervisor_code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "GRPO_GUARD_GRACE_S": "3"},
    )
    try:
        pgid = int(supervisor.stdout.readline())
        wait_until(lambda: len(group_members(pgid)) == 3, 60, "guard + child + grandchild")
        supervisor.kill()
        supervisor.wait(timeout=10)
        wait_until(lambda: not group_members(pgid), 30, "the guard to end its group")
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        for pid in group_members(pgid) if "pgid" in locals() else []:
            os.kill(pid, signal.SIGKILL)


def test_guard_reports_the_child_status_and_group_stop_works(tmp_path):
    guarded = [sys.executable, "-m", "worker.guard", "--"]
    exits = ManagedProcess("exit3", [*guarded, sys.executable, "-c", "raise SystemExit(3)"], cwd=REPO).start()
    exits.proc.wait(timeout=60)
    assert exits.poll() == 3
    # Stopping the group (as the supervisor does): SIGTERM reaches the child directly; the guard
    # waits for it and reports 128 + SIGTERM; the grandchild is gone too.
    sleeper = ManagedProcess(
        "sleeper",
        [*guarded, sys.executable, "-c", CHILD_WITH_GRANDCHILD],
        cwd=REPO,
        log_path=tmp_path / "log",
    ).start()
    wait_until(lambda: len(group_members(sleeper.pid)) == 3, 60, "guard + child + grandchild")
    assert sleeper.stop(grace_s=10) == 128 + signal.SIGTERM
    wait_until(lambda: not group_members(sleeper.pid), 10, "the group to be gone")
