"""The new-run form a newcomer meets: prefilled from the chosen model's preset (so a plain submit
trains a finite run that logs completions), "Clone this run", and every error shown at once.
Real Postgres (pytest-django).

In these (non-transactional) tests ``transaction.on_commit`` never fires, so a run created through
the form is stored queued without enqueuing a supervisor task (as in tests/test_runs_api.py).
"""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.runs import services
from controlplane.runs.models import Run
from controlplane.runs.selectors import MAIN_ARGS, main_arg_defaults
from trainer.config.run_config import RunConfigError

pytestmark = pytest.mark.django_db


class _FormValues(HTMLParser):
    """What a browser submits for ``<form id="run-form">``: text and number inputs, checked
    checkboxes, each select's selected option (else its first) and textareas."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.values: dict[str, list[str]] = {}
        self._in_form = False
        self._select: tuple[str, list[str], list[str]] | None = None  # name, options, selected
        self._textarea: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form" and a.get("id") == "run-form":
            self._in_form = True
        if not self._in_form:
            return
        if tag == "input" and a.get("name"):
            kind = a.get("type", "text")
            if kind == "checkbox" and "checked" not in a:
                return
            default = "on" if kind == "checkbox" else ""
            self.values.setdefault(a["name"], []).append(a.get("value") or default)
        elif tag == "select":
            self._select = (a["name"], [], [])
        elif tag == "option" and self._select is not None:
            self._select[1].append(a.get("value") or "")
            if "selected" in a:
                self._select[2].append(a.get("value") or "")
        elif tag == "textarea":
            self._textarea = a["name"]
            self.values[a["name"]] = [""]

    def handle_data(self, data: str) -> None:
        if self._textarea is not None:
            self.values[self._textarea][0] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._in_form = False
        elif tag == "select" and self._select is not None:
            name, options, selected = self._select
            self.values[name] = selected or options[:1]
            self._select = None
        elif tag == "textarea" and self._textarea is not None:
            # HTML drops one newline right after <textarea>; Django writes one there.
            self.values[self._textarea][0] = self.values[self._textarea][0].removeprefix("\n")
            self._textarea = None


def submitted_values(html: str) -> dict[str, list[str]]:
    parser = _FormValues()
    parser.feed(html)
    return parser.values


def field_block(html: str, name: str) -> str:
    """The HTML of the form's ``<div id="field-NAME">`` up to the next field."""
    start = html.index(f'id="field-{name}"')
    end = html.find('<div class="field"', start)
    return html[start : end if end != -1 else None]


def make_user(name: str):
    return get_user_model().objects.create_user(username=name, password=None)


def browser_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_run_preset_is_the_demo_for_tiny_and_finite_with_completions_for_other_models():
    from controlplane.runs import presets

    assert presets.run_preset(model="tiny") == services.demo_config()["args"]
    generic = presets.run_preset(model="org/some-model")
    assert generic == {
        "max_steps": 500,
        "log_completions": True,
        "max_completion_length": 1024,
        "save_steps": 100,
    }
    embedded = presets.form_presets()
    assert embedded["generic"]["learning_rate"] == main_arg_defaults()["learning_rate"]  # the spec's
    assert embedded["generic"]["advanced"] == ""
    assert embedded["presets"]["tiny"]["max_steps"] == services.demo_config()["args"]["max_steps"]


def test_new_run_form_is_prefilled_from_the_tiny_preset_and_a_plain_submit_trains_a_finite_run():
    demo = services.demo_config()["args"]
    web = browser_for(make_user("newcomer"))
    page = web.get("/runs/new/")
    assert page.status_code == 200
    values = submitted_values(page.content.decode())
    assert values["model"] == ["tiny"]
    for name in MAIN_ARGS:
        if name in demo and not isinstance(demo[name], bool):
            assert float(values[name][0]) == demo[name], name
    assert int(values["max_steps"][0]) > 0
    assert values.get("log_completions") == ["on"]  # checked
    advanced = json.loads(values["advanced"][0])
    assert advanced == {k: v for k, v in demo.items() if k not in MAIN_ARGS}
    assert 'id="run-presets"' in page.content.decode() and "runs/run_form.js" in page.content.decode()

    created = web.post("/runs/new/", values)
    assert created.status_code == 302, created.context["form"].errors
    run = Run.objects.get()
    args = run.config["args"]
    assert args["max_steps"] > 0 and args["log_completions"] is True
    defaults = main_arg_defaults()
    for name, value in demo.items():  # the demo's settings; values equal to the spec's are left out
        assert args.get(name, defaults.get(name)) == value, name


def test_clone_prefills_every_field_from_a_run_the_user_may_see():
    alice, bob = make_user("alice"), make_user("bob")
    config = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward", "trainer.rewards.boxed_format_reward"],
        "tools": ["trainer.builtin_tools.add"],
        "args": {
            "max_steps": 7,
            "max_completion_length": 128,
            "learning_rate": 3e-4,
            "num_generations": 4,
            "temperature": 0.7,
            "log_completions": True,
            "epsilon": 0.3,
            "dtype": "float32",
        },
    }
    source, _ = services.run_create(owner=alice, name="sweep a", config=config, launch=False)
    web = browser_for(alice)
    assert f'href="/runs/new/?clone={source.pk}"' in web.get(f"/runs/{source.pk}/").content.decode()

    page = web.get(f"/runs/new/?clone={source.pk}")
    assert page.status_code == 200
    html = page.content.decode()
    values = submitted_values(html)
    assert values["name"] == ["sweep a (clone)"]
    assert values["model"] == ["tiny"] and values["train_dataset"] == ["arithmetic-small"]
    assert values["reward_funcs"] == config["reward_funcs"]
    assert int(values["max_steps"][0]) == 7 and float(values["learning_rate"][0]) == 3e-4
    assert int(values["num_generations"][0]) == 4 and float(values["temperature"][0]) == 0.7
    assert values["log_completions"] == ["on"]
    # main fields the run left out show the spec's defaults, not a preset's
    assert float(values["save_steps"][0]) == main_arg_defaults()["save_steps"]
    assert json.loads(values["advanced"][0]) == {"epsilon": 0.3, "dtype": "float32"}
    assert f'href="/runs/{source.pk}/"' in html and "tools" in html[html.index('id="clone-dropped"') :]

    created = web.post("/runs/new/", values)
    assert created.status_code == 302, created.context["form"].errors
    clone = Run.objects.exclude(pk=source.pk).get()
    assert clone.name == "sweep a (clone)"
    assert clone.config == {k: v for k, v in config.items() if k != "tools"}

    assert browser_for(bob).get(f"/runs/new/?clone={source.pk}").status_code == 404  # not bob's
    assert web.get("/runs/new/?clone=999999").status_code == 404
    for bad in ("abc", "²", "9" * 5000):
        assert web.get(f"/runs/new/?clone={bad}").status_code == 404


def test_every_error_shows_at_once_beside_its_field_and_keeps_what_was_typed():
    web = browser_for(make_user("newcomer"))
    values = submitted_values(web.get("/runs/new/").content.decode())
    typed = {
        "name": "x" * 201,  # a field error (too long)
        "learning_rate": "fast",  # a field error (not a number)
        "advanced": '{"nope": 1}',  # not an AsyncGRPOConfig field
        "num_generations": "1",  # refused by the config (GRPO needs a group)
        "temperature": "0",  # refused by the config too, independently
    }
    response = web.post("/runs/new/", {**values, **typed})
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert set(typed) <= set(errors), errors
    html = response.content.decode()
    assert "args.nope" in field_block(html, "advanced")
    assert "num_generations" in field_block(html, "num_generations")
    assert "temperature" in field_block(html, "temperature")
    assert "errorlist" in field_block(html, "learning_rate")
    assert 'value="fast"' in field_block(html, "learning_rate")  # what was typed comes back
    assert "{&quot;nope&quot;: 1}" in field_block(html, "advanced")
    assert submitted_values(html)["num_generations"] == ["1"]
    assert not Run.objects.exists()


def test_new_run_from_a_checkpoint_has_the_checkpoint_as_its_model(tmp_path, settings, tiny_model_dir):
    """Issue 28 item 6: "new run from this checkpoint" is the run's clone with the checkpoint's
    folder as the model (resume_from_checkpoint is not taken from the web; the run's own Resume
    continues it). The owner's own checkpoints are accepted as a model wherever they are, with
    GRPO_ALLOWED_MODEL_ROOTS empty (the default); another user cannot name them, and for a staff
    user's view of someone else's run the form says so before it is sent."""
    from controlplane.runs.services import ingest

    alice, bob = make_user("alice"), make_user("bob")
    config = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {"max_steps": 7, "max_completion_length": 128, "learning_rate": 3e-4, "epsilon": 0.3},
    }
    source, _ = services.run_create(owner=alice, name="sweep a", config=config, launch=False)
    runs = tmp_path / "runs"
    folder = runs / f"run-{source.pk}-0123abcd" / "checkpoint-50"
    shutil.copytree(tiny_model_dir, folder)  # a checkpoint folder is a model directory
    ingest.checkpoint_record(run_id=source.pk, step=50, path=str(folder))
    web = browser_for(alice)
    url = f"/runs/new/?clone={source.pk}&checkpoint=50"

    settings.GRPO_ALLOWED_MODEL_ROOTS = []
    page = web.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    values = submitted_values(html)
    assert values["model"] == [str(folder)] and values["name"] == ["sweep a (from step 50)"]
    assert values["train_dataset"] == ["arithmetic-small"]
    assert values["reward_funcs"] == ["trainer.rewards.accuracy_reward"]
    assert int(values["max_steps"][0]) == 7 and float(values["learning_rate"][0]) == 3e-4
    assert json.loads(values["advanced"][0]) == {"epsilon": 0.3}
    assert 'id="from-checkpoint"' in html and "step 50" in html[html.index('id="from-checkpoint"') :]
    assert "checkpoint-note" not in html
    created = web.post("/runs/new/", values)
    assert created.status_code == 302, created.context["form"].errors
    run = Run.objects.exclude(pk=source.pk).get()
    assert run.name == "sweep a (from step 50)"
    assert run.config == {**config, "model": str(folder)}

    # Not bob's: neither the page nor the path itself.
    assert browser_for(bob).get(url).status_code == 404
    with pytest.raises(RunConfigError) as refused:
        services.run_create(owner=bob, config={**config, "model": str(folder)}, launch=False)
    assert "GRPO_ALLOWED_MODEL_ROOTS" in refused.value.errors["model"], refused.value.errors
    staff = get_user_model().objects.create_user("carol", password="pw", is_staff=True)
    html = browser_for(staff).get(url).content.decode()
    assert "another user&#x27;s" in html[html.index("checkpoint-note") :]

    # A checkpoint since deleted is named as such, not as a path outside the roots.
    shutil.rmtree(folder)
    with pytest.raises(RunConfigError) as gone:
        services.run_config_validate(config={**config, "model": str(folder)}, owner=alice)
    assert (
        "checkpoint 50 of run" in gone.value.errors["model"]
        and "no longer on disk" in gone.value.errors["model"]
    )

    for bad in ("51", "abc", "-1", "9" * 40, ""):
        assert web.get(f"/runs/new/?clone={source.pk}&checkpoint={bad}").status_code == 404, bad
    assert web.get("/runs/new/?checkpoint=50").status_code == 404  # whose?


def test_a_lora_runs_checkpoint_is_refused_as_a_model_naming_the_adapter(tmp_path):
    from controlplane.runs.models import Checkpoint

    alice = make_user("alice")
    config = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "peft_config": {"r": 8},
        "args": {"max_completion_length": 64},
    }
    run = Run.objects.create(owner=alice, name="lora", config=config, config_sha256="0" * 64)
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    Checkpoint.objects.create(run=run, step=5, path=str(folder))
    with pytest.raises(RunConfigError) as refused:
        services.run_config_validate(
            config={**config, "model": str(folder), "peft_config": None}, owner=alice
        )
    assert "holds a LoRA adapter" in refused.value.errors["model"], refused.value.errors


def test_a_checkpoint_as_model_drops_the_hub_revision_and_warns_of_lora_adapters(tmp_path, settings):
    from controlplane.runs import presets
    from controlplane.runs.models import Checkpoint

    settings.GRPO_ALLOWED_MODEL_ROOTS = [str(tmp_path)]
    config = {
        "model": "org/model",
        "model_revision": "main",
        "train_dataset": "arithmetic-small",
        "reward_funcs": [],
        "peft_config": {"r": 8},
        "args": {},
    }
    run = Run.objects.create(owner=make_user("alice"), name="lora", config=config, config_sha256="0" * 64)
    checkpoint = Checkpoint.objects.create(run=run, step=5, path=str(tmp_path / "checkpoint-5"))
    prefill = presets.run_checkpoint_prefill(run=run, checkpoint=checkpoint)
    assert prefill.initial["model"] == str(tmp_path / "checkpoint-5")
    assert "model_revision" not in prefill.initial
    assert prefill.checkpoint_step == 5 and prefill.cloned_from == run.pk
    assert prefill.dropped == ["peft_config"]
    assert len(prefill.notes) == 1 and "LoRA adapter" in prefill.notes[0]


def test_reward_and_dataset_docs_show_without_rest_markup():
    """Issue 28 item 7b: the form's labels carry each entry's first docstring line as a reader of
    the rendered docs sees it: no ``literal`` quotes, roles, emphasis stars or link targets."""
    from controlplane.runs.forms import RunForm, rest_plain

    cases = {
        "equals ``solution`` under math-verify": "equals solution under math-verify",
        "one ``\\boxed{...}`` answer": "one \\boxed{...} answer",
        "calls :func:`~trainer.rewards.accuracy_reward` and :py:class:`pkg.Thing`": (
            "calls accuracy_reward and pkg.Thing"
        ),
        ":math:`a^2`, `x`:sub:, :func:`!name`": "a^2, x, name",
        "see `the docs <https://example.org>`_, `<https://a.b>`__ or `Section`_": (
            "see the docs, https://a.b or Section"
        ),
        "with a `solution` column": "with a solution column",
        "*emphasis* and **strong** text": "emphasis and strong text",
        "2*3*4, a * b * c, snake_case_ and x_ stay": "2*3*4, a * b * c, snake_case_ and x_ stay",
        "\\*not emphasis\\* and a \\`tick": "*not emphasis* and a `tick",
        "plain text": "plain text",
        "": "",
    }
    for text, plain in cases.items():
        assert rest_plain(text) == plain, text
    form = RunForm()
    labels = dict(form.fields["reward_funcs"].choices)
    accuracy = labels["trainer.rewards.accuracy_reward"]
    assert "final answer equals solution under math-verify" in accuracy and "``" not in accuracy
    assert "exactly one \\boxed{...} answer" in labels["trainer.rewards.boxed_format_reward"]
    datasets = dict(form.source_choices["dataset"])
    assert "with a solution column" in datasets["arithmetic"] and "`" not in datasets["arithmetic"]
