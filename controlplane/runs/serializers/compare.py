"""Comparing runs: the ids a comparison takes (page and API) and the shape it answers."""

from __future__ import annotations

import re

from django.conf import settings
from rest_framework import serializers

from controlplane.runs.serializers.runs import RunOutputSerializer, comma_list


def _compare_run_ids(value: str) -> list[int]:
    """Comma-separated run ids, at most ``GRPO_COMPARE_MAX_RUNS`` distinct ones, in the order given."""
    parts = comma_list(value)
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
        names = list(dict.fromkeys(comma_list(value)))
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
