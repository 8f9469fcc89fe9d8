"""The run form: registry choices, the main hyper-parameters with the spec's defaults, and an
advanced JSON box for any other AsyncGRPOConfig field. It builds a RUN.yaml document and validates
it with the same function as the API (:func:`controlplane.runs.validation.run_document_validate`),
placing each error beside the field it names."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS

from controlplane.runs.selectors import MAIN_ARGS
from controlplane.runs.validation import MAX_DOCUMENT_BYTES, run_document_validate
from trainer import registry
from trainer.run_config import RunConfigError

MAX_VALIDATION_PASSES = 4
MAX_SOURCE_CHARS = 1000
# RUN.yaml's hub options, one form field each.
HUB_KEYS = ("model_revision", "dataset_revision", "dataset_config", "dataset_split", "dataset_columns")


def _arg_field(name: str, f: dataclasses.Field, annotation: Any) -> forms.Field:
    """A form field for one AsyncGRPOConfig field (int, float or bool), initial = its default."""
    label = name.replace("_", " ")
    help_text = f.metadata.get("help", "")
    types = set(typing.get_args(annotation)) or {annotation}
    if bool in types:
        return forms.BooleanField(required=False, initial=f.default, label=label, help_text=help_text)
    if float in types:
        return forms.FloatField(required=False, initial=f.default, label=label, help_text=help_text)
    return forms.IntegerField(required=False, initial=f.default, label=label, help_text=help_text)


def document_errors(*, document: dict) -> dict[str, str]:
    """Every error of :func:`run_document_validate` in ``document``, not just the first refusal.

    Type and name errors in ``args`` keep ``AsyncGRPOConfig`` from being built, and building it stops
    at its first refusal; so the keys already refused are taken out and the rest checked again (at
    most :data:`MAX_VALIDATION_PASSES` times). ``{}`` when the document is valid.
    """
    errors: dict[str, str] = {}
    args = dict(document.get("args") or {})
    for _ in range(MAX_VALIDATION_PASSES):
        try:
            run_document_validate(document={**document, "args": args})
        except RunConfigError as exc:
            errors.update({path: msg for path, msg in exc.errors.items() if path not in errors})
            refused = {path.split(".")[1] for path in exc.errors if path.startswith("args.")} & set(args)
            if not refused:
                break
            args = {key: value for key, value in args.items() if key not in refused}
        else:
            break
    return errors


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


def _registry_choices(kind: str) -> list[tuple[str, str]]:
    """``(name, label)`` of every working entry of ``kind``; the label has the first docstring line,
    the origin and, for rewards, the dataset columns read."""
    choices = []
    for name, entry in registry.entries(kind).items():
        reads = f"; reads {', '.join(entry.columns)}" if entry.columns else ""
        doc = f" - {entry.doc}" if entry.doc else ""
        choices.append((name, f"{name}{doc} ({entry.package} {entry.version}{reads})"))
    return choices


def _main_arg_fields() -> dict[str, tuple[forms.Field, Any]]:
    from trainer.config import AsyncGRPOConfig

    hints = typing.get_type_hints(AsyncGRPOConfig)
    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    return {name: (_arg_field(name, fields[name], hints[name]), fields[name].default) for name in MAIN_ARGS}


class RunForm(forms.Form):
    """Start a run. ``document()`` is the RUN.yaml document once ``is_valid()``."""

    name = forms.CharField(max_length=200, required=False, help_text="defaults to 'MODEL on DATASET'")
    # Typed, with the registered names offered (a <datalist>): a hub id the operator allows or an
    # allowed local path is typed too; run_document_validate decides what is accepted.
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
        clashes = sorted(set(value) & set(MAIN_ARGS))
        if clashes:
            raise forms.ValidationError(f"set {', '.join(clashes)} in the form's own fields, not here")
        return value

    def clean(self) -> dict:
        """Build the document from whatever cleaned and validate it even when some fields did not:
        every field error and every config error show at once, each beside its field."""
        data = super().clean()
        document = self._document_from(data)
        errors = document_errors(document=document)
        if errors:
            self.add_config_errors(errors)
        elif not self.errors:
            self._document = document
        return data

    def _document_from(self, data: dict) -> dict:
        """The RUN.yaml document of the cleaned values; a field that did not clean is left out of
        ``args`` (the spec's default stands in) so that the others can still be validated."""
        args: dict[str, Any] = {}
        for name in MAIN_ARGS:
            value = data.get(name)
            default = self._defaults[name]
            if isinstance(value, float) and value.is_integer() and isinstance(default, int):
                value = int(value)  # e.g. save_steps: annotated float, written as a step count
            if value is not None and value != default:
                args[name] = value
        args.update(data.get("advanced") or {})
        document: dict[str, Any] = {
            "model": (data.get("model") or "").strip(),
            "train_dataset": (data.get("train_dataset") or "").strip(),
            "reward_funcs": list(data.get("reward_funcs") or []),
        }
        for key in HUB_KEYS:
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
        if head in ("model", "train_dataset", "reward_funcs", *HUB_KEYS):
            return head
        if head.split(".", 1)[0] == "resources":
            return "resources"
        if path.startswith("args."):
            name = path.split(".")[1]
            return name if name in self.fields and name != "advanced" else "advanced"
        return None

    def document(self) -> dict:
        if self._document is None:
            raise ValueError("document() needs a valid form")
        return self._document
