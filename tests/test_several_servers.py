"""A vLLM server of a run's several killed mid-run, through the real stack (issue 31, C14).

A CPU worker whose operator registered two servers (the session's, ``shared``, and the session's
second, ``second``) runs a REST run with ``resources: {vllm: {servers: [shared, second]}}``; the second
server is killed (SIGKILL of its process group: its host gone) once the run has trained a step. The run
fails, its failure reason naming the server. (The run over two servers that trains to the end, with
requests on both and every weight update on both: tests/test_nodes.py, where it also spans two hosts.)
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from controlplane.runs.models import Run, RunStatus
from tests.test_placement_live import (  # noqa: F401  (api: a fixture)
    api,
    cpu_pool,
    create,
    failure_report,
    run_doc,
    wait_first_step,
)
from worker.processes import group_members, process_argv, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def kill_server(base_url: str) -> None:
    """SIGKILL the process group of the vLLM server listening on ``base_url``'s port (its host lost)."""
    port = base_url.rsplit(":", 1)[1]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        argv = process_argv(entry)
        # `trainer serve` execs vLLM's API server: `python -m vllm.entrypoints.openai.api_server ... --port N`
        serves = any("vllm" in arg for arg in argv)
        if serves and "--port" in argv[:-1] and argv[argv.index("--port") + 1] == port:
            os.killpg(os.getpgid(int(entry)), signal.SIGKILL)
            return
    raise AssertionError(f"no vLLM server process with --port {port} found")


@pytest.fixture
def two_server_pool(vllm_server, second_server, tmp_path, settings):
    """A CPU worker with both servers registered: ``shared`` (the session's) and ``second``."""
    servers = {"shared": vllm_server.base_url, "second": second_server.base_url}
    with cpu_pool(tmp_path, settings, servers, name="two-servers") as (queue, _):
        yield queue


def test_a_server_killed_mid_run_fails_the_run_naming_it(
    api,  # noqa: F811
    two_server_pool,
    second_server,
):
    resources = {"pool": two_server_pool, "vllm": {"servers": ["shared", "second"]}}
    run_id = create(api, run_doc(resources, max_steps=200), "loses a server")
    wait_first_step(run_id)
    kill_server(second_server.base_url)  # the server's host is gone
    wait_for(lambda: Run.objects.get(pk=run_id).is_terminal, timeout_s=300, what="the run to fail")
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.FAILED, failure_report(run)
    # e.g. "trainer exited with status 1: WeightSyncError: POST http://127.0.0.1:8391/pause?mode=keep
    # (vLLM server 'second') failed: ConnectError: ..."
    named = re.escape(second_server.base_url) + r"\S* \(vLLM server 'second'\)"
    assert re.search(named, run.failure_reason), failure_report(run)
    assert not [g for g in (run.trainer_pid,) if g and group_members(g)]
