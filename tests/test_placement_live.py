"""Placement through the real stack: Celery workers that announce their GPUs, runs created over REST,
the supervisor giving each child its devices, ``torch.distributed.run`` trainers on CPU (gloo).

* A worker with a declared inventory (``GRPO_WORKER_GPUS=0,1,2,3``, its own pool/queue): two runs
  needing 3 GPUs each run one after the other (the second waits as ``queued`` with the reason),
  two runs needing 2 each run side by side on disjoint GPUs, a run needing 5 is refused at
  creation. What each child got (``CUDA_VISIBLE_DEVICES``, the launcher, every rank) is read back
  from the run's placement and events.

CPU workers on operator-named servers (:func:`cpu_pool`): two DDP processes over gloo, one on each of
two hosts, and a second run waiting for a named server, in tests/test_nodes.py; a named server killed
mid-run in tests/test_several_servers.py.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from controlplane.runs import services
from controlplane.runs.models import ACTIVE_STATUSES, MetricPoint, Run, RunEvent, RunStatus
from tests.conftest import VLLM_PORT_BASE, start_celery_worker
from worker.processes import group_members, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

INVENTORY = "0,1,2,3"


def run_doc(resources: dict, *, max_steps: int = 2, **args) -> dict:
    return {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "resources": resources,
        "args": {
            "max_steps": max_steps,
            "num_generations": 4,
            "max_completion_length": 12,
            "learning_rate": 1e-3,
            "token_budget": 256,
            "max_samples_per_row": 16,  # small steps: placement is under test, not the batch
            "save_strategy": "no",
            "gradient_checkpointing": False,
            "dtype": "float32",
            "seed": 0,
            "disable_tqdm": True,
            **args,
        },
    }


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username="placement"))
    return client


def create(api: APIClient, doc: dict, name: str) -> int:
    response = api.post("/api/v1/runs/", {"name": name, "config": doc}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def wait_first_step(run_id: int) -> Run:
    """Wait until the run has logged its first step (or ended); the run, which must still be live."""
    wait_for(
        lambda: (
            MetricPoint.objects.filter(run_id=run_id, name="loss").exists()
            or Run.objects.get(pk=run_id).is_terminal
        ),
        timeout_s=300,
        what="the run's first step",
    )
    run = Run.objects.get(pk=run_id)
    assert not run.is_terminal, failure_report(run)
    return run


def events(run_id: int) -> str:
    return "\n".join(RunEvent.objects.filter(run_id=run_id).values_list("message", flat=True))


def failure_report(run: Run) -> str:
    """The failure reason, the run's events and its trainer logs' last lines (every rank's)."""
    logs = sorted(Path(run.output_dir).glob("logs/trainer.*.log")) if run.output_dir else []
    tails = [
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-120:]) for log in logs
    ]
    return "\n\n".join(
        [f"run {run.pk} {run.status}: {run.failure_reason}", "--- events\n" + events(run.pk)[-3000:], *tails]
    )


@pytest.fixture
def pool(tmp_path, settings):
    """A worker of its own pool announcing four GPUs (two concurrent runs), retrying placement every second."""
    queue = f"pool-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    runs_dir = tempfile.mkdtemp(prefix="grpo-placement-runs-")
    env = {
        "GRPO_WORKER_GPUS": INVENTORY,
        "GRPO_PLACEMENT_RETRY_S": "1",
        "GRPO_RUNS_DIR": runs_dir,
        "GRPO_VLLM_PORTS": f"{VLLM_PORT_BASE + 60}-{VLLM_PORT_BASE + 79}",
        "GRPO_RUN_HEARTBEAT_S": "1",
    }
    proc = start_celery_worker(queue, tmp_path / "pool-worker.log", concurrency=2, env=env)
    settings.GRPO_RUN_POOLS = [settings.GRPO_RUNS_QUEUE, queue]
    try:
        wait_for(lambda: _registered(queue), timeout_s=30, what="the pool worker's announcement")
        yield queue
    finally:
        for run in Run.objects.filter(status__in=(RunStatus.QUEUED, *ACTIVE_STATUSES)):
            services.run_stop(run=run)
        wait_for(
            lambda: not Run.objects.filter(status__in=ACTIVE_STATUSES).exists(),
            timeout_s=60,
            what="runs to stop",
        )
        proc.stop(grace_s=15)


def _registered(queue: str) -> bool:
    from controlplane.runs.models import WorkerHost

    return WorkerHost.objects.filter(name__startswith=f"{queue}@", gpus=INVENTORY.split(",")).exists()


def test_runs_of_three_gpus_take_turns_and_the_children_get_disjoint_devices(api, pool):
    three = {"pool": pool, "vllm": {"gpus": 1}, "trainer": {"gpus": 2}}
    first = create(api, run_doc(three), "three gpus, first")
    wait_for(
        lambda: Run.objects.get(pk=first).status != RunStatus.QUEUED,
        timeout_s=60,
        what="the first run's claim",
    )
    second = create(api, run_doc(three), "three gpus, second")
    wait_for(
        lambda: Run.objects.get(pk=second).waiting_reason != "", timeout_s=60, what="the second run to wait"
    )
    waiting = Run.objects.get(pk=second)
    assert waiting.status == RunStatus.QUEUED
    assert waiting.waiting_reason.startswith("waiting for 3 GPUs: 1 of 4 free on "), waiting.waiting_reason
    page_run = api.get(f"/api/v1/runs/{second}/").json()
    assert page_run["waiting_reason"] == waiting.waiting_reason
    # The second is never live while the first is.
    overlap = []

    def first_done() -> bool:
        a, b = Run.objects.get(pk=first), Run.objects.get(pk=second)
        if a.is_active and b.is_active:
            overlap.append((a.status, b.status))
        return a.is_terminal

    wait_for(first_done, timeout_s=420, what="the first run to end")
    run = Run.objects.get(pk=first)
    assert run.status == RunStatus.COMPLETED, (run.failure_reason, events(first)[-3000:])
    assert not overlap, overlap
    placement = run.placement
    assert placement["vllm"]["gpus"] == ["0"] and placement["trainer"]["gpus"] == ["1", "2"]
    assert placement["vllm"]["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert placement["trainer"]["env"] == {"CUDA_VISIBLE_DEVICES": "1,2"}
    assert "--nproc-per-node 2" in placement["trainer"]["launcher"]
    ranks = placement["trainer"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    assert all(r["cuda_visible_devices"] == "1,2" and r["world_size"] == 2 for r in ranks), ranks
    text = events(first)
    assert "vllm environment: CUDA_VISIBLE_DEVICES=0" in text
    assert "trainer environment: CUDA_VISIBLE_DEVICES=1,2" in text and "trainer ranks: rank 0" in text
    steps = sorted(MetricPoint.objects.filter(run_id=first, name="loss").values_list("step", flat=True))
    assert steps == [1, 2]
    # Then the second is placed, on the GPUs the first gave back.
    wait_for(
        lambda: Run.objects.get(pk=second).status != RunStatus.QUEUED, timeout_s=60, what="the second claim"
    )
    later = Run.objects.get(pk=second)
    assert later.placement["gpus"] == ["0", "1", "2"] and later.waiting_reason == ""
    claimed = RunEvent.objects.filter(run_id=second, message__startswith="starting").first()
    assert claimed.created_at >= run.finished_at


def test_runs_of_two_gpus_run_side_by_side_and_five_are_refused(api, pool):
    response = api.post(
        "/api/v1/runs/",
        {"config": run_doc({"pool": pool, "vllm": {"gpus": 1}, "trainer": {"gpus": 4}})},
        format="json",
    )
    assert response.status_code == 400
    assert "the run asks for 5 GPUs" in response.json()["config"]["resources.trainer.gpus"]
    two = {"pool": pool, "vllm": {"gpus": 1}, "trainer": {"gpus": 1}}
    ids = [create(api, run_doc(two), f"two gpus {i}") for i in range(2)]

    def both_live() -> bool:
        return all(Run.objects.get(pk=i).is_active for i in ids)

    wait_for(both_live, timeout_s=90, what="both runs to be placed together")
    placements = [Run.objects.get(pk=i).placement for i in ids]
    held = [set(p["gpus"]) for p in placements]
    assert not held[0] & held[1] and held[0] | held[1] == {"0", "1", "2", "3"}, placements
    for p in placements:
        assert len(p["vllm"]["gpus"]) == 1 and len(p["trainer"]["gpus"]) == 1
        assert p["vllm"]["gpus"] != p["trainer"]["gpus"]
    # Stopped while their vLLM servers start: each run ends ``stopped`` with no process of its own left
    # (the per-run server's stop; tests/test_runs_live.py stops a run on a named server).
    wait_for(lambda: all(Run.objects.get(pk=i).vllm_pid for i in ids), timeout_s=60, what="both vLLM starts")
    for i in ids:
        services.run_stop(run=Run.objects.get(pk=i))
    wait_for(lambda: all(Run.objects.get(pk=i).is_terminal for i in ids), timeout_s=90, what="both stops")
    for i in ids:
        run = Run.objects.get(pk=i)
        assert run.status == RunStatus.STOPPED, failure_report(run)
        left = [g for g in (run.vllm_pid, run.trainer_pid) if g and group_members(g)]
        assert left == [], f"processes of stopped run {i} are left in groups {left}"


@contextlib.contextmanager
def cpu_pool(
    tmp_path: Path,
    settings,
    servers: dict[str, str],
    *,
    name: str,
    hosts: tuple[str | None, ...] = (None,),
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, dict]]:
    """CPU workers (no GPUs) of a pool of their own, one per entry of ``hosts`` (its
    ``GRPO_WORKER_HOST``; None: the machine's name), whose operator registered ``servers`` ({name:
    URL}); yields ``(queue, {host: worker process})``; stops what runs on it, then the workers."""
    queue = f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    common = {
        "GRPO_WORKER_GPUS": "none",
        "GRPO_VLLM_SERVERS": ",".join(f"{server}={url}" for server, url in servers.items()),
        "GRPO_PLACEMENT_RETRY_S": "1",
        "GRPO_RUNS_DIR": tempfile.mkdtemp(prefix=f"grpo-{name}-runs-"),  # one folder: hosts share it
        **(env or {}),
    }
    workers = {}
    try:
        for host in hosts:
            workers[host] = start_celery_worker(
                queue,
                tmp_path / f"{name}-{host or 'worker'}.log",
                concurrency=2,
                env={**common, **({"GRPO_WORKER_HOST": host} if host else {})},
                name=f"{queue}-{host}@%h" if host else None,
            )
        settings.GRPO_RUN_POOLS = [settings.GRPO_RUNS_QUEUE, queue]
        settings.GRPO_VLLM_SERVERS = dict(servers)
        yield queue, workers
    finally:
        for run in Run.objects.filter(status__in=(RunStatus.QUEUED, *ACTIVE_STATUSES)):
            services.run_stop(run=run)
        for proc in workers.values():
            proc.stop(grace_s=15)
