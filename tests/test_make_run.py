"""`make run` serves the dashboard on $PORT and stops everything it started, promptly, however it is
told to: Ctrl-C (SIGINT to the whole foreground group), SIGTERM, SIGINT to make's pid alone (make
does not pass it on), SIGTERM while the demo run's first tiny-model build is under way, or a SIGKILL
of runstack itself (its web and worker die with it). Ctrl-C and SIGTERM leave a training demo run
``interrupted`` at a checkpoint of its last step, and the next ``make run`` continues it.

Each stack gets its own database and runs queue, so nothing it enqueues outlives it elsewhere.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, SESSION_SERVER, free_port, http_ok

STOP_WITHIN_S = 20  # the bound, from the signal to the last process gone


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _processes_with_env(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (``NAME=value``): everything a stack started,
    its vLLM server and trainer too, which run in sessions of their own."""
    needle = marker.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes() and _alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


class Stack:
    """``make run`` in its own session, with its own database, runs queue and (optionally) cache."""

    def __init__(self, tmp_path: Path, like: Stack | None = None, **env: str) -> None:
        """A new stack; ``like``: the same database, runs queue and runs folder as that (stopped) one."""
        self.port = free_port()
        self.db = like.db if like else f"grpo_makerun_{uuid.uuid4().hex[:8]}"
        self.queue = like.queue if like else f"makerun-{uuid.uuid4().hex[:8]}"
        runs = like.env["GRPO_RUNS_DIR"] if like else str(tmp_path / "runs")
        self.env = {
            **os.environ,
            "PORT": str(self.port),
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{self.db}",
            "GRPO_RUNS_QUEUE": self.queue,
            "GRPO_RUNS_DIR": runs,
            **env,
        }
        self.proc = subprocess.Popen(
            ["make", "run", f"PORT={self.port}"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=self.env,
        )
        self.output: list[str] = []

    def read_until(self, marker: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.output.append(line)
            if marker in line:
                break
        return "".join(self.output)

    @property
    def pids(self) -> list[int]:
        """The web and worker process groups' leaders (runstack prints them)."""
        return [int(p) for p in re.findall(r"pid (\d+)", "".join(self.output))]

    def runstack_pid(self) -> int:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True
        ).stdout.split()
        return int(out[0])

    def members(self) -> list[int]:
        return _processes_with_env(f"GRPO_RUNS_QUEUE={self.queue}")

    def wait_all_gone(self) -> float:
        """Seconds until every process of the stack is gone (make, runstack, web, worker, and the demo
        run's vLLM server and trainer)."""
        started = time.monotonic()
        while time.monotonic() - started < 60:
            if self.proc.poll() is not None and not self.members():
                return time.monotonic() - started
            time.sleep(0.2)
        raise AssertionError(
            f"left behind after 60 s: {self.members()}; make {self.proc.poll()}; its last output:\n"
            + self.drain(2.0)[-3000:]
        )

    def drain(self, timeout_s: float) -> str:
        """What the stack printed so far, with whatever arrives within ``timeout_s`` (never blocks
        longer: a stack that hangs prints nothing more)."""
        import select

        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                break
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
        return "".join(self.output)

    def sql(self, query: str) -> list[list[str]]:
        """Rows of ``query`` on the stack's database (its tables are Django's: ``runs_run``, ...)."""
        out = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", self.db, "-AtF", "\t", "-c", query],
            capture_output=True,
            text=True,
        ).stdout
        return [line.split("\t") for line in out.splitlines() if line]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.members():
            os.kill(pid, signal.SIGKILL)
        subprocess.run(
            [
                "psql",
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-c",
                f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)',
            ],
            capture_output=True,
        )


@pytest.fixture
def stack_factory(tmp_path):
    stacks: list[Stack] = []

    def start(like: Stack | None = None, **env: str) -> Stack:
        stacks.append(Stack(tmp_path / f"s{len(stacks)}", like, **env))
        return stacks[-1]

    yield start
    for stack in stacks:
        stack.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT to make only", "SIGKILL runstack"])
def test_make_run_serves_and_stops_promptly(stack_factory, tiny_model_dir, how):
    stack = stack_factory()
    text = stack.read_until("dashboard:", 120)
    assert f"http://127.0.0.1:{stack.port}/" in text, text
    assert http_ok(f"http://127.0.0.1:{stack.port}/")
    assert len(stack.pids) == 2, text  # web + worker
    text = stack.read_until("demo run #", 30)
    assert re.search(rf"demo run #\d+: http://127.0.0.1:{stack.port}/runs/\d+/", text), text
    # Signal once the demo run's vLLM server is starting: it and the trainer must go too.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not any(b"trainer\0serve" in _cmdline(p) for p in stack.members()):
        time.sleep(0.5)
    assert any(b"trainer\0serve" in _cmdline(p) for p in stack.members()), (
        "the demo's vLLM server never started"
    )
    if how == "group SIGINT":  # Ctrl-C in a terminal
        os.killpg(stack.proc.pid, signal.SIGINT)
    elif how == "group SIGTERM":
        os.killpg(stack.proc.pid, signal.SIGTERM)
    elif how == "SIGINT to make only":  # make waits for its child and passes nothing on
        os.kill(stack.proc.pid, signal.SIGINT)
    else:  # no clean-up code runs at all: the guards take web and worker down
        os.kill(stack.runstack_pid(), signal.SIGKILL)
    took = stack.wait_all_gone()
    assert took <= STOP_WITHIN_S, f"{how}: everything gone only after {took:.1f} s"
    assert not http_ok(f"http://127.0.0.1:{stack.port}/")


@pytest.mark.slow
def test_sigterm_during_the_first_tiny_build_stops_within_20_s(stack_factory, tmp_path):
    """No shipped build and an empty cache: the demo run's supervisor trains the tiny model from
    scratch (minutes); a SIGTERM then still ends everything within the bound."""
    stack = stack_factory(GRPO_TINY_PREBUILT="0", GRPO_CACHE_DIR=str(tmp_path / "empty-cache"))
    stack.read_until("demo run #", 120)
    worker_log = REPO / "var" / "log" / "worker.log"
    deadline = time.monotonic() + 90
    building = tmp_path / "empty-cache" / "tiny"
    while time.monotonic() < deadline and not any(p.name.endswith(".lock") for p in building.glob("*")):
        time.sleep(0.5)
    assert any(p.name.endswith(".lock") for p in building.glob("*")), worker_log.read_text()[-3000:]
    time.sleep(3)  # well inside the warm start
    os.killpg(stack.proc.pid, signal.SIGTERM)
    took = stack.wait_all_gone()
    assert took <= STOP_WITHIN_S, f"everything gone only after {took:.1f} s"
    # Interrupted before it finished: the model directory was never written (builds are atomic).
    from trainer.tiny.build import source_hash

    assert not (building / source_hash()[:16]).exists()


def _last_loss_step(stack: Stack, run_id: int) -> int:
    rows = stack.sql(f"SELECT max(step) FROM runs_metricpoint WHERE run_id = {run_id} AND name = 'loss'")
    return int(rows[0][0]) if rows and rows[0] and rows[0][0] else 0


@pytest.mark.slow
def test_ctrl_c_interrupts_the_demo_run_and_the_next_make_run_continues_it(stack_factory, vllm_server):
    """Ctrl-C (SIGINT to the foreground group) once the demo trains: the trainer saves a checkpoint
    at its step's end, everything is gone within the bound and the run is ``interrupted``, not
    ``failed``, with no logged step past the checkpoint (none lost). ``make run`` again continues
    the same run from that checkpoint (no new demo run); a SIGTERM then interrupts it again.

    The demo trains on the session's vLLM server (``GRPO_DEMO_SERVER``): the per-run server's start
    and stop are the other tests' here."""
    server = {
        "GRPO_VLLM_SERVERS": f"{SESSION_SERVER}={vllm_server.base_url}",
        "GRPO_DEMO_SERVER": SESSION_SERVER,
    }
    first = stack_factory(**server)
    text = first.read_until("demo run #", 150)
    run_id = int(re.search(r"demo run #(\d+): ", text).group(1))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and _last_loss_step(first, run_id) < 2:
        time.sleep(0.5)
    assert _last_loss_step(first, run_id) >= 2, first.sql(
        f"SELECT message FROM runs_runevent WHERE run_id = {run_id}"
    )
    os.killpg(first.proc.pid, signal.SIGINT)
    took = first.wait_all_gone()
    assert took <= STOP_WITHIN_S, f"everything gone only after {took:.1f} s"
    events = "\n".join(
        r[0] for r in first.sql(f"SELECT message FROM runs_runevent WHERE run_id = {run_id} ORDER BY id")
    )
    [[status]] = first.sql(f"SELECT status FROM runs_run WHERE id = {run_id}")
    assert status == "interrupted", events[-3000:]
    [[saved]] = first.sql(f"SELECT max(step) FROM runs_checkpoint WHERE run_id = {run_id}")
    saved = int(saved)
    assert f"checkpoint saved at step {saved}" in events, events[-3000:]
    assert _last_loss_step(first, run_id) <= saved  # every logged step is in the checkpoint

    second = stack_factory(like=first, **server)
    text = second.read_until("demo run #", 150)
    assert f"demo run #{run_id}: " in text, text  # the same run, not a new demo
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and _last_loss_step(second, run_id) <= saved:
        time.sleep(0.5)
    events = "\n".join(
        r[0] for r in second.sql(f"SELECT message FROM runs_runevent WHERE run_id = {run_id} ORDER BY id")
    )
    assert _last_loss_step(second, run_id) > saved, events[-3000:]
    assert f"running (resumed from checkpoint-{saved})" in events, events[-3000:]
    assert second.sql("SELECT count(*) FROM runs_run") == [["1"]]
    os.killpg(second.proc.pid, signal.SIGTERM)
    took = second.wait_all_gone()
    assert took <= STOP_WITHIN_S, f"SIGTERM: everything gone only after {took:.1f} s"
    assert second.sql(f"SELECT status, attempt FROM runs_run WHERE id = {run_id}") == [["interrupted", "2"]]
