"""The run form: registry choices, the main hyper-parameters with the spec's defaults (from the run
schema, :mod:`trainer.config.run_schema`), and an advanced JSON box for any other AsyncGRPOConfig field. It
checks its own fields' shapes and builds a RUN.yaml document; the document is validated by the
service (:func:`controlplane.runs.services.run_create`, as for the API) and each of its errors is
placed beside the field it names (:meth:`RunForm.add_config_errors`)."""

from __future__ import annotations

import json
import re
from typing import Any

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS

from controlplane.runs.selectors import EVAL_ARGS, MAIN_ARGS
from controlplane.runs.validation import MAX_DOCUMENT_BYTES
from trainer.config.run_schema import FIELDS, FieldSpec
from trainer.plugins import registry

MAX_SOURCE_CHARS = 1000
# RUN.yaml's hub options, one form field each.
HUB_KEYS = ("model_revision", "dataset_revision", "dataset_config", "dataset_split", "dataset_columns")
# RUN.yaml's evaluation set (issue 30), one form field each; its args are EVAL_ARGS.
EVAL_KEYS = ("eval_dataset", "eval_dataset_split", "eval_dataset_revision", "eval_dataset_config")


def _arg_field(name: str, spec: FieldSpec) -> forms.Field:
    """A form field for one AsyncGRPOConfig field (int, float or bool), initial = its default."""
    label = name.replace("_", " ")
    kinds = spec.kinds or ()
    if spec.choices:
        return forms.ChoiceField(
            required=False,
            initial=spec.default,
            label=label,
            help_text=spec.help,
            choices=[(c, c) for c in spec.choices],
        )
    if "bool" in kinds:
        return forms.BooleanField(required=False, initial=spec.default, label=label, help_text=spec.help)
    if "float" in kinds:
        return forms.FloatField(required=False, initial=spec.default, label=label, help_text=spec.help)
    return forms.IntegerField(required=False, initial=spec.default, label=label, help_text=spec.help)


def _json_object(text: str | None, *, example: str) -> dict:
    """A field's JSON object text as a dict (empty text: ``{}``); errors show ``example``."""
    text = (text or "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise forms.ValidationError(f"not valid JSON; e.g. {example}") from None
    if not isinstance(value, dict):
        raise forms.ValidationError(f"must be a JSON object, e.g. {example}")
    return value


# reST inline markup, roughly by docutils' recognition rules: a backslash escape of a markup
# character, ``literal``, :role:`text` (or `text`:role:), `interpreted`, `link <url>`_ and `ref`_,
# **strong**, *emphasis* (not inside a word: 2*3*4 stays).
_REST_INLINE = re.compile(
    r"\\(?P<escaped>[\\*`_|])"
    r"|``(?P<literal>\S(?:.*?\S)?)``"
    r"|(?::[A-Za-z][\w.+:-]*:)?`(?P<interpreted>[^`]+)`(?::[A-Za-z][\w.+:-]*:|_{1,2})?"
    r"|(?<![\w*])\*\*(?P<strong>[^\s*](?:.*?[^\s*])?)\*\*(?![\w*])"
    r"|(?<![\w*])\*(?P<emphasis>[^\s*](?:[^*]*?[^\s*])?)\*(?![\w*])"
)
_REFERENCE = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.S)


def _rest_piece(match: re.Match[str]) -> str:
    kind = match.lastgroup
    text = match.group(kind)
    if kind != "interpreted":
        return text
    reference = _REFERENCE.match(text)
    if reference:  # `title <target>`: the title (the target when there is none)
        return reference["title"] or reference["target"]
    text = text.lstrip("!")  # :func:`!name`: no link, same text
    return text[1:].rsplit(".", 1)[-1] if text.startswith("~") else text  # :func:`~a.b.c` -> c


def rest_plain(text: str) -> str:
    """``text`` with its reST inline markup taken out, as a reader of the rendered docs sees it:
    ``"1.0 when ``solution`` matches :func:`~math.isclose`, *else* 0"`` -> ``"1.0 when solution
    matches isclose, else 0"``. What a literal holds is kept as it is (``\\boxed{...}`` included)."""
    return _REST_INLINE.sub(_rest_piece, text)


def _registry_choices(kind: str) -> list[tuple[str, str]]:
    """``(name, label)`` of every working entry of ``kind``; the label has the first docstring line
    (without its reST markup), the origin and, for rewards, the dataset columns read."""
    choices = []
    for name, entry in registry.entries(kind).items():
        reads = f"; reads {', '.join(entry.columns)}" if entry.columns else ""
        doc = f" - {rest_plain(entry.doc)}" if entry.doc else ""
        choices.append((name, f"{name}{doc} ({entry.package} {entry.version}{reads})"))
    return choices


def _main_arg_fields() -> dict[str, tuple[forms.Field, Any]]:
    """The main hyper-parameters' and the evaluation args' fields, each with its default."""
    return {name: (_arg_field(name, FIELDS[name]), FIELDS[name].default) for name in (*MAIN_ARGS, *EVAL_ARGS)}


class RunForm(forms.Form):
    """Start a run. ``document()`` is the RUN.yaml document once ``is_valid()``."""

    name = forms.CharField(max_length=200, required=False, help_text="defaults to 'MODEL on DATASET'")
    # Typed, with the registered names offered (a <datalist>): a hub id the operator allows or an
    # allowed local path is typed too; services.run_create decides what is accepted.
    model = forms.CharField(
        max_length=MAX_SOURCE_CHARS,
        initial="tiny",
        widget=forms.TextInput(attrs={"list": "model-choices", "autocomplete": "off", "size": 50}),
        help_text="a registered model, a hub id the operator allows (GRPO_ALLOWED_HUB_MODELS), or an "
        "allowed local directory",
    )
    train_dataset = forms.CharField(
        label="dataset",
        max_length=MAX_SOURCE_CHARS,
        widget=forms.TextInput(attrs={"list": "dataset-choices", "autocomplete": "off", "size": 50}),
        help_text="a registered dataset, a hub id the operator allows (GRPO_ALLOWED_HUB_DATASETS), or an "
        "allowed local file or directory",
    )
    model_revision = forms.CharField(
        required=False, max_length=200, help_text="hub models: branch, tag or commit"
    )
    dataset_revision = forms.CharField(required=False, max_length=200, help_text="hub datasets: the same")
    dataset_config = forms.CharField(
        required=False, max_length=200, help_text="the dataset's config name, if any"
    )
    dataset_split = forms.CharField(required=False, max_length=200, help_text="default: train")
    eval_dataset = forms.CharField(
        label="eval dataset",
        required=False,
        max_length=MAX_SOURCE_CHARS,
        widget=forms.TextInput(attrs={"list": "dataset-choices", "autocomplete": "off", "size": 50}),
        help_text="held-out prompts scored during training (the same forms as the dataset, read with "
        "its column names); needs an eval strategy below",
    )
    eval_dataset_split = forms.CharField(
        required=False,
        max_length=200,
        help_text="default: test (a registered dataset or .jsonl file has one)",
    )
    eval_dataset_revision = forms.CharField(
        required=False, max_length=200, help_text="hub datasets: branch, tag or commit"
    )
    eval_dataset_config = forms.CharField(required=False, max_length=200, help_text="its config name, if any")
    dataset_columns = forms.CharField(
        required=False,
        max_length=4000,
        widget=forms.TextInput(attrs={"size": 50, "spellcheck": "false"}),
        help_text='JSON: the dataset\'s columns -> the names the run reads, e.g. {"question": "prompt"}',
    )
    resources = forms.CharField(
        required=False,
        max_length=4000,
        widget=forms.TextInput(attrs={"size": 50, "spellcheck": "false"}),
        help_text='JSON: GPUs and processes (docs/cluster.md), e.g. {"vllm": {"gpus": 1}, "trainer": '
        '{"gpus": 2}} or {"server": "vllm", "trainer": {"processes": 2}}; empty: the worker\'s defaults',
    )
    reward_funcs = forms.MultipleChoiceField(
        label="reward functions",
        choices=(),
        widget=forms.CheckboxSelectMultiple,
        initial=["trainer.rewards.accuracy_reward"],
    )
    advanced = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 6, "cols": 70, "spellcheck": "false"}),
        help_text='JSON object of any other AsyncGRPOConfig fields, e.g. {"top_k": 0, "epsilon": 0.2}',
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["reward_funcs"].choices = _registry_choices("reward_func")
        self.source_choices = {"model": _registry_choices("model"), "dataset": _registry_choices("dataset")}
        self._defaults: dict[str, Any] = {}
        for name, (field, default) in _main_arg_fields().items():
            self.fields[name] = field
            self._defaults[name] = default
        self._document: dict | None = None

    @property
    def main_arg_names(self) -> tuple[str, ...]:
        return MAIN_ARGS

    @property
    def eval_names(self) -> tuple[str, ...]:
        """The evaluation section's fields: the eval set, then its args."""
        return (*EVAL_KEYS, *EVAL_ARGS)

    def clean_dataset_columns(self) -> dict:
        return _json_object(self.cleaned_data.get("dataset_columns"), example='{"question": "prompt"}')

    def clean_resources(self) -> dict:
        return _json_object(self.cleaned_data.get("resources"), example='{"trainer": {"gpus": 2}}')

    def clean_advanced(self) -> dict:
        text = (self.cleaned_data.get("advanced") or "").strip()
        if not text:
            return {}
        if len(text) > MAX_DOCUMENT_BYTES:
            raise forms.ValidationError(f"is {len(text)} characters; the limit is {MAX_DOCUMENT_BYTES}")
        try:
            value = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
            raise forms.ValidationError(f"not valid JSON: {exc}") from None
        except RecursionError:
            raise forms.ValidationError("not valid JSON: nested too deeply") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("must be a JSON object of AsyncGRPOConfig fields")
        clashes = sorted(set(value) & {*MAIN_ARGS, *EVAL_ARGS})
        if clashes:
            raise forms.ValidationError(f"set {', '.join(clashes)} in the form's own fields, not here")
        return value

    def clean(self) -> dict:
        """Build the document from whatever cleaned (also when some fields did not: the view then
        validates the rest of it, so that every error shows at once; :meth:`draft_document`)."""
        data = super().clean()
        self._document = self._document_from(data)
        return data

    def _document_from(self, data: dict) -> dict:
        """The RUN.yaml document of the cleaned values; a field that did not clean is left out of
        ``args`` (the spec's default stands in) so that the others can still be validated."""
        args: dict[str, Any] = {}
        for name in (*MAIN_ARGS, *EVAL_ARGS):
            value = data.get(name)
            default = self._defaults[name]
            if value == "" and default is not None:
                value = None  # an empty choice: the default
            if (
                isinstance(value, float)
                and value.is_integer()
                and (isinstance(default, int) or (default is None and value >= 1))
            ):
                value = int(value)  # e.g. save_steps, eval_steps: annotated float, written as a step count
            if value is not None and value != default:
                args[name] = value
        args.update(data.get("advanced") or {})
        document: dict[str, Any] = {
            "model": (data.get("model") or "").strip(),
            "train_dataset": (data.get("train_dataset") or "").strip(),
            "reward_funcs": list(data.get("reward_funcs") or []),
        }
        for key in (*HUB_KEYS, *EVAL_KEYS):
            value = data.get(key)
            if value:
                document[key] = value.strip() if isinstance(value, str) else value
        if data.get("resources"):
            document["resources"] = data["resources"]
        document["args"] = args
        return document

    def add_config_errors(self, errors: dict[str, str]) -> None:
        """Put each ``{field path: message}`` beside the form field it names, except on fields that
        already carry their own error (a value that did not clean was not what was validated)."""
        had_errors = {name for name in self.errors if name != NON_FIELD_ERRORS}
        for path, message in errors.items():
            field = self.field_for_path(path)
            if field in had_errors:
                continue
            self.add_error(field, message if field not in (None, "advanced") else f"{path}: {message}")

    def field_for_path(self, path: str) -> str | None:
        head = path.split("[", 1)[0]
        if head in ("model", "train_dataset", "reward_funcs", *HUB_KEYS, *EVAL_KEYS):
            return head
        if head.split(".", 1)[0] == "resources":
            return "resources"
        if path.startswith("args."):
            name = path.split(".")[1]
            return name if name in self.fields and name != "advanced" else "advanced"
        return None

    def document(self) -> dict:
        """The RUN.yaml document of a valid form (not yet validated: ``services.run_create`` does)."""
        if self._document is None or self.errors:
            raise ValueError("document() needs a valid form")
        return self._document

    def draft_document(self) -> dict:
        """The document built from the fields that cleaned (after ``is_valid()``, valid or not)."""
        if self._document is None:
            raise ValueError("draft_document() needs is_valid() first")
        return self._document
