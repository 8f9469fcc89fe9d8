"""A trainer across hosts, the parts that need no second worker: the ``resources.trainer.nodes``
block, one host's share, the launch command on each host, and how the first host's supervisor reads
the further hosts' rows (failed, silent, never started). The live runs: tests/test_nodes.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.runs import services
from controlplane.runs.models import Run, RunNode, RunNodeStatus
from controlplane.runs.placement import Unplaceable, Waiting, node_plan
from trainer.config.resources import parse_resources, resources_errors
from worker.launch import Rendezvous, trainer_command


@pytest.mark.parametrize(
    ("trainer", "field", "message"),
    [
        ({"nodes": 0}, "resources.trainer.nodes", "must be an integer >= 1"),
        ({"nodes": 2, "processes": 2}, "resources.trainer.processes", "processes_per_node instead"),
        ({"nodes": 2, "gpus": 8}, "resources.trainer.gpus", "gpus_per_node instead"),
        (
            {"gpus_per_node": 2, "processes_per_node": 1},
            "resources.trainer",
            "not both (gpus_per_node and processes_per_node)",
        ),
    ],
)
def test_nodes_block_errors_name_the_field(trainer, field, message):
    errors = resources_errors({"trainer": trainer})
    assert message in errors.get(field, ""), errors


def test_nodes_parse_to_a_per_node_share():
    gpu = parse_resources({"trainer": {"nodes": 4, "gpus_per_node": 8}, "vllm": {"gpus": 2}})
    assert (gpu.trainer_nodes, gpu.trainer_gpus_on(gpu_host=True)) == (4, 8)
    assert gpu.explicit_gpus() == 10  # the first host holds the server and its own share
    cpu = parse_resources({"trainer": {"nodes": 2, "processes_per_node": 3}})
    assert (cpu.trainer_nodes, cpu.trainer_processes_on(gpu_host=False)) == (2, 3)
    assert parse_resources({"trainer": {"processes": 2}}).trainer_nodes == 1


def test_a_further_hosts_share_takes_its_free_gpus_or_waits():
    resources = parse_resources({"trainer": {"nodes": 2, "gpus_per_node": 2}})
    share = node_plan(resources=resources, inventory=["0", "1", "2"], busy={"0"}, host="b", worker="w@b")
    assert share == {"host": "b", "worker": "w@b", "gpus": ["1", "2"], "processes": 2}
    waiting = node_plan(
        resources=resources, inventory=["0", "1", "2"], busy={"0", "1"}, host="b", worker="w@b"
    )
    assert isinstance(waiting, Waiting) and "1 of 3 free on b" in waiting.reason
    with pytest.raises(Unplaceable, match="fewer than gpus_per_node 2"):
        node_plan(resources=resources, inventory=["0"], busy=set(), host="b", worker="w@b")
    cpu = parse_resources({"trainer": {"nodes": 2, "processes_per_node": 2}})
    assert node_plan(resources=cpu, inventory=[], busy=set(), host="c", worker="w@c")["processes"] == 2


def test_every_host_runs_the_same_rendezvous_and_only_the_first_hosts_the_store():
    module = ["-m", "trainer", "train", "--config", "RUN.yaml"]
    first = Rendezvous(nodes=2, endpoint="10.0.0.1:29400", run_id="run-7-1", hosts_store=True)
    argv, env, launcher = trainer_command(
        {"gpus": ["0", "1"], "processes": 2}, module, python="py", rendezvous=first
    )
    assert argv[:3] == ["py", "-m", "torch.distributed.run"] and argv[-5:] == module
    flags = dict(zip(argv[3:-5:2], argv[4:-5:2], strict=True))
    assert flags == {
        "--nnodes": "2",
        "--nproc-per-node": "2",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "10.0.0.1:29400",
        "--rdzv-id": "run-7-1",
        "--rdzv-conf": "is_host=1",
    }
    assert "--standalone" not in argv and env == {"CUDA_VISIBLE_DEVICES": "0,1"} and "c10d" in launcher
    other = Rendezvous(nodes=2, endpoint="10.0.0.1:29400", run_id="run-7-1", hosts_store=False)
    argv, _, _ = trainer_command({"processes": 1}, module, python="py", rendezvous=other)
    assert "is_host=0" in argv and argv[argv.index("--nproc-per-node") + 1] == "1"


@pytest.mark.django_db
def test_the_first_host_reads_a_failed_a_silent_and_a_missing_host(django_user_model, settings):
    settings.GRPO_NODE_LOST_AFTER_S = 30
    settings.GRPO_NODE_JOIN_TIMEOUT_S = 300
    owner = django_user_model.objects.create_user(username="nodes")
    now = timezone.now()
    run = Run.objects.create(
        owner=owner,
        name="n",
        config={},
        config_sha256="0" * 64,
        attempt=1,
        status="running",
        worker_host="host-a",
        launched_at=now,
        heartbeat_at=now,
    )
    row = RunNode.objects.create(run=run, attempt=1, index=1, host="host-b", worker="w@b")
    assert services.run_node_problem(run_id=run.pk, attempt=1) is None  # asked just now

    RunNode.objects.filter(pk=row.pk).update(asked_at=timezone.now() - timedelta(seconds=301))
    problem = services.run_node_problem(run_id=run.pk, attempt=1)
    assert (
        problem.kind == "missing"
        and "did not start its part within GRPO_NODE_JOIN_TIMEOUT_S" in problem.sentence
    )

    assert (
        services.run_node_begin(run_id=run.pk, attempt=1, index=1, worker="w@other") is None
    )  # not its part
    assert services.run_node_begin(run_id=run.pk, attempt=1, index=1, worker="w@b") is not None
    assert services.run_node_begin(run_id=run.pk, attempt=1, index=1, worker="w@b") is None  # once only
    assert services.run_node_heartbeat(run_id=run.pk, attempt=1, index=1, pid=42) == "running"
    assert services.run_node_heartbeat(run_id=run.pk, attempt=2, index=1) is None  # another attempt's
    assert services.run_node_problem(run_id=run.pk, attempt=1) is None

    RunNode.objects.filter(pk=row.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=31))
    problem = services.run_node_problem(run_id=run.pk, attempt=1)
    assert problem.kind == "lost"
    assert problem.sentence.startswith(
        "host host-b (node 1, worker w@b) lost: its worker sent no heartbeat for 31 s"
    )
    assert not services.run_nodes_ended(run_id=run.pk, attempt=1)

    services.run_node_end(
        run_id=run.pk, attempt=1, index=1, exit_code=1, reason="trainer exited with status 1: boom"
    )
    assert services.run_node_problem(run_id=run.pk, attempt=1) == services.NodeProblem(
        "failed", "host host-b (node 1, worker w@b) failed: trainer exited with status 1: boom"
    )
    assert services.run_nodes_ended(run_id=run.pk, attempt=1)
    services.run_node_end(run_id=run.pk, attempt=1, index=1, exit_code=0)
    assert RunNode.objects.get(pk=row.pk).status == RunNodeStatus.EXITED
    assert services.run_node_problem(run_id=run.pk, attempt=1) is None
