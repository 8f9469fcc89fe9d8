"""``python -m worker.guard [--parent PID] -- ARGV...``: run ARGV, and take its whole process group down if the
guard's parent (the run supervisor) dies without stopping it.

The supervisor starts the vLLM server and the trainer through this guard, each in a new session
(:class:`worker.processes.ManagedProcess`), so the guard leads a process group that holds the child
and everything the child spawns (vLLM's engine core, the trainer's rollout process). Stopping is
done on the group (SIGTERM, then SIGKILL), which reaches the child directly, so the guard ignores
SIGTERM/SIGINT itself and simply waits, exiting with the child's status (128 + signal number when
the child was killed by a signal).

If the supervisor vanishes (its Celery worker was SIGKILLed or ran out of memory), the guard is
re-parented; it then sends SIGTERM to its group and SIGKILL after ``GRPO_GUARD_GRACE_S`` seconds
(default 10), so no server or trainer outlives its supervisor.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from worker.processes import process_alive

POLL_S = 0.5


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell-style exit status (signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _take_down_group(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the guard's own process group, then SIGKILL it (the guard included) after ``grace_s``."""
    group = os.getpgrp()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    # The supervisor names itself (--parent PID): the parent this process sees at start is not always
    # the supervisor (measured under Celery's prefork pool: getppid() was already 1 here).
    parent = None
    if len(argv) >= 2 and argv[0] == "--parent":
        parent, argv = int(argv[1]), argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m worker.guard [--parent PID] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    grace_s = float(os.environ.get("GRPO_GUARD_GRACE_S", "10"))
    if parent is None:
        parent = os.getppid()
    child = subprocess.Popen(argv)
    # Group signals reach the child directly; the guard outlives it to report its status.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return exit_status(child.wait(timeout=POLL_S))
        if not process_alive(parent):
            print(f"worker.guard: supervisor {parent} is gone; stopping process group", file=sys.stderr)
            _take_down_group(child, grace_s)
            return exit_status(child.wait())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
