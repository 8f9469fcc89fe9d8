"""Every curl, JSON and YAML example of README.md and docs/ runs or says why not (issue 28 item 4).

``tests/doc_examples.py`` finds the examples and reads the marker above each. Here:

* each example says what it is; a "tested by" names a test that exists; a "not run" says why;
* YAML and JSON: a run document is accepted by the control plane's validation as it stands (the
  checks of creation: preflight included), a fragment once added to a small ``tiny`` document, a
  trainer run file by the trainer's reader (``python -m trainer train --config``) and by the control
  plane less the args it sets per run; a reference lists only keys the run document has;
* commands run against the live stack, as written: ``python manage.py issue_token ci`` gives the
  ``$TOKEN`` of the ``curl`` lines, ``http://HOST`` is a daphne of the test's own (the README's
  example plugin registered there through ``GRPO_PLUGIN_MODULES``, as the README says an operator
  may), each ``curl`` gets the status its verb means (201 for a creation, 200 for a read). The
  README's REST run then trains one step (on the session's vLLM server, the one thing changed:
  ``resources.server``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import uuid

import pytest
import yaml

from controlplane.runs import services
from controlplane.runs.models import MetricPoint, Run
from tests.conftest import PYTHON, REPO, daphne_on_test_db, subprocess_database_url
from tests.doc_examples import KINDS, Example, commands, examples
from trainer.config.resources import RESOURCE_KEYS, TRAINER_KEYS, VLLM_KEYS
from trainer.config.run_config import PEFT_KEYS, TOP_LEVEL_KEYS, config_field_names, validate_run_document
from worker.processes import wait_for

EXAMPLES = examples()
# What a fragment is added to: the smallest document the control plane trains.
BASE_DOCUMENT = {
    "model": "tiny",
    "train_dataset": "arithmetic",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "args": {"max_steps": 2, "max_completion_length": 64},
}
# Set by the control plane for each run (trainer/config/run_config.py refuses them in a stored document).
CONTROL_PLANE_ARGS = ("output_dir", "vllm_server_base_url")
# The example plugin of the README, registered without packaging (GRPO_PLUGIN_MODULES).
ACME_PATH = REPO / "tests" / "plugins" / "acme_grpo"


def _of(*kinds: str) -> list[Example]:
    return [e for e in EXAMPLES if e.kind in kinds]


def _document(example: Example) -> dict:
    doc = yaml.safe_load(example.body)  # JSON is YAML
    assert isinstance(doc, dict), f"{example.where}: not a mapping"
    return doc


def _test_exists(reference: str) -> bool:
    path, _, name = reference.partition("::")
    file = REPO / path
    if not (path.startswith("tests/") and file.is_file() and name):
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_every_example_says_what_it_is_and_why_one_is_not_run():
    problems = []
    for e in EXAMPLES:
        if e.kind is None:
            problems.append(f"{e.where}: no marker; put one of {KINDS} above it (tests/doc_examples.py)")
        elif e.kind not in KINDS:
            problems.append(f"{e.where}: unknown marker {e.kind!r}; one of {KINDS}")
        elif e.kind == "not run" and len(e.detail.split()) < 3:
            problems.append(f"{e.where}: 'not run' needs the reason after it")
        elif e.kind == "tested by" and not _test_exists(e.detail):
            problems.append(f"{e.where}: {e.detail!r} is not a test function")
    assert not problems, "\n".join(problems)
    # The parser finds what the documents hold (an empty list would pass everything above).
    assert {"commands", "run document fragment", "trainer run file", "reference"} <= {
        e.kind for e in EXAMPLES
    }


def test_commands_split_as_the_shell_splits_them():
    body = 'a "b c" \\\n  d   # note\n# only a comment\ncurl -d \'{"x":\n 1}\' http://HOST/ # "quoted"\n'
    assert commands(body) == [["a", "b c", "d"], ["curl", "-d", '{"x":\n 1}', "http://HOST/"]]


@pytest.mark.django_db
@pytest.mark.parametrize("example", _of("run document", "run document fragment"), ids=lambda e: e.where)
def test_a_run_document_example_is_accepted(example):
    doc = _document(example)
    if example.kind == "run document fragment":
        doc = {**BASE_DOCUMENT, **doc, "args": {**BASE_DOCUMENT["args"], **doc.get("args", {})}}
    services.run_config_validate(config=doc)


@pytest.mark.django_db
@pytest.mark.parametrize("example", _of("trainer run file"), ids=lambda e: e.where)
def test_a_trainer_run_file_example_is_read_by_the_trainer_and_accepted_by_the_control_plane(example):
    doc = _document(example)
    spec = validate_run_document(doc)
    assert spec.args.max_steps == doc["args"]["max_steps"] and spec.model == doc["model"]
    args = {k: v for k, v in doc["args"].items() if k not in CONTROL_PLANE_ARGS}
    services.run_config_validate(config={**doc, "args": args})


@pytest.mark.parametrize("example", _of("reference"), ids=lambda e: e.where)
def test_a_reference_example_lists_only_keys_the_run_document_has(example):
    doc = _document(example)
    allowed = {
        "": TOP_LEVEL_KEYS,
        "resources": RESOURCE_KEYS,
        "resources.vllm": VLLM_KEYS,
        "resources.trainer": TRAINER_KEYS,
        "args": tuple(config_field_names()),
        "peft_config": PEFT_KEYS,
    }
    unknown = []

    def walk(mapping: dict, prefix: str) -> None:
        for key, value in mapping.items():
            path = f"{prefix}.{key}" if prefix else key
            if key not in allowed[prefix]:
                unknown.append(path)
            elif isinstance(value, dict) and path in allowed:
                walk(value, path)

    walk(doc, "")
    assert not unknown, f"{example.where}: keys the run document does not have: {unknown}"


# --------------------------------------------------------------------------------- live commands
def acme_plugin_env() -> dict[str, str]:
    """The environment that registers the README's example plugin through ``GRPO_PLUGIN_MODULES``
    (the package importable from its folder) for the processes the commands talk to."""
    return {"GRPO_PLUGIN_MODULES": "acme_grpo.plugin", "PYTHONPATH": str(ACME_PATH)}


def _run_command(argv: list[str], *, url: str, token: str, env: dict, out) -> tuple[str, object]:
    """Run one documented command; returns (what it was, its answer): a token, a status and JSON
    body, or a command's output."""
    if argv[:2] == ["python", "manage.py"]:
        done = subprocess.run(
            [PYTHON, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stderr[-2000:]}"
        return argv[2], done.stdout
    assert argv[0] == "curl", f"a command these examples do not run: {argv}"
    argv = [a.replace("$TOKEN", token).replace("http://HOST", url) for a in argv]
    body = out / f"body-{uuid.uuid4().hex}"
    done = subprocess.run(
        [*argv, "-sS", "-o", str(body), "-w", "%{http_code}"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{argv}: curl exit {done.returncode}: {done.stderr}"
    return "curl", (int(done.stdout), json.loads(body.read_text()), "-d" in argv)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_command_examples_answer_as_documented_and_the_readme_run_trains_a_step(
    celery_worker_process, session_server, settings, tmp_path
):
    # The documented commands talk to daphne (a process of its own, the plugin registered there as
    # the README says); their runs wait on a queue nobody reads (no per-run vLLM start here): their
    # creation answer is what the documents promise. The README's own run is then trained below.
    plugin = acme_plugin_env()
    env = {**os.environ, "DATABASE_URL": subprocess_database_url(), **plugin}
    created: list[int] = []
    token = ""
    queue = f"doc-examples-{uuid.uuid4().hex[:8]}"
    with daphne_on_test_db(tmp_path / "daphne.log", queue=queue, env=plugin) as base:
        for example in _of("commands"):
            for argv in commands(example.body):
                what, answer = _run_command(argv, url=base, token=token, env=env, out=tmp_path)
                if what == "issue_token":
                    token = answer.strip().splitlines()[-1]
                elif what == "registry":
                    assert "acme_grpo.rewards.exact_answer" in answer, answer[-2000:]
                else:
                    status, body, posted = answer
                    assert status == (201 if posted else 200), f"{example.where}: {argv}: {status} {body}"
                    if posted:
                        created.append(body["id"])
    assert token and len(created) >= 2, (token, created)
    readme = Run.objects.get(pk=created[0])
    assert readme.owner.username == "ci" and readme.name == "smoke"

    settings.GRPO_RUNS_QUEUE = celery_worker_process["queue"]
    trained, _ = services.run_create(
        owner=readme.owner,
        name="smoke on the session's server",
        config={**readme.config, "resources": {"server": session_server}},
    )
    try:
        wait_for(
            lambda: (
                MetricPoint.objects.filter(run_id=trained.pk, name="reward").exists()
                or Run.objects.get(pk=trained.pk).is_terminal
            ),
            timeout_s=600,
            what="the README's run to train a step",
        )
        run = Run.objects.get(pk=trained.pk)
        assert MetricPoint.objects.filter(run_id=run.pk, name="reward").exists(), (
            run.status,
            run.failure_reason,
        )
    finally:
        for run in Run.objects.filter(pk__in=[*created, trained.pk]):
            if not run.is_terminal:
                services.run_stop(run=run)
        wait_for(
            lambda: all(r.is_terminal for r in Run.objects.filter(pk__in=[*created, trained.pk])),
            timeout_s=120,
            what="the documented runs to stop",
        )
