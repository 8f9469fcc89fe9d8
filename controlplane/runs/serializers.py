"""DRF serializers: input validation for the API, output shapes for runs and their data."""

from __future__ import annotations

import math
import re

import yaml
from django.conf import settings
from django.core.validators import MaxLengthValidator
from django.urls import reverse
from rest_framework import serializers
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from controlplane.runs.json_values import finite_or_none
from controlplane.runs.models import (
    COMPLETION_FIELDS,
    NOTE_CHARS_CEILING,
    TAG_CHARS_CEILING,
    TAGS_CEILING,
    Checkpoint,
    CompletionSample,
    MetricPoint,
    Run,
    RunEvent,
    RunEventKind,
    RunStatus,
)
from controlplane.runs.selectors import (
    COMPLETION_GROUP_FILTERS,
    COMPLETION_ORDERINGS,
    RUN_LIST_ORDERINGS,
    CompletionFilter,
    run_max_steps,
)
from controlplane.runs.validation import MAX_DOCUMENT_BYTES, MAX_DOCUMENT_DEPTH

METRIC_NAME_MAX_CHARS = MetricPoint._meta.get_field("name").max_length


def yaml_depth_error(text: str) -> str | None:
    """Refuse YAML nested deeper than ``MAX_DOCUMENT_DEPTH`` while it is parsed, from PyYAML's event
    stream: 64 KB of ``[[[[...`` is 32,000 levels, and building that document first cost 3.8 s of
    CPU before the depth check on the result could refuse it. Syntax errors are left to the loader."""
    if _flow_depth(text) > MAX_DOCUMENT_DEPTH:  # one pass over the characters, no parser
        return f"is nested deeper than {MAX_DOCUMENT_DEPTH} levels"
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DOCUMENT_DEPTH:
                    return f"is nested deeper than {MAX_DOCUMENT_DEPTH} levels"
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    return None


def _flow_depth(text: str) -> int:
    """The deepest nesting of unquoted ``[`` / ``{`` (YAML flow collections), scanning characters.

    Approximate on purpose: quotes are tracked without escapes, so it can only under-count (a
    plain scalar's apostrophe hides what follows), never refuse a document the parser would accept
    at that depth."""
    depth = deepest = 0
    quote = ""
    for ch in text:
        if quote:
            if ch == quote or ch == "\n":
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


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


def _comma_list(value: str) -> list[str]:
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
        statuses = _comma_list(value)
        unknown = [s for s in statuses if s not in RunStatus.values]
        if unknown:
            raise serializers.ValidationError(
                f"unknown status {unknown[0]!r}; one of {', '.join(RunStatus.values)}"
            )
        return statuses

    def validate_tag(self, value: str) -> list[str]:
        return _comma_list(value)

    def validate_id(self, value: str) -> list[int]:
        ids = _comma_list(value)
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


def _compare_run_ids(value: str) -> list[int]:
    """Comma-separated run ids, at most ``GRPO_COMPARE_MAX_RUNS`` distinct ones, in the order given."""
    parts = _comma_list(value)
    # ASCII digits within a bigint (str.isdigit accepts '²', and int('²') raises)
    bad = [part for part in parts if not re.fullmatch(r"[0-9]{1,18}", part)]
    if bad:
        raise serializers.ValidationError(
            f"{bad[0][:40]!r} is not a run id; give comma-separated ids, e.g. 3,5,8"
        )
    ids = list(dict.fromkeys(int(part) for part in parts))
    limit = settings.GRPO_COMPARE_MAX_RUNS
    if len(ids) > limit:
        raise serializers.ValidationError(
            f"at most {limit} runs are compared at once ({len(ids)} given); leave some out "
            "(the limit is the GRPO_COMPARE_MAX_RUNS setting)"
        )
    return ids


class CompareQuerySerializer(serializers.Serializer):
    """The comparison page: ``?runs=3,5,8&metrics=reward,loss`` (the page also folds in the run
    list's ``?run=3&run=5`` and the older one-metric ``?metric=reward``)."""

    runs = serializers.CharField(
        required=False, allow_blank=True, max_length=2000, help_text="comma-separated run ids"
    )
    metrics = serializers.CharField(
        required=False, allow_blank=True, max_length=10000, help_text="comma-separated metric names"
    )

    def validate_runs(self, value: str) -> list[int]:
        return _compare_run_ids(value)

    def validate_metrics(self, value: str) -> list[str]:
        names = list(dict.fromkeys(_comma_list(value)))
        long = [name for name in names if len(name) > 200]
        if long:
            raise serializers.ValidationError(
                f"{long[0][:40]!r}... is longer than a metric name (200 characters)"
            )
        limit = settings.GRPO_COMPARE_MAX_METRICS
        if len(names) > limit:
            raise serializers.ValidationError(
                f"at most {limit} metrics are charted at once ({len(names)} given); leave some out "
                "(the limit is the GRPO_COMPARE_MAX_METRICS setting)"
            )
        return names


NO_RUNS_CHOSEN = "give the runs to compare: comma-separated ids, e.g. ?ids=3,5"


class CompareApiQuerySerializer(serializers.Serializer):
    """``GET /api/v1/runs/compare/?ids=3,5``."""

    ids = serializers.CharField(
        max_length=2000,
        help_text="comma-separated run ids (the order of the answer's columns)",
        error_messages={"required": NO_RUNS_CHOSEN, "blank": NO_RUNS_CHOSEN},
    )

    def validate_ids(self, value: str) -> list[int]:
        ids = _compare_run_ids(value)
        if not ids:
            raise serializers.ValidationError(NO_RUNS_CHOSEN)
        return ids


class CompareRunSerializer(RunOutputSerializer):
    """A compared run: who and where it stands (its config is in the diff)."""

    class Meta(RunOutputSerializer.Meta):
        fields = ["id", "url", "name", "owner", "status", "tags"]


class ConfigDiffRowSerializer(serializers.Serializer):
    key = serializers.CharField(help_text="dotted path in the run document, e.g. args.learning_rate")
    values = serializers.ListField(
        child=serializers.JSONField(allow_null=True), help_text="one per run, in the runs' order"
    )
    present = serializers.ListField(
        child=serializers.BooleanField(), help_text="false where a run's document lacks the key"
    )
    differs = serializers.BooleanField(help_text="the runs do not all have one value for it")


class CompareOutputSerializer(serializers.Serializer):
    runs = CompareRunSerializer(many=True)
    diff = ConfigDiffRowSerializer(many=True, help_text="every key of the documents, sorted")


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


class CompletionOutputSerializer(serializers.ModelSerializer):
    class Meta:
        model = CompletionSample
        fields = list(COMPLETION_FIELDS)  # the API's rows and the downloads' columns are one list


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


# Steps are stored in PositiveIntegerField columns (int32 in Postgres).
MAX_STEP = 2**31 - 1


class MetricsQuerySerializer(serializers.Serializer):
    names = serializers.CharField(required=False, allow_blank=True, help_text="comma-separated metric names")
    since_step = serializers.IntegerField(
        required=False, min_value=0, max_value=MAX_STEP, help_text="only steps after this one"
    )
    layout = serializers.ChoiceField(
        choices=["points", "columns"],
        default="points",
        help_text='points: {"reward": [{"step", "value"}, ...]}; columns: {"reward": {"steps": [...], '
        '"values": [...]}} (compact; what the dashboard loads)',
    )

    def validate_names(self, value: str) -> list[str]:
        return [n.strip() for n in value.split(",") if n.strip()]


class MetricsOutputSerializer(serializers.Serializer):
    series = serializers.DictField(
        child=serializers.ListField(child=serializers.DictField()),
        help_text='{"reward": [{"step": 1, "value": 0.5}, ...]}',
    )
    steps = serializers.DictField(
        child=serializers.ListField(),
        required=False,
        help_text='layout=columns only: {"step": [...], "time": [unix seconds, ...], "attempt": [...]}, '
        "when each step was logged and by which attempt of the run",
    )


class ChartPreferenceSerializer(serializers.Serializer):
    """``PUT /api/v1/preferences/charts/``: ``pinned``, the metric names whose charts lead the run
    page, in order (duplicates dropped; at most ``GRPO_MAX_PINNED_CHARTS``). The answer adds
    ``default``: true while the user never saved a list (the default pins are shown)."""

    pinned = serializers.ListField(child=serializers.CharField(allow_blank=False, trim_whitespace=True))
    default = serializers.BooleanField(read_only=True)

    def validate_pinned(self, value: list[str]) -> list[str]:
        limit = settings.GRPO_MAX_PINNED_CHARTS
        names = list(dict.fromkeys(value))
        for name in names:
            if len(name) > METRIC_NAME_MAX_CHARS or not name.isprintable():
                raise serializers.ValidationError(
                    f"{name[:40]!r}: a metric name is at most {METRIC_NAME_MAX_CHARS} printable characters"
                )
        if len(names) > limit:
            raise serializers.ValidationError(
                f"{len(names)} pinned charts; at most {limit} (GRPO_MAX_PINNED_CHARTS): unpin some first"
            )
        return names


class PageSizeField(serializers.CharField):
    """``?page_size=`` as sent, never refused here: the paginators read it and use their default for
    a size they cannot use (DRF's documented leniency, which the API has kept since its first page)."""

    def run_validation(self, data=serializers.empty):
        return data if isinstance(data, str) else ""


class CompletionsQuerySerializer(serializers.Serializer):
    """``GET /api/v1/runs/<id>/completions/``: which samples, in which order, as samples or as groups
    (all optional; the downloads take the filters too)."""

    since_step = serializers.IntegerField(
        required=False, min_value=0, max_value=MAX_STEP, help_text="only steps after this one"
    )
    step = serializers.IntegerField(
        required=False, min_value=0, max_value=MAX_STEP, help_text="only this step"
    )
    q = serializers.CharField(
        required=False,
        allow_blank=True,  # an empty search box: every sample
        help_text="only samples whose prompt or completion contains this (any case); at most "
        "GRPO_COMPLETION_SEARCH_MAX_CHARS characters",
    )
    reward_min = serializers.FloatField(required=False, help_text="only samples with reward >= this")
    reward_max = serializers.FloatField(required=False, help_text="only samples with reward <= this")
    group_id = serializers.IntegerField(
        required=False, min_value=-(2**63), max_value=2**63 - 1, help_text="only this group"
    )
    groups = serializers.ChoiceField(
        choices=COMPLETION_GROUP_FILTERS,
        required=False,
        allow_blank=True,
        help_text="mixed: only groups whose rewards are not all equal (they carry a GRPO signal); "
        "zero_advantage: only groups whose every advantage is 0",
    )
    ordering = serializers.ChoiceField(
        choices=COMPLETION_ORDERINGS,
        default="-step",
        help_text="sort key, a leading - for descending; with by=group, reward sorts by the group's "
        "mean and advantage by its largest",
    )
    by = serializers.ChoiceField(
        choices=("sample", "group"),
        default="sample",
        help_text="group: pages of whole groups (GRPO_COMPLETION_GROUPS_PAGE_SIZE), each with all "
        "its rollouts, so no group is cut across pages",
    )
    # Read by the paginators, which (DRF's documented leniency, kept since the first API) use the
    # default for a page size they cannot use; only too many groups per page is refused.
    page_size = PageSizeField(required=False, help_text="samples (or groups) per page")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Read per request, like the other limits, so a changed setting applies without a restart.
        limit = settings.GRPO_COMPLETION_SEARCH_MAX_CHARS
        self.fields["q"].max_length = limit
        self.fields["q"].validators.append(
            MaxLengthValidator(limit, message=f"at most {limit} characters; search for a shorter part")
        )

    def validate_reward_min(self, value: float) -> float:
        return _finite(value)

    def validate_reward_max(self, value: float) -> float:
        return _finite(value)

    def validate(self, attrs: dict) -> dict:
        low, high = attrs.get("reward_min"), attrs.get("reward_max")
        if low is not None and high is not None and low > high:
            raise serializers.ValidationError({"reward_min": f"must be at most reward_max ({high})"})
        most = settings.GRPO_COMPLETION_GROUPS_MAX_PAGE_SIZE
        size = attrs.get("page_size", "")
        if attrs["by"] == "group" and size.isascii() and size.isdigit() and int(size) > most:
            raise serializers.ValidationError({"page_size": f"at most {most} groups per page with by=group"})
        return attrs

    def filters(self) -> CompletionFilter:
        """The validated filters (not the order) for the completion selectors."""
        data = self.validated_data
        return CompletionFilter(
            since_step=data.get("since_step"),
            step=data.get("step"),
            q=data.get("q") or None,
            reward_min=data.get("reward_min"),
            reward_max=data.get("reward_max"),
            group_id=data.get("group_id"),
            groups=data.get("groups") or None,
        )


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise serializers.ValidationError("a finite number")
    return value


class CompletionStepSerializer(serializers.Serializer):
    step = serializers.IntegerField()
    samples = serializers.IntegerField(help_text="samples stored at this step")


class CompletionRolloutSerializer(CompletionOutputSerializer):
    match = serializers.BooleanField(help_text="this rollout passes q and the reward range")

    class Meta(CompletionOutputSerializer.Meta):
        fields = [*CompletionOutputSerializer.Meta.fields, "match"]


class CompletionGroupSerializer(serializers.Serializer):
    """One group of ``?by=group``: its rollouts whole, whichever of them matched."""

    step = serializers.IntegerField()
    group_id = serializers.IntegerField(allow_null=True, help_text="null: the step's samples without a group")
    size = serializers.IntegerField(help_text="rollouts logged")
    matches = serializers.IntegerField(help_text="rollouts that pass q and the reward range")
    reward_min = serializers.FloatField(allow_null=True)
    reward_mean = serializers.FloatField(allow_null=True)
    reward_max = serializers.FloatField(allow_null=True)
    mixed = serializers.BooleanField(help_text="its rewards are not all equal")
    prompt = serializers.CharField(help_text="the first rollout's prompt")
    reference = serializers.CharField(help_text="the dataset row's reference answer, empty when none")
    rollouts = CompletionRolloutSerializer(many=True)


class DiagnosisOutputSerializer(serializers.Serializer):
    topic = serializers.CharField()
    verdict = serializers.CharField()
    title = serializers.CharField()
    severity = serializers.ChoiceField(choices=["ok", "info", "warn"])
    evidence = serializers.DictField(child=serializers.FloatField(allow_null=True))
    labels = serializers.DictField(
        child=serializers.CharField(), help_text="evidence key -> the spec's name or plain words for it"
    )
    advice = serializers.CharField()


class SafeJSONParser(JSONParser):
    """DRF's JSON parser, but a body nested too deeply for Python's ``json`` (``[[[[...`` 100k
    deep, a few hundred KB) is a 400 ``ParseError`` instead of an unhandled ``RecursionError`` (500).

    Installed as the first of ``REST_FRAMEWORK["DEFAULT_PARSER_CLASSES"]`` (settings.py).
    """

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type=media_type, parser_context=parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply") from None
