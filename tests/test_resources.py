"""The run document's ``resources`` block: validation (400s naming the field), placement on a worker's
GPUs (pure), the worker's GPU inventory, and the form carrying the block.

The live placement (real Celery workers with a declared inventory, real runs) is
``tests/test_placement_live.py``.
"""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from controlplane.runs import services
from controlplane.runs.placement import Unplaceable, Waiting, placement_plan
from controlplane.runs.validation import run_document_validate
from controlplane.runs.worker_hosts import worker_host_register
from trainer.config.resources import parse_resources, resources_errors
from trainer.config.run_config import RunConfigError, validate_run_document
from worker.inventory import parse_gpu_list
from worker.launch import vllm_placement_flags

BASE = {
    "model": "tiny",
    "train_dataset": "arithmetic-small",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {"max_steps": 2, "max_completion_length": 128},
}


def doc_with(resources) -> dict:
    return {**BASE, "resources": resources}


def errors_of(document) -> dict[str, str]:
    with pytest.raises(RunConfigError) as caught:
        run_document_validate(document=document)
    return caught.value.errors


@pytest.mark.parametrize(
    ("resources", "field", "words"),
    [
        ({"vllm": {"gpus": 4, "tensor_parallel_size": 2}}, "resources.vllm.gpus", "2 × 1 = 2"),
        ({"vllm": {"gpus": 0}}, "resources.vllm.gpus", "integer >= 1"),
        ({"vllm": {"gpu_memory_utilization": 1.5}}, "resources.vllm.gpu_memory_utilization", "(0, 1]"),
        ({"vllm": {"max_model_len": 8}}, "resources.vllm.max_model_len", ">= 16"),
        ({"vllm": {"tp": 2}}, "resources.vllm.tp", "allowed: gpus, tensor_parallel_size"),
        ({"trainer": {"gpus": 2, "processes": 2}}, "resources.trainer", "not both"),
        ({"trainer": {"processes": "two"}}, "resources.trainer.processes", "integer >= 1"),
        ({"server": "x", "vllm": {"gpus": 1}}, "resources.vllm", "remove one"),
        ({"gpu": 1}, "resources.gpu", "allowed: vllm, trainer, server, pool"),
        ("4 GPUs", "resources", "must be a mapping"),
    ],
)
def test_malformed_resources_are_refused_naming_the_field(resources, field, words):
    with pytest.raises(RunConfigError) as caught:
        validate_run_document(doc_with(resources))
    assert field in caught.value.errors, caught.value.errors
    assert words in caught.value.errors[field]


def test_defaults_follow_the_kind_of_worker():
    plain = parse_resources(None)
    assert (plain.vllm_gpus_on(gpu_host=True), plain.trainer_gpus_on(gpu_host=True)) == (1, 1)
    assert plain.gpus_on(gpu_host=False) == 0 and plain.trainer_processes_on(gpu_host=False) == 1
    parallel = parse_resources({"vllm": {"tensor_parallel_size": 2, "data_parallel_size": 2}})
    assert parallel.vllm_gpus_on(gpu_host=True) == 4 and parallel.explicit_gpus() == 4
    named = parse_resources({"server": "fleet", "trainer": {"gpus": 3}})
    assert named.gpus_on(gpu_host=True) == 3 and named.trainer_processes_on(gpu_host=True) == 3
    assert parse_resources({"trainer": {"processes": 2}}).trainer_processes_on(gpu_host=False) == 2
    assert resources_errors({"vllm": {"gpus": 2, "data_parallel_size": 2}}) == {}


def test_placement_gives_vllm_and_the_trainer_disjoint_free_gpus():
    wanted = parse_resources({"vllm": {"gpus": 1}, "trainer": {"gpus": 2}})
    plan = placement_plan(resources=wanted, inventory=["0", "1", "2", "3"], busy=set(), host="h", worker="w")
    assert plan["vllm"]["gpus"] == ["0"] and plan["trainer"]["gpus"] == ["1", "2"]
    assert plan["trainer"]["processes"] == 2 and plan["gpus"] == ["0", "1", "2"]
    later = placement_plan(resources=wanted, inventory=["0", "1", "2", "3"], busy={"0"}, host="h", worker="w")
    assert later["vllm"]["gpus"] == ["1"] and later["trainer"]["gpus"] == ["2", "3"]
    waiting = placement_plan(
        resources=wanted, inventory=["0", "1", "2", "3"], busy={"1", "2"}, host="h", worker="w"
    )
    assert waiting == Waiting("waiting for 3 GPUs: 2 of 4 free on h")
    with pytest.raises(Unplaceable, match="needs 5 GPUs .* has 4"):
        placement_plan(
            resources=parse_resources({"vllm": {"gpus": 1}, "trainer": {"gpus": 4}}),
            inventory=["0", "1", "2", "3"],
            busy=set(),
            host="h",
            worker="w",
        )
    with pytest.raises(Unplaceable, match="has none"):
        placement_plan(resources=wanted, inventory=[], busy=set(), host="h", worker="w")
    cpu = placement_plan(
        resources=parse_resources({"trainer": {"processes": 2}}),
        inventory=[],
        busy=set(),
        host="h",
        worker="w",
    )
    assert cpu["gpus"] == [] and cpu["trainer"] == {"gpus": [], "processes": 2, "ranks": []}


def test_vllm_flags_carry_the_parallel_sizes_memory_and_context():
    place = {
        "tensor_parallel_size": 2,
        "data_parallel_size": 2,
        "gpu_memory_utilization": 0.8,
        "max_model_len": 4096,
    }
    assert vllm_placement_flags(place, default=["--max-model-len", "1024"]) == [
        "--max-model-len",
        "4096",
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
        "--gpu-memory-utilization",
        "0.8",
    ]
    assert vllm_placement_flags({"tensor_parallel_size": 1}, default=["--max-model-len", "1024"]) == [
        "--max-model-len",
        "1024",
    ]


def test_gpu_inventory_lists():
    assert parse_gpu_list("0, 1,2") == ["0", "1", "2"]
    assert parse_gpu_list("none") == [] and parse_gpu_list("") == [] and parse_gpu_list("-1") == []
    assert parse_gpu_list("GPU-5f3a,GPU-77b1") == ["GPU-5f3a", "GPU-77b1"]
    with pytest.raises(ValueError, match="twice"):
        parse_gpu_list("0,0")


@pytest.mark.django_db
def test_the_api_refuses_what_no_worker_can_meet_and_unknown_servers_and_pools(settings):
    settings.GRPO_RUN_POOLS = ["gpu", "h200"]
    settings.GRPO_VLLM_SERVERS = {"fleet": "http://vllm:8000"}
    settings.GRPO_RUNS_QUEUE = "gpu"
    worker_host_register(name="h200@a", host="a", queues=["h200"], gpus=["0", "1", "2", "3"], cpus=64)
    worker_host_register(name="gpu@b", host="b", queues=["gpu"], gpus=["0", "1"], cpus=16)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username="placer"))

    def post(resources) -> tuple[int, dict]:
        response = client.post("/api/v1/runs/", {"config": doc_with(resources)}, format="json")
        return response.status_code, response.json()

    status, body = post({"pool": "h200", "vllm": {"gpus": 1}, "trainer": {"gpus": 4}})
    assert status == 400 and "resources.trainer.gpus" in body["config"], body
    assert "asks for 5 GPUs" in body["config"]["resources.trainer.gpus"]
    assert "pool 'h200' has 4" in body["config"]["resources.trainer.gpus"]
    status, body = post(
        {"vllm": {"tensor_parallel_size": 2, "data_parallel_size": 2}}
    )  # default pool: 2 GPUs
    assert status == 400 and "resources.vllm.gpus" in body["config"], body
    status, body = post({"vllm": {"gpus": 2, "tensor_parallel_size": 1}})
    assert status == 400 and "2 × 1" not in str(body) and "1 × 1 = 1" in body["config"]["resources.vllm.gpus"]
    status, body = post({"server": "elsewhere"})
    assert status == 400 and "registered: fleet" in body["config"]["resources.server"]
    status, body = post({"pool": "tpu"})
    assert status == 400 and "pools: gpu, h200" in body["config"]["resources.pool"]
    status, body = post({"vllm": {"servers": ["fleet", "elsewhere", "nowhere"]}})
    message = body["config"]["resources.vllm.servers"]
    assert (
        status == 400
        and "'elsewhere', 'nowhere' are not registered" in message
        and "fleet" not in message.split(";")[0]
    )
    bad_url = {**BASE, "args": {**BASE["args"], "vllm_server_base_url": "http://vllm:8000"}}
    response = client.post("/api/v1/runs/", {"config": bad_url}, format="json")
    assert "resources.server" in response.json()["config"]["args.vllm_server_base_url"]
    # What fits passes (checked without creating a run: no worker consumes these pools here).
    fits = doc_with({"pool": "h200", "vllm": {"gpus": 1}, "trainer": {"gpus": 3}})
    assert run_document_validate(document=fits) == fits
    assert run_document_validate(document=doc_with({"server": "fleet", "trainer": {"gpus": 2}}))
    settings.GRPO_VLLM_SERVERS = {"fleet": "http://vllm:8000", "fleet-b": "http://vllm-b:8000"}
    assert run_document_validate(document=doc_with({"vllm": {"servers": ["fleet", "fleet-b"]}}))


@pytest.mark.django_db
def test_what_no_host_can_meet_is_refused_before_any_worker_registers(settings):
    """Issue 29 item 7: with no worker registered, 10**18 trainer GPUs, a 2**62-token context and a
    million processes were accepted (the worker refused them at claim time, or never ran them)."""
    settings.GRPO_RUN_POOLS = ["fresh"]
    settings.GRPO_RUNS_QUEUE = "fresh"

    def refused(resources: dict) -> dict[str, str]:
        try:
            run_document_validate(document=doc_with(resources))
        except RunConfigError as exc:
            return exc.errors
        return {}

    errors = refused({"trainer": {"gpus": 10**18}})
    assert "GRPO_MAX_RUN_GPUS" in errors["resources.trainer.gpus"], errors
    errors = refused({"vllm": {"gpus": 2**31, "tensor_parallel_size": 2**31}})
    assert "GRPO_MAX_RUN_GPUS" in errors["resources.vllm.gpus"], errors
    errors = refused({"vllm": {"max_model_len": 2**62}})
    assert "GRPO_MAX_MODEL_LEN" in errors["resources.vllm.max_model_len"], errors
    errors = refused({"trainer": {"processes": 10**6}})
    assert "GRPO_MAX_TRAINER_PROCESSES" in errors["resources.trainer.processes"], errors
    assert not refused({"vllm": {"gpus": 2, "tensor_parallel_size": 2}, "trainer": {"gpus": 4}})
    assert not refused({"trainer": {"processes": 8}, "vllm": {"max_model_len": 32768}})
    # Once a host registers, its CPUs bound the processes, on a GPU host too.
    worker_host_register(name="fresh@a", host="a", queues=["fresh"], gpus=["0", "1"], cpus=8)
    errors = refused({"trainer": {"processes": 12}})
    assert "has 8 CPUs" in errors["resources.trainer.processes"], errors
    assert not refused({"trainer": {"processes": 8}})


@pytest.mark.django_db
def test_the_form_carries_the_resources_block(client, django_user_model, settings):
    settings.GRPO_VLLM_SERVERS = {"fleet": "http://vllm:8000"}
    user = django_user_model.objects.create_user("former", password="pw")
    client.force_login(user)
    page = client.get("/runs/new/").content.decode()
    assert 'id="field-resources"' in page and "Named servers: fleet" in page
    form = {
        "name": "with resources",
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "resources": '{"server": "nowhere"}',
    }
    response = client.post("/runs/new/", form)
    assert response.status_code == 400
    assert "not a registered vLLM server" in response.content.decode()
