"""A private Postgres cluster and Redis server for the fault tests, so they can run beside the others.

The fault tests (``-m faults``) restart Postgres and shut Redis down mid-run. On the machine's own
services that would break every other test running at the time, so ``make test`` used to run them
last, alone (about 4 minutes of the suite's 20). Given services of their own, they run beside the
heavy layer instead:

    python -m tests.private_services -- python -m pytest -m faults

starts a real Postgres (``initdb`` + ``pg_ctl``, as the ``postgres`` user when run as root: Postgres
refuses to run as root) and a real ``redis-server`` on free ports in a temporary directory, runs the
command with ``DATABASE_URL``/``REDIS_URL`` pointing at them and ``GRPO_FAULTS_PGDATA`` /
``GRPO_FAULTS_PG_PORT`` / ``GRPO_FAULTS_REDIS_PORT`` naming them (so the tests restart these, not the
machine's: tests/faults/test_run_faults.py), then stops both and removes the directory. Its exit status is
the command's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from worker.processes import free_port

START_TIMEOUT_S = 60.0  # a hang guard for initdb/pg_ctl/redis-server, not a verdict


def _as_postgres(argv: list[str]) -> list[str]:
    """``argv`` run as the ``postgres`` user when this process is root (Postgres refuses root)."""
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


def pg_ctl(pgdata: str, *args: str) -> list[str]:
    """The ``pg_ctl`` command line for the private cluster in ``pgdata`` (waits for the action)."""
    return _as_postgres(["pg_ctl", "-D", pgdata, "-w", "-t", str(int(START_TIMEOUT_S)), *args])


def _chown_to_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(path, entry.pw_uid, entry.pw_gid)


@contextlib.contextmanager
def private_postgres(root: Path) -> Iterator[tuple[str, int]]:
    """A fresh cluster under ``root``; yields ``(pgdata, port)`` with the ``postgres`` superuser on trust."""
    pgdata, sockets = root / "pgdata", root / "pgsock"
    for path in (root, pgdata, sockets):
        path.mkdir(exist_ok=True)
        _chown_to_postgres(path)
    port = free_port()
    subprocess.run(
        _as_postgres(
            ["initdb", "-D", str(pgdata), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]
        ),
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=START_TIMEOUT_S,
    )
    options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    subprocess.run(
        pg_ctl(str(pgdata), "-o", options, "-l", str(root / "postgres.log"), "start"),
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=START_TIMEOUT_S + 10,
    )
    try:
        subprocess.run(
            ["createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "grpo"], check=True, timeout=60
        )  # the DATABASE_URL below names it; pytest-django makes its test database beside it
        yield str(pgdata), port
    finally:
        subprocess.run(pg_ctl(str(pgdata), "-m", "immediate", "stop"), stdout=subprocess.DEVNULL, timeout=60)


def start_redis(port: int, directory: Path) -> None:
    """``redis-server`` on ``127.0.0.1:port``, keeping nothing on disk (as the machine's does)."""
    subprocess.run(
        [
            "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", str(port),
            "--save", "", "--appendonly", "no", "--dir", str(directory),
            "--logfile", str(directory / "redis.log"), "--pidfile", str(directory / "redis.pid"),
        ],
        check=True,
        timeout=30,
    )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server on port {port} did not answer in {START_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def private_redis(root: Path) -> Iterator[int]:
    """A fresh ``redis-server`` writing its files under ``root``; yields its port."""
    port = free_port()
    start_redis(port, root)
    try:
        yield port
    finally:
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run against them")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    root = Path(tempfile.mkdtemp(prefix="grpo-private-services-"))
    try:
        with private_postgres(root) as (pgdata, pg_port), private_redis(root) as redis_port:
            env = {
                **os.environ,
                "DATABASE_URL": f"postgres://postgres@127.0.0.1:{pg_port}/grpo",
                "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
                "GRPO_FAULTS_PGDATA": pgdata,
                "GRPO_FAULTS_PG_PORT": str(pg_port),
                "GRPO_FAULTS_REDIS_PORT": str(redis_port),
                "GRPO_FAULTS_REDIS_DIR": str(root),
            }
            return subprocess.run(command, env=env).returncode
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
