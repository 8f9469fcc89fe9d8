"""Accepted means it runs (issue 28, items 1 and 3): the checks a run's launch makes, made when the run
is created (controlplane/runs/launch_checks.py), and the per-run server's max_model_len fitted to the
run. Real Postgres (pytest-django); named vLLM servers are HTTP stand-ins in this process (no vLLM
is started); the tiny model and the built-in datasets are the real ones.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.contrib.auth import get_user_model
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from controlplane.runs import services
from controlplane.runs.launch_checks import EPOCH_RUN_STEPS, per_run_max_model_len, process_state_kept
from controlplane.runs.models import Run, RunEvent, RunStatus
from controlplane.runs.placement import placement_plan
from controlplane.runs.validation import CONTROLLED_ARGS, RESUME_ARGS
from controlplane.runs.worker_hosts import worker_host_register
from tests.test_runs_api import api_for, make_user
from trainer.config.resources import parse_resources
from trainer.config.run_config import RunConfigError, validate_run_document
from trainer.config.run_lengths import run_prompt_lengths
from trainer.config.run_schema import FIELDS
from worker.launch import vllm_placement_flags

pytestmark = pytest.mark.django_db

REWARD = "trainer.rewards.accuracy_reward"
# The README's REST example before issue 28: accepted with 201, failed ~90 s later in vLLM.
README_BEFORE = {
    "model": "tiny",
    "train_dataset": "arithmetic",
    "reward_funcs": [REWARD],
    "args": {"max_steps": 50},
}
TINY_DATASETS = ("arithmetic", "arithmetic-small", "arithmetic-unseen", "arithmetic-levels")


def doc(**args) -> dict:
    return {"model": "tiny", "train_dataset": "arithmetic-small", "reward_funcs": [REWARD], "args": args}


def refused(document: dict) -> dict[str, str]:
    with pytest.raises(RunConfigError) as caught:
        services.run_config_validate(config=document)
    return caught.value.errors


@pytest.fixture
def tiny_dir() -> str:
    from trainer.tiny.build import current_builds

    builds = current_builds(0)
    assert builds, "no build of the tiny model's sources (tests/test_tiny.py says how to rebuild)"
    return str(builds[0])


@contextlib.contextmanager
def stand_in_server(*, models: list[dict], server_info: dict | None = None) -> Iterator[str]:
    """An HTTP stand-in for a vLLM server's /v1/models and /server_info; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/v1/models":
                body, status = json.dumps({"object": "list", "data": models}).encode(), 200
            elif self.path.startswith("/server_info") and server_info is not None:
                body, status = json.dumps(server_info).encode(), 200
            else:
                body, status = b'{"detail":"Not Found"}', 404
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            """Quiet: the test's output stays readable (http.server logs every request to stderr)."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------- at creation
def test_the_readme_example_before_issue_28_is_refused_in_one_line_naming_field_limit_and_source():
    response = api_for(make_user("ci")).post("/api/v1/runs/", {"config": README_BEFORE}, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()["config"]
    assert list(errors) == ["args.max_completion_length"], errors
    message = errors["args.max_completion_length"]
    assert "\n" not in message and message.startswith("2048 tokens plus the longest prompt"), message
    assert "1024-token limit" in message and "comes from the model 'tiny'" in message, message
    assert "sample of 2000 of 4000 rows" in message  # GRPO_PREFLIGHT_SAMPLE_ROWS < the dataset's rows
    assert not Run.objects.exists()


def test_the_readme_example_now_trains_on_tiny_and_is_accepted():
    readme = {**README_BEFORE, "args": {"max_steps": 50, "max_completion_length": 128}}
    response = api_for(make_user("ci")).post("/api/v1/runs/", {"config": readme}, format="json")
    assert response.status_code == 201, response.content


def test_a_whole_dataset_measured_says_no_sample_and_the_limit_is_exact(settings):
    errors = refused(doc(max_completion_length=1020))
    message = errors["args.max_completion_length"]
    assert "sample" not in message and "the longest prompt (" in message, message
    longest = int(message.split("the longest prompt (", 1)[1].split(" ", 1)[0])
    assert f"set max_completion_length to at most {1024 - longest}" in message
    services.run_config_validate(config=doc(max_completion_length=1024 - longest))  # exactly fits


def test_token_budget_must_hold_one_prompt_and_one_full_completion():
    errors = refused(doc(max_completion_length=128, token_budget=100))
    assert list(errors) == ["args.token_budget"], errors
    assert "cannot hold one prompt and one full completion" in errors["args.token_budget"]
    services.run_config_validate(config=doc(max_completion_length=128, token_budget=256))


def test_the_trainers_own_config_rules_are_refused_by_field():
    """TrainingArguments' rules between fields (AsyncGRPOConfig built as the trainer builds it) and
    the Trainer's own refusals at start (no evaluation set, FSDP on one process)."""
    errors = refused(doc(max_completion_length=64, dataloader_prefetch_factor=2))
    assert "dataloader_num_workers" in errors["args.dataloader_prefetch_factor"], errors
    assert "args.eval_strategy" in refused(doc(max_completion_length=64, eval_strategy="steps"))
    assert "args.save_strategy" in refused(doc(max_completion_length=64, save_strategy="best"))
    assert "args.fsdp" in refused(doc(max_completion_length=64, fsdp="full_shard"))
    env_only = {"model": "tiny", "environment_factory": "acme.Env", "reward_funcs": [REWARD]}
    from trainer.config.run_config import run_document_errors

    assert "args.max_steps" in run_document_errors(env_only)


def test_gpu_only_options_are_left_to_a_gpu_pool_and_refused_for_a_cpu_one(settings):
    settings.GRPO_RUNS_QUEUE = "gpu"
    bf16 = doc(max_completion_length=64, bf16=True)
    worker_host_register(name="cpu@a", host="a", queues=["gpu"], gpus=[], cpus=2)
    assert "args.bf16" in refused(bf16)  # this host has no CUDA device, nor has the pool
    worker_host_register(name="gpu@b", host="b", queues=["gpu"], gpus=["0", "1"], cpus=16)
    services.run_config_validate(config=bf16)  # the worker judges it


def test_vllm_start_refusals_are_made_at_creation():
    errors = refused(
        {
            **doc(max_completion_length=64),
            "resources": {"vllm": {"max_model_len": 4096, "tensor_parallel_size": 4}},
        }
    )
    assert "limit of the model 'tiny', 2048 tokens" in errors["resources.vllm.max_model_len"], errors
    assert "does not divide the 2 attention heads" in errors["resources.vllm.tensor_parallel_size"], errors
    small = {**doc(max_completion_length=300), "resources": {"vllm": {"max_model_len": 256}}}
    message = refused(small)["args.max_completion_length"]
    assert "256-token limit" in message and "comes from resources.vllm.max_model_len" in message, message


def test_a_dataset_without_prompts_is_refused_and_a_large_one_is_sampled(settings, tmp_path):
    settings.GRPO_ALLOWED_DATASET_ROOTS = [str(tmp_path)]
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question": f"{i}+{i}?"}) + "\n" for i in range(5)))
    errors = refused(
        {
            **doc(max_completion_length=64),
            "train_dataset": str(questions),
            "reward_funcs": ["trainer.rewards.boxed_format_reward"],
        }
    )
    assert "no 'prompt' column" in errors["train_dataset"] and "dataset_columns" in errors["train_dataset"]
    settings.GRPO_PREFLIGHT_SAMPLE_ROWS = 100
    message = refused(doc(max_completion_length=1020))["args.max_completion_length"]
    assert "a sample of 100 of 256 rows" in message, message


def test_a_hub_model_not_in_the_local_cache_is_not_refused_nor_fetched(settings, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a fetch would fail: none is tried
    settings.GRPO_ALLOWED_HUB_MODELS = ["acme/*"]
    services.run_config_validate(config={**doc(), "model": "acme/not-downloaded"})  # 2048: not known here


def test_a_named_server_is_read_for_its_context_and_its_model(settings, tiny_dir, tmp_path):
    with stand_in_server(models=[{"id": tiny_dir, "root": tiny_dir, "max_model_len": 512}]) as url:
        settings.GRPO_VLLM_SERVERS = {"fleet": url}
        named = {**doc(max_completion_length=600), "resources": {"server": "fleet"}}
        message = refused(named)["args.max_completion_length"]
        assert "512-token limit of the vLLM server 'fleet'" in message, message
        services.run_config_validate(config={**named, "args": {"max_completion_length": 128}})
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32})
    )
    with stand_in_server(models=[{"id": str(other), "root": str(other), "max_model_len": 4096}]) as url:
        settings.GRPO_VLLM_SERVERS = {"fleet": url}
        errors = refused({**doc(max_completion_length=128), "resources": {"server": "fleet"}})
        assert "a different model from the run's 'tiny'" in errors["resources.server"], errors
    # Not answering is not a refusal: the operator may start it after the run is queued.
    settings.GRPO_VLLM_SERVERS = {"fleet": "http://127.0.0.1:9"}
    services.run_config_validate(config={**doc(max_completion_length=128), "resources": {"server": "fleet"}})


def test_lora_adapter_slots_are_checked_as_the_trainer_checks_them(settings, tiny_dir):
    lora = {**doc(max_completion_length=64, max_staleness=4), "peft_config": {"r": 8}}
    info = {
        "vllm_config": {"lora_config": {"max_loras": 2, "max_lora_rank": 16}},
        "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    }
    with stand_in_server(models=[{"id": tiny_dir, "max_model_len": 1024}], server_info=info) as url:
        settings.GRPO_VLLM_SERVERS = {"fleet": url}
        errors = refused({**lora, "resources": {"server": "fleet"}})
        assert "max_staleness + 2 = 6 LoRA adapter slots" in errors["args.max_staleness"], errors
        assert "--max-loras 2" in errors["args.max_staleness"]
        fits = {
            **lora,
            "args": {"max_completion_length": 64, "max_staleness": 0},
            "resources": {"server": "fleet"},
        }
        services.run_config_validate(config=fits)
    settings.GRPO_VLLM_EXTRA_ARGS = "--enable-lora --max-loras 3 --max-lora-rank 8"
    errors = refused({**lora, "peft_config": {"r": 16}})
    assert "GRPO_VLLM_EXTRA_ARGS" in errors["args.max_staleness"] and "peft_config.r" in errors, errors


# ---------------------------------------------------------------------------------- at launch
def test_the_per_run_server_follows_the_runs_lengths(tiny_dir):
    whole = per_run_max_model_len(
        document=doc(max_completion_length=128), model_dir=tiny_dir, dataset="arithmetic-small"
    )
    assert whole.tokens == 256 and "multiple of 256" in whole.reason, whole  # ~20 + 128, rounded up
    sampled = {**doc(max_completion_length=128), "train_dataset": "arithmetic"}
    plan = per_run_max_model_len(document=sampled, model_dir=tiny_dir, dataset="arithmetic")
    assert plan.tokens == 1024 and "not every prompt was measured" in plan.reason, plan  # the former default
    tools = {**doc(max_completion_length=128), "tools": ["trainer.builtin_tools.add"]}
    plan = per_run_max_model_len(document=tools, model_dir=tiny_dir, dataset="arithmetic-small")
    assert plan.tokens == 1024 and "turns add to the context" in plan.reason, plan
    given = {**doc(), "resources": {"vllm": {"max_model_len": 768}}}
    assert per_run_max_model_len(document=given, model_dir=tiny_dir, dataset="arithmetic-small").tokens == 768


@pytest.mark.django_db(transaction=True)
def test_a_dataset_that_changed_since_creation_fails_the_launch_in_one_sentence(settings, tmp_path, tiny_dir):
    from worker.supervisor import AttemptEnded, RunSupervisor

    settings.GRPO_ALLOWED_DATASET_ROOTS = [str(tmp_path)]
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "solution": str(2 * i)}) + "\n" for i in range(8)
        )
    )
    config = {**doc(max_completion_length=900), "train_dataset": str(data)}
    run, _ = services.run_create(
        owner=get_user_model().objects.create_user("changer"), config=config, launch=False
    )
    Run.objects.filter(pk=run.pk).update(celery_task_id="t", launched_at=run.created_at)
    run = services.run_claim(run_id=run.pk, task_id="t", worker_host="launch-host")
    supervisor = RunSupervisor(run)
    supervisor._size_context(tiny_dir, str(data), run.config)
    assert supervisor.placement["vllm"]["max_model_len"] == 1024  # 900 + a short prompt, rounded up
    assert RunEvent.objects.filter(run_id=run.pk, message__startswith="vLLM max_model_len 1024: ").exists()
    long_prompt = "What is " + " + ".join(["12345"] * 60) + "?"
    data.write_text(json.dumps({"prompt": long_prompt, "solution": "0"}) + "\n")
    with pytest.raises(AttemptEnded) as ended:
        supervisor._size_context(tiny_dir, str(data), run.config)
    assert ended.value.status == RunStatus.FAILED
    reason = ended.value.reason
    assert "\n" not in reason and reason.startswith("args.max_completion_length: 900 tokens plus"), reason
    assert "comes from the model 'tiny'" in reason, reason


# ------------------------------------------------------------------------ the property (item 3)
def _value(name: str) -> st.SearchStrategy | None:
    """Values of ``args.<name>`` as the run schema declares them: its choices, its range, its JSON
    type; a type the schema leaves to the runtime, a free string or a mapping keeps its default."""
    spec = FIELDS[name]
    kinds = spec.kinds
    if kinds is None:
        return None
    options: list[st.SearchStrategy] = []
    if spec.choices:
        options.append(st.sampled_from(spec.choices))
    bounds = spec.range
    if bounds is not None and "int" in kinds:
        low = math.floor(bounds.low) + (1 if bounds.low_open and float(bounds.low).is_integer() else 0)
        options.append(st.integers(min_value=max(low, math.ceil(bounds.low)), max_value=int(bounds.high)))
        if bounds.also:
            options.append(st.sampled_from([int(v) for v in bounds.also]))
    elif bounds is not None and "float" in kinds:
        options.append(
            st.floats(
                min_value=bounds.low,
                max_value=bounds.high,
                exclude_min=bounds.low_open,
                allow_nan=False,
                allow_infinity=False,
            )
        )
    if "bool" in kinds:
        options.append(st.booleans())
    if spec.nullable:
        options.append(st.none())
    if not options and spec.default is not None:
        options.append(st.just(spec.default))
    return st.one_of(options) if options else None


ARG_VALUES = {
    name: strategy
    for name in sorted(FIELDS)
    if name not in (*CONTROLLED_ARGS, *RESUME_ARGS) and (strategy := _value(name)) is not None
}
# max_completion_length in its whole declared range, and often within the tiny model's context, so
# that the documents the checks accept are many.
COMPLETION = st.one_of(st.integers(min_value=1, max_value=1100), st.integers(min_value=1, max_value=2**20))
ARGS = st.tuples(
    st.lists(st.sampled_from(sorted(ARG_VALUES)), max_size=6, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: ARG_VALUES[n] for n in names})
    ),
    COMPLETION,
).map(lambda pair: {**pair[0], "max_completion_length": pair[1]})
DOCUMENTS = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "train_dataset": st.sampled_from(TINY_DATASETS),
        "reward_funcs": st.just([REWARD]),
        "args": ARGS,
    },
    optional={
        "resources": st.fixed_dictionaries(
            {"vllm": st.fixed_dictionaries({"max_model_len": st.integers(16, 4096)})}
        )
    },
)


@functools.cache
def _dataset(name: str):
    from trainer.plugins.registry import load_dataset_by_name

    return load_dataset_by_name(name)


@hypothesis_settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(document=DOCUMENTS)
def test_a_document_the_validation_accepts_passes_the_trainers_and_the_launchs_checks(
    document, tiny_dir, tmp_path
):
    """Random run documents on the tiny model, every args field within its declared type and range:
    whatever the web accepts builds its AsyncGRPOConfig and its AsyncGRPOTrainer (the trainer's
    own checks, the model loaded with its init kwargs; no vLLM), gets a per-run vLLM context that
    holds its longest prompt and a full completion within the model's limit, has a token budget
    that holds them too, and is placed on a CPU worker with that --max-model-len."""
    try:
        services.run_config_validate(config=document)
    except RunConfigError as exc:
        event("refused: " + ", ".join(sorted(exc.errors))[:60])
        return
    event("accepted")
    from trainer.plugins.registry import resolve_callable
    from trainer.trainer import AsyncGRPOTrainer

    with process_state_kept():
        spec = validate_run_document(document, output_dir=str(tmp_path / "out"))
        # as trainer.processes.cli.build_trainer builds it from the worker's launch document (the model's local
        # directory), with the dataset loaded once per test process
        trainer = AsyncGRPOTrainer(
            model=tiny_dir,
            reward_funcs=[resolve_callable(p) for p in spec.reward_funcs],
            args=spec.args,
            train_dataset=_dataset(document["train_dataset"]),
        )
        # what train() sets up first: the optimizer and its schedule
        steps = spec.args.max_steps if spec.args.max_steps > 0 else EPOCH_RUN_STEPS
        trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    plan = per_run_max_model_len(document=document, model_dir=tiny_dir, dataset=document["train_dataset"])
    prompts = run_prompt_lengths(model_dir=tiny_dir, dataset=document["train_dataset"], sample_rows=10**6)
    needed = prompts.longest + spec.args.max_completion_length
    assert needed <= plan.tokens <= 2048, (plan, prompts)  # vLLM neither refuses nor clamps; it starts
    if spec.args.token_budget is not None:
        assert spec.args.token_budget >= needed
    place = placement_plan(
        resources=parse_resources(document.get("resources")), inventory=[], busy=set(), host="h", worker="w"
    )
    flags = vllm_placement_flags({**place["vllm"], "max_model_len": plan.tokens}, default=[])
    assert flags[:2] == ["--max-model-len", str(plan.tokens)]


def test_checks_run_one_at_a_time_in_a_process_and_valid_documents_pass_from_many_threads(monkeypatch):
    """Daphne runs each request in its own thread, and the checks change process-wide state (the
    environment, accelerate's state, torch's threads) and import transformers lazily: two at once
    gave a valid document a 400 in CI ("module 'transformers' has no attribute
    'PreTrainedTokenizerBase'"). The overlap is counted with the trainer-config check wrapped (a
    spy around the real one, made slow enough that an overlap cannot be missed); before the lock, 8
    threads overlapped 8-deep."""
    from controlplane.runs import launch_checks

    real, active, deepest, lock = launch_checks._trainer_config_errors, [0], [0], threading.Lock()

    def counted(document: dict) -> dict[str, str]:
        with lock:
            active[0] += 1
            deepest[0] = max(deepest[0], active[0])
        try:
            threading.Event().wait(0.05)
            return real(document)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(launch_checks, "_trainer_config_errors", counted)
    start = threading.Barrier(8)
    answers: list[object] = []

    def one() -> None:
        start.wait()
        try:
            services.run_config_validate(config=doc(max_steps=2, max_completion_length=64))
            answers.append("valid")
        except Exception as exc:  # noqa: BLE001 - every answer is collected and compared below
            answers.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert answers == ["valid"] * 8
    assert deepest[0] == 1


def test_process_state_is_restored_key_by_key():
    """What the checks added to the environment goes, what they changed comes back, the rest is never
    touched (the environment is never empty for another thread meanwhile)."""
    os.environ["GRPO_TEST_KEPT"] = "before"
    try:
        with process_state_kept():
            os.environ["GRPO_TEST_KEPT"] = "during"
            os.environ["GRPO_TEST_ADDED"] = "during"
        assert os.environ["GRPO_TEST_KEPT"] == "before"
        assert "GRPO_TEST_ADDED" not in os.environ
    finally:
        os.environ.pop("GRPO_TEST_KEPT", None)
