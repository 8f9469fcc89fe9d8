"""Evaluation during training (issue 30), the web and worker side: eval completions stored apart
from the training ones (``CompletionSample.split``) by the tailer and served by ``?split=eval``;
eval metric lines that come after later steps' lines merged into their step; ``run_gate`` on an
``eval/*`` metric; ``eval_dataset`` validated and measured like ``train_dataset``; the worker
resolving a hub ``eval_dataset`` and recording its commit. Real Postgres and Redis, real files as
``trainer.reporting.sinks.JsonlSink`` writes them, the tiny model and the built-in datasets; no vLLM.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.management import call_command
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.runs import services
from controlplane.runs.models import CompletionSample, MetricPoint, MetricStep, Run, RunStatus
from controlplane.runs.services import ingest
from controlplane.runs.services.stream import run_group
from tests.conftest import PYTHON, REPO
from tests.test_run_downloads import api_for, make_run, make_user
from trainer.config.run_config import RunConfigError
from trainer.reporting.sinks import JsonlSink
from worker.tailer import RunOutputTailer

pytestmark = pytest.mark.django_db

REWARD = "trainer.rewards.accuracy_reward"


def train_row(text: str, group: int = 0) -> dict:
    return {
        "prompt": "p",
        "completion": text,
        "reward": 1.0,
        "rewards": {"acc": 1.0},
        "advantage": 0.5,
        "group_id": group,
    }


def eval_row(text: str, prompt_index: int, reference: str = "4") -> dict:
    """An eval completion as the trainer hands it to its sink (``JsonlSink.evaluation`` adds ``"eval": true``)."""
    return {
        "prompt": f"eval prompt {prompt_index}",
        "completion": text,
        "reward": 0.0,
        "rewards": {"acc": 0.0, "format": 1.0},
        "advantage": None,
        "group_id": prompt_index,
        "row_index": 100 + prompt_index,
        "reference": reference,
    }


def stored(run: Run, split: str, step: int) -> list[tuple[int, str]]:
    rows = CompletionSample.objects.filter(run=run, split=split, step=step).order_by("index")
    return [(r.index, r.completion) for r in rows]


# ------------------------------------------------------------------------------- 1. completions
def receive_all(layer, channel) -> list[dict]:
    """Every message the channel holds now (published by the on-commit callbacks run before)."""
    messages = []
    while True:
        try:
            messages.append(async_to_sync(asyncio.wait_for)(layer.receive(channel), 2))
        except TimeoutError:
            return messages


def test_eval_rows_are_stored_as_eval_numbered_apart_even_interleaved_and_across_polls(
    tmp_path, django_capture_on_commit_callbacks
):
    """Step 10's training rows, then step 11's, then step 10's eval rows in two writes with a
    training write of step 12 between them; a second poll by a restarted worker's tailer."""
    run = make_run(make_user("tail"))
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(run_group(run.pk), channel)
    sink = JsonlSink(tmp_path)
    sink.completions(10, [train_row("t10a"), train_row("t10b")])
    sink.completions(11, [train_row("t11a")])
    sink.evaluation(10, {"eval/reward": 0.0}, [eval_row("e0", 0), eval_row("e1", 1)], 1.0)
    with django_capture_on_commit_callbacks(execute=True):
        RunOutputTailer(run_id=run.pk, output_dir=tmp_path).poll()
    sink.completions(12, [train_row("t12a")])
    sink.evaluation(10, {}, [eval_row("e2", 2)], 1.0)
    with django_capture_on_commit_callbacks(execute=True):  # the next worker, from the saved cursor
        RunOutputTailer(run_id=run.pk, output_dir=tmp_path).poll()
    assert stored(run, "train", 10) == [(0, "t10a"), (1, "t10b")]  # no eval row took a training index
    assert stored(run, "eval", 10) == [(0, "e0"), (1, "e1"), (2, "e2")]  # the eval block continued
    assert stored(run, "train", 12) == [(0, "t12a")] and stored(run, "eval", 12) == []
    first_eval = CompletionSample.objects.get(run=run, split="eval", step=10, index=0)
    assert (first_eval.advantage, first_eval.row_index, first_eval.reference) == (None, 100, "4")
    # The live messages carry the split: the page sends eval samples to its eval view only.
    splits = [
        (m["step"], m["split"], [i["completion"] for i in m["items"]])
        for m in receive_all(layer, channel)
        if m["type"] == "run.completions"
    ]
    assert splits == [
        (10, "train", ["t10a", "t10b"]),
        (11, "train", ["t11a"]),
        (10, "eval", ["e0", "e1"]),
        (12, "train", ["t12a"]),
        (10, "eval", ["e2"]),
    ]
    # A resumed attempt starts new blocks of both kinds: re-done rows replace from index 0.
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    tailer.new_attempt()
    sink.evaluation(10, {}, [eval_row("x0", 0)], 1.0)
    tailer.poll()
    assert stored(run, "eval", 10) == [(0, "x0"), (1, "e1"), (2, "e2")]


def test_the_split_is_a_database_rule_and_the_per_step_cap_counts_per_split(settings):
    run = make_run(make_user("cap"))
    settings.GRPO_COMPLETIONS_PER_STEP = 2
    ingest.completion_samples_ingest(run_id=run.pk, step=3, items=[train_row(str(i)) for i in range(3)])
    ingest.completion_samples_ingest(
        run_id=run.pk, step=3, items=[eval_row(str(i), i) for i in range(3)], split="eval"
    )
    assert len(stored(run, "train", 3)) == 2 and len(stored(run, "eval", 3)) == 2
    with pytest.raises(IntegrityError), transaction.atomic():
        CompletionSample.objects.filter(run=run).update(split="test")


@pytest.fixture
def alice():
    return make_user("alice")


@pytest.fixture
def evaluated(alice):
    """Training groups at steps 1..3, eval rows (2 prompts x 2 samples) at steps 0 and 2."""
    run = make_run(alice)
    for step in (1, 2, 3):
        ingest.completion_samples_ingest(
            run_id=run.pk, step=step, items=[train_row("t", 0), train_row("u", 0)]
        )
    for step in (0, 2):
        items = [eval_row(f"e{step}-{p}-{k}", p, reference=str(p)) for p in range(2) for k in range(2)]
        ingest.completion_samples_ingest(run_id=run.pk, step=step, items=items, split="eval")
    return run


def get(user, run, path: str) -> dict:
    response = api_for(user).get(f"/api/v1/runs/{run.pk}/{path}")
    assert response.status_code == 200, response.content
    return response.json()


def test_the_api_serves_training_rows_by_default_and_eval_rows_with_split_eval(alice, evaluated):
    default = get(alice, evaluated, "completions/")
    assert default["count"] == 6 and {r["split"] for r in default["results"]} == {"train"}
    assert get(alice, evaluated, "completions/?split=train") == default
    evals = get(alice, evaluated, "completions/?split=eval&step=2&ordering=step")
    assert [r["completion"] for r in evals["results"]] == ["e2-0-0", "e2-0-1", "e2-1-0", "e2-1-1"]
    assert (
        evals["results"][0]["rewards"] == {"acc": 0.0, "format": 1.0}
        and evals["results"][2]["reference"] == "1"
    )
    groups = get(alice, evaluated, "completions/?split=eval&by=group")
    assert [(g["split"], g["step"], g["group_id"], g["size"]) for g in groups["results"]] == [
        ("eval", 2, 1, 2),
        ("eval", 2, 0, 2),
        ("eval", 0, 1, 2),
        ("eval", 0, 0, 2),
    ]
    assert groups["results"][0]["reference"] == "1" and len(groups["results"][0]["rollouts"]) == 2
    assert get(alice, evaluated, "completions/steps/")["steps"] == [
        {"step": 3, "samples": 2},
        {"step": 2, "samples": 2},
        {"step": 1, "samples": 2},
    ]
    assert get(alice, evaluated, "completions/steps/?split=eval")["steps"] == [
        {"step": 2, "samples": 4},
        {"step": 0, "samples": 4},
    ]
    for path in ("completions/?split=test", "completions/steps/?split=all"):
        response = api_for(alice).get(f"/api/v1/runs/{evaluated.pk}/{path}")
        assert response.status_code == 400 and "split" in response.json(), response.content


def test_downloads_take_the_split_and_name_it_in_a_column(alice, evaluated):
    response = api_for(alice).get(f"/api/v1/runs/{evaluated.pk}/completions/?split=eval&format=csv")
    assert response.status_code == 200
    assert f"run-{evaluated.pk}-eval-completions.csv" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert len(rows) == 8 and {r["split"] for r in rows} == {"eval"} and rows[0]["reference"] == "0"
    response = api_for(alice).get(f"/api/v1/runs/{evaluated.pk}/completions/?format=json")
    items = json.loads(b"".join(response.streaming_content))
    assert len(items) == 6 and {i["split"] for i in items} == {"train"}


# ------------------------------------------------------------------------------- 2. metrics
def test_an_eval_line_after_later_steps_adds_its_points_to_its_step_and_keeps_the_training_ones(
    tmp_path, django_capture_on_commit_callbacks
):
    run = make_run(make_user("late"))
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(run_group(run.pk), channel)
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    sink = JsonlSink(tmp_path)
    for step in (10, 11, 12):
        sink.metrics(step, {"reward": step / 100, "loss": 0.5})
    with django_capture_on_commit_callbacks(execute=True):
        tailer.poll()
    time_10 = MetricStep.objects.get(run=run, step=10).time
    # As the trainer writes it: step 10's own time, after step 12's line; read by a later attempt
    # (a resumed run's catch-up) or not, step 10 keeps the time and attempt its own line gave it.
    Run.objects.filter(pk=run.pk).update(attempt=2)
    sink.evaluation(10, {"eval/reward": 0.75, "eval/pass@1": 0.5}, [], time_10.timestamp() + 5)
    with django_capture_on_commit_callbacks(execute=True):
        tailer.poll()
    at_10 = dict(MetricPoint.objects.filter(run=run, step=10).values_list("name", "value"))
    assert at_10 == {"reward": 0.1, "loss": 0.5, "eval/reward": 0.75, "eval/pass@1": 0.5}
    kept = MetricStep.objects.get(run=run, step=10)
    assert (kept.time, kept.attempt) == (time_10, 1) and MetricStep.objects.filter(run=run).count() == 3
    # An eval before any training line (eval_on_start: step 0) gives its step a row.
    sink.evaluation(0, {"eval/reward": 0.25}, [], time_10.timestamp() - 60)
    with django_capture_on_commit_callbacks(execute=True):
        tailer.poll()
    first = MetricStep.objects.get(run=run, step=0)
    assert abs(first.time.timestamp() - (time_10.timestamp() - 60)) < 0.001 and first.attempt == 2
    columns = get(run.owner, run, "metrics/?layout=columns&names=eval/reward,reward")
    assert columns["series"]["eval/reward"] == {"steps": [0, 10], "values": [0.25, 0.75]}
    assert columns["series"]["reward"]["steps"] == [10, 11, 12]
    messages = []
    for message in receive_all(layer, channel):
        messages.extend(message["steps"] if message["type"] == "run.metrics.batch" else [message])
    assert [m["step"] for m in messages] == [10, 11, 12, 10, 0]
    late = messages[3]
    assert late["values"] == {"eval/reward": 0.75, "eval/pass@1": 0.5}  # only what the line adds
    assert (late["time"], late["attempt"]) == (pytest.approx(time_10.timestamp()), 1)  # the step's own


# ------------------------------------------------------------------------------- 4. gate
@pytest.mark.django_db(transaction=True)
def test_run_gate_passes_and_fails_on_an_eval_metric(live_server, capsys):
    owner = make_user("ci")
    token = services.token_issue(username="ci")
    run = Run.objects.create(
        owner=owner,
        name="evaluated",
        config={"model": "tiny"},
        config_sha256="0" * 64,
        status=RunStatus.COMPLETED,
        finished_at=timezone.now(),
    )
    for step in range(1, 21):
        ingest.metric_points_ingest(run_id=run.pk, step=step, values={"reward": 0.1})
    ingest.metric_points_ingest(run_id=run.pk, step=10, values={"eval/pass@1": 0.25})
    ingest.metric_points_ingest(run_id=run.pk, step=20, values={"eval/pass@1": 0.75})
    common = ["--run", str(run.pk), "--metric", "eval/pass@1", "--url", live_server.url, "--token", token]
    with pytest.raises(SystemExit) as passed:
        call_command("run_gate", *common, "--min", "0.7")
    assert passed.value.code == 0
    assert "PASS: eval/pass@1 = 0.75 at step 20" in capsys.readouterr().out
    with pytest.raises(SystemExit) as failed:
        call_command("run_gate", *common, "--min", "0.8")
    assert failed.value.code == 1
    assert "FAIL: eval/pass@1 = 0.75 at step 20 (needs >= 0.8)" in capsys.readouterr().out


# ------------------------------------------------------------------------------- 5. validation
def refused(document: dict) -> dict[str, str]:
    with pytest.raises(RunConfigError) as caught:
        services.run_config_validate(config=document)
    return caught.value.errors


def evaluating(**top) -> dict:
    return {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": [REWARD],
        "args": {"max_steps": 2, "max_completion_length": 64, "eval_strategy": "steps", "eval_steps": 1},
        **top,
    }


def test_eval_dataset_takes_the_train_datasets_forms_under_the_same_rules(settings, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "held_out.jsonl").write_text(json.dumps({"prompt": "What is 2 + 2?", "solution": "4"}) + "\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_text(json.dumps({"prompt": "x", "solution": "y"}) + "\n")
    (root / "linked").mkdir()
    os.symlink(outside / "secret.jsonl", root / "linked" / "data.jsonl")
    settings.GRPO_ALLOWED_DATASET_ROOTS = [str(root)]
    settings.GRPO_ALLOWED_HUB_DATASETS = ["acme/*"]
    services.run_config_validate(config=evaluating(eval_dataset="arithmetic-unseen"))
    services.run_config_validate(config=evaluating(eval_dataset=str(root / "held_out.jsonl")))
    cases = {
        str(outside / "secret.jsonl"): "outside the allowed dataset roots (GRPO_ALLOWED_DATASET_ROOTS)",
        str(root / "linked"): "a link to a path outside the allowed dataset roots",
        str(root / ".." / "outside" / "secret.jsonl"): "must not contain '..'",
        "other/sums": "GRPO_ALLOWED_HUB_DATASETS",
        str(root / "missing.jsonl"): "does not exist",
    }
    for value, words in cases.items():
        errors = refused(evaluating(eval_dataset=value))
        assert words in errors.get("eval_dataset", ""), (value, errors)
        assert "train_dataset" not in errors
    assert (
        "hub id only"
        in refused(evaluating(eval_dataset="arithmetic", eval_dataset_revision="main"))[
            "eval_dataset_revision"
        ]
    )
    # The rewards score eval rows too: a column they read must be there (after dataset_columns).
    (root / "no_answer.jsonl").write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n")
    errors = refused(evaluating(eval_dataset=str(root / "no_answer.jsonl")))
    assert "reads column(s) solution" in errors["eval_dataset"] and "reward_funcs[0]" not in errors
    # The worker's check before it reads the files names the field too.
    from controlplane.runs.validation import local_sources_errors

    assert "eval_dataset" in local_sources_errors(
        document={"model": "tiny", "eval_dataset": str(root / "linked")}
    )


def test_eval_prompts_are_measured_at_creation_and_refused_under_their_field(settings, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    settings.GRPO_ALLOWED_DATASET_ROOTS = [str(root)]
    long_prompt = "What is " + " + ".join(["1"] * 3000) + "?"
    (root / "long.jsonl").write_text(json.dumps({"prompt": long_prompt, "solution": "3000"}) + "\n")
    errors = refused(evaluating(eval_dataset=str(root / "long.jsonl")))
    assert "leaves no room for a completion" in errors["eval_dataset"], errors
    assert "train_dataset" not in errors
    (root / "question.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "solution": "4"}) + "\n")
    errors = refused(evaluating(eval_dataset=str(root / "question.jsonl")))
    assert "has no 'prompt' column" in errors["eval_dataset"], errors
    # A saved dataset of several splits: the eval split must be one of them.
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "What is 1 + 1?", "solution": "2"}]),
            "validation": datasets.Dataset.from_list([{"prompt": "What is 2 + 2?", "solution": "4"}]),
        }
    ).save_to_disk(str(root / "splits"))
    services.run_config_validate(
        config=evaluating(eval_dataset=str(root / "splits"), eval_dataset_split="validation")
    )
    errors = refused(evaluating(eval_dataset=str(root / "splits")))  # the default split, "test"
    assert "'test'" in errors.get("eval_dataset_split", ""), errors


def test_the_per_run_server_fits_the_longest_eval_prompt_too(settings, tmp_path, tiny_model_dir):
    from controlplane.runs.launch_checks import LaunchRefused, per_run_max_model_len

    root = tmp_path / "data"
    root.mkdir()
    settings.GRPO_ALLOWED_DATASET_ROOTS = [str(root)]
    medium = "What is " + " + ".join(["1"] * 150) + "?"
    (root / "medium.jsonl").write_text(json.dumps({"prompt": medium, "solution": "150"}) + "\n")
    document = evaluating(eval_dataset=str(root / "medium.jsonl"))
    train_only = per_run_max_model_len(
        document=document, model_dir=str(tiny_model_dir), dataset="arithmetic-small"
    )
    both = per_run_max_model_len(
        document=document,
        model_dir=str(tiny_model_dir),
        dataset="arithmetic-small",
        eval_dataset=str(root / "medium.jsonl"),
    )
    assert both.tokens > train_only.tokens, (both, train_only)
    long_prompt = "What is " + " + ".join(["1"] * 3000) + "?"
    (root / "medium.jsonl").write_text(json.dumps({"prompt": long_prompt, "solution": "3000"}) + "\n")
    with pytest.raises(LaunchRefused, match="^eval_dataset: "):
        per_run_max_model_len(
            document=document,
            model_dir=str(tiny_model_dir),
            dataset="arithmetic-small",
            eval_dataset=str(root / "medium.jsonl"),
        )


# ------------------------------------------------------------------------------- 5. the worker
def test_the_worker_resolves_a_hub_eval_dataset_to_its_snapshot_and_commit(tmp_path, tiny_model_dir):
    """In a subprocess: huggingface_hub reads its cache location and offline switch at import."""
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    data = tmp_path / "hub" / "datasets--acme--held-out"
    (data / "refs").mkdir(parents=True)
    (data / "refs" / "main").write_text(commit)
    files = data / "snapshots" / commit / "data"
    files.mkdir(parents=True)
    (files / "test.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "solution": "4"}) + "\n")
    script = (
        "import json, django; django.setup()\n"
        "from worker.run_sources import hub_sources_resolve\n"
        "print(json.dumps(hub_sources_resolve(config={'model': 'tiny', 'train_dataset': 'arithmetic', "
        "'eval_dataset': 'acme/held-out', 'eval_dataset_revision': 'main'})))\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    out = subprocess.run(
        [PYTHON, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    model, dataset, eval_dataset, resolved = json.loads(out.stdout.strip().splitlines()[-1])
    assert (model, dataset) == ("tiny", "arithmetic")
    assert eval_dataset == str(data / "snapshots" / commit)
    assert resolved == {
        "eval_dataset": {
            "id": "acme/held-out",
            "type": "dataset",
            "revision": "main",
            "commit": commit,
            "path": str(data / "snapshots" / commit),
        }
    }


def test_the_launch_document_names_the_local_eval_dataset_without_its_revision(tmp_path):
    from worker.supervisor import RunSupervisor

    run = make_run(make_user("launch"))
    run.config = {**run.config, "eval_dataset": "acme/held-out", "eval_dataset_revision": "v1"}
    run.output_dir = str(tmp_path)
    supervisor = RunSupervisor(run)
    supervisor.port = 8123
    import yaml

    doc = yaml.safe_load(
        supervisor._write_launch_document("/models/tiny", "arithmetic", "/snap/held-out").read_text()
    )
    assert doc["eval_dataset"] == "/snap/held-out" and "eval_dataset_revision" not in doc
    assert doc["train_dataset"] == "arithmetic"


# ------------------------------------------------------------------------------- 6. the form
def test_the_form_takes_an_eval_dataset_and_its_args_and_a_clone_keeps_them(settings, tmp_path):
    from tests.test_run_form_prefill import browser_for, submitted_values

    user = make_user("former")
    web = browser_for(user)
    values = submitted_values(web.get("/runs/new/").content.decode())
    assert values["eval_strategy"] == ["no"] and values["eval_num_generations"] == ["1"]
    values.update(
        name=["with eval"],
        max_completion_length=["64"],
        eval_dataset=["arithmetic-unseen"],
        eval_strategy=["steps"],
        eval_steps=["5"],
        eval_num_generations=["4"],
        eval_temperature=["0.7"],
        eval_max_prompts=["20"],
        eval_pass_threshold=["0.5"],
    )
    created = web.post("/runs/new/", values)
    assert created.status_code == 302, created.context["form"].errors
    run = Run.objects.get(name="with eval")
    assert run.config["eval_dataset"] == "arithmetic-unseen" and "eval_dataset_split" not in run.config
    args = run.config["args"]
    assert {k: args[k] for k in args if k.startswith("eval_")} == {
        "eval_strategy": "steps",
        "eval_steps": 5,
        "eval_num_generations": 4,
        "eval_temperature": 0.7,
        "eval_max_prompts": 20,
        "eval_pass_threshold": 0.5,
    }
    clone = submitted_values(web.get(f"/runs/new/?clone={run.pk}").content.decode())
    assert clone["eval_dataset"] == ["arithmetic-unseen"] and clone["eval_strategy"] == ["steps"]
    assert clone["eval_num_generations"] == ["4"] and "eval_strategy" not in (clone["advanced"][0] or "")
    # A refused eval set: the error beside its field, nothing created.
    settings.GRPO_ALLOWED_HUB_DATASETS = []
    values.update(name=["bad eval"], eval_dataset=["acme/held-out"])
    refused_page = web.post("/runs/new/", values)
    assert refused_page.status_code in (200, 400)
    assert "GRPO_ALLOWED_HUB_DATASETS" in " ".join(refused_page.context["form"].errors["eval_dataset"])
    assert not Run.objects.filter(name="bad eval").exists()
