"""Runs in and out of the API: creation, the list and its query, updates (name, tags, notes), one
run's shape, its events and checkpoints."""

from __future__ import annotations

import re

import yaml
from django.conf import settings
from django.urls import reverse
from rest_framework import serializers

from controlplane.runs.json_values import finite_or_none
from controlplane.runs.models import (
    NOTE_CHARS_CEILING,
    TAG_CHARS_CEILING,
    TAGS_CEILING,
    Checkpoint,
    Run,
    RunEvent,
    RunEventKind,
    RunStatus,
)
from controlplane.runs.selectors import (
    RUN_LIST_ORDERINGS,
    run_max_steps,
)
from controlplane.runs.serializers.parsing import yaml_depth_error
from controlplane.runs.validation import MAX_DOCUMENT_BYTES


class RunCreateInputSerializer(serializers.Serializer):
    """``{"name": optional, "config": {RUN.yaml document}}``; config errors are keyed by field path."""

    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    config = serializers.JSONField(
        help_text="The RUN.yaml document (model, train_dataset, reward_funcs, args, ...), as a JSON "
        "object or as YAML text"
    )

    def validate_config(self, value):
        if isinstance(value, str):
            if len(value) > MAX_DOCUMENT_BYTES:
                raise serializers.ValidationError(
                    {"config": f"is {len(value)} characters of YAML; the limit is {MAX_DOCUMENT_BYTES}"}
                )
            depth_error = yaml_depth_error(value)
            if depth_error:
                raise serializers.ValidationError({"config": depth_error})
            try:
                value = yaml.safe_load(value)
            except (yaml.YAMLError, ValueError) as exc:  # ValueError: e.g. an integer too long to parse
                raise serializers.ValidationError({"config": f"not valid YAML: {exc}"}) from None
            except RecursionError:
                raise serializers.ValidationError({"config": "not valid YAML: nested too deeply"}) from None
        # The document itself is validated once, by services.run_create (the view maps its errors
        # under "config"): here only the YAML text is read.
        return value


class RunCreatedSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    status = serializers.CharField()
    url = serializers.URLField()
    web_url = serializers.URLField()


def run_created_payload(run: Run, request) -> dict:
    return {
        "id": run.pk,
        "status": run.status,
        "url": request.build_absolute_uri(reverse("runs-api:run-detail", args=[run.pk])),
        "web_url": request.build_absolute_uri(reverse("runs:detail", args=[run.pk])),
    }


class RunOutputSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username")
    url = serializers.SerializerMethodField()
    resumed_from_step = serializers.IntegerField(source="resumed_from.step", default=None, allow_null=True)

    class Meta:
        model = Run
        fields = [
            "id",
            "url",
            "name",
            "owner",
            "status",
            "failure_reason",
            "config",
            "config_sha256",
            "created_at",
            "launched_at",
            "started_at",
            "finished_at",
            "heartbeat_at",
            "attempt",
            "resumed_from_step",
            "output_dir",
            "celery_task_id",
            "worker_host",
            "placement",
            "waiting_reason",
            "sources",
            "vllm_port",
            "vllm_pid",
            "trainer_pid",
            "vllm_exit_code",
            "trainer_exit_code",
            "tags",
            "note",
        ]

    def get_url(self, run: Run) -> str:
        request = self.context.get("request")
        path = reverse("runs-api:run-detail", args=[run.pk])
        return request.build_absolute_uri(path) if request else path


class RunListOutputSerializer(RunOutputSerializer):
    """A run without its config, with where it stands: ``step`` (highest logged step, null before
    the first), ``max_steps`` (null when the run is measured in epochs), ``last_reward``. Built from
    ``selectors.run_list_search`` (which annotates them)."""

    step = serializers.IntegerField(source="last_step", allow_null=True, read_only=True)
    max_steps = serializers.SerializerMethodField()
    last_reward = serializers.SerializerMethodField()

    class Meta(RunOutputSerializer.Meta):
        fields = [f for f in RunOutputSerializer.Meta.fields if f != "config"] + [
            "step",
            "max_steps",
            "last_reward",
        ]

    def get_max_steps(self, run: Run) -> int | None:
        return run_max_steps(run=run)

    def get_last_reward(self, run: Run) -> float | None:
        return finite_or_none(getattr(run, "last_reward", None))


# A tag: letters, digits and _ . : / + = - (no spaces or commas: ?tag=a,b lists several).
TAG_PATTERN = re.compile(r"[\w.:/+=-]+")


def comma_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


class RunListQuerySerializer(serializers.Serializer):
    """``GET /api/v1/runs/`` and the run list page: filters, search and order (all optional)."""

    status = serializers.CharField(
        required=False, allow_blank=True, help_text="comma-separated statuses (any of them)"
    )
    owner = serializers.CharField(
        required=False, allow_blank=True, max_length=150, help_text="exact username"
    )
    model = serializers.CharField(
        required=False, allow_blank=True, max_length=200, help_text="substring of the config's model"
    )
    dataset = serializers.CharField(
        required=False, allow_blank=True, max_length=200, help_text="substring of the config's train_dataset"
    )
    tag = serializers.CharField(
        required=False, allow_blank=True, max_length=1000, help_text="comma-separated tags (all of them)"
    )
    q = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=200,
        help_text="substring of the name, note, model, dataset, owner or a tag",
    )
    id = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=2000,
        help_text="comma-separated run ids (what a list page polls: its rows, whatever their status now)",
    )
    ordering = serializers.ChoiceField(
        choices=[o for key in RUN_LIST_ORDERINGS for o in (key, "-" + key)],
        default="-created",
        help_text="sort key; a leading - sorts descending",
    )

    def validate_status(self, value: str) -> list[str]:
        statuses = comma_list(value)
        unknown = [s for s in statuses if s not in RunStatus.values]
        if unknown:
            raise serializers.ValidationError(
                f"unknown status {unknown[0]!r}; one of {', '.join(RunStatus.values)}"
            )
        return statuses

    def validate_tag(self, value: str) -> list[str]:
        return comma_list(value)

    def validate_id(self, value: str) -> list[int]:
        ids = comma_list(value)
        # ASCII digits within a bigint (str.isdigit accepts '²', and int('²') raises)
        if not all(re.fullmatch(r"[0-9]{1,18}", part) for part in ids):
            raise serializers.ValidationError("comma-separated run ids")
        return [int(part) for part in ids]

    def filters(self) -> dict:
        """The validated query as ``selectors.run_list_search`` keyword arguments."""
        data = self.validated_data
        return {
            "ids": data.get("id") or None,
            "statuses": data.get("status") or None,
            "owner": data.get("owner") or None,
            "model": data.get("model") or None,
            "dataset": data.get("dataset") or None,
            "tags": data.get("tag") or None,
            "q": data.get("q") or None,
            "ordering": data["ordering"],
        }


class RunUpdateInputSerializer(serializers.Serializer):
    """``PATCH /api/v1/runs/<id>/``: the run's ``tags`` (replaced as a whole; duplicates dropped,
    order kept) and/or ``note``. Limits: ``GRPO_RUN_MAX_TAGS`` tags of ``GRPO_RUN_TAG_MAX_CHARS``
    characters, a note of ``GRPO_RUN_NOTE_MAX_CHARS``."""

    tags = serializers.ListField(
        child=serializers.CharField(allow_blank=False, trim_whitespace=True), required=False
    )
    note = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False)

    def validate_tags(self, value: list[str]) -> list[str]:
        max_tags = min(settings.GRPO_RUN_MAX_TAGS, TAGS_CEILING)
        max_chars = min(settings.GRPO_RUN_TAG_MAX_CHARS, TAG_CHARS_CEILING)
        tags = list(dict.fromkeys(value))
        for tag in tags:
            if len(tag) > max_chars:
                raise serializers.ValidationError(
                    f"tag {tag[:max_chars]!r}... is longer than {max_chars} characters"
                )
            if not TAG_PATTERN.fullmatch(tag):
                raise serializers.ValidationError(
                    f"tag {tag!r}: only letters, digits and _ . : / + = - (no spaces or commas)"
                )
        if len(tags) > max_tags:
            raise serializers.ValidationError(f"{len(tags)} tags; at most {max_tags}")
        return tags

    def validate_note(self, value: str) -> str:
        limit = min(settings.GRPO_RUN_NOTE_MAX_CHARS, NOTE_CHARS_CEILING)
        if len(value) > limit:
            raise serializers.ValidationError(f"{len(value)} characters; at most {limit}")
        return value

    def validate(self, attrs: dict) -> dict:
        if not attrs:
            raise serializers.ValidationError("give tags and/or note")
        return attrs


class EventOutputSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["id", "created_at", "kind", "message"]


class EventsQuerySerializer(serializers.Serializer):
    after_id = serializers.IntegerField(
        required=False, min_value=0, max_value=2**63 - 1, help_text="only events with a larger id"
    )
    kind = serializers.ChoiceField(
        choices=RunEventKind.choices, required=False, allow_blank=True, help_text="only events of this kind"
    )
    q = serializers.CharField(
        required=False,
        allow_blank=True,  # an empty search box: every event
        max_length=200,
        help_text="only events whose message contains this (any case)",
    )


class CheckpointOutputSerializer(serializers.ModelSerializer):
    class Meta:
        model = Checkpoint
        fields = ["step", "path", "created_at"]
