"""A run's metrics: the series query and answer, the user's pinned charts, the diagnosis."""

from __future__ import annotations

from django.conf import settings
from rest_framework import serializers

from controlplane.runs.models import (
    MetricPoint,
)

METRIC_NAME_MAX_CHARS = MetricPoint._meta.get_field("name").max_length


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
