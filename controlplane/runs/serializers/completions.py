"""A run's sampled completions: the list's query (filters, ordering, pages), rows, groups and
their rollouts, the steps that have any."""

from __future__ import annotations

import math

from django.conf import settings
from django.core.validators import MaxLengthValidator
from rest_framework import serializers

from controlplane.runs.models import (
    COMPLETION_FIELDS,
    CompletionSample,
    CompletionSplit,
)
from controlplane.runs.selectors import (
    COMPLETION_GROUP_FILTERS,
    COMPLETION_ORDERINGS,
    CompletionFilter,
)
from controlplane.runs.serializers.metrics import MAX_STEP


class CompletionOutputSerializer(serializers.ModelSerializer):
    class Meta:
        model = CompletionSample
        fields = list(COMPLETION_FIELDS)  # the API's rows and the downloads' columns are one list


class PageSizeField(serializers.CharField):
    """``?page_size=`` as sent, never refused here: the paginators read it and use their default for
    a size they cannot use (DRF's documented leniency, which the API has kept since its first page)."""

    def run_validation(self, data=serializers.empty):
        return data if isinstance(data, str) else ""


def _split_field() -> serializers.ChoiceField:
    return serializers.ChoiceField(
        choices=CompletionSplit.values,
        default=CompletionSplit.TRAIN,
        help_text="train: the training rollouts (the default); eval: the completions scored on "
        "eval_dataset (step: the step whose weights were evaluated)",
    )


class CompletionsQuerySerializer(serializers.Serializer):
    """``GET /api/v1/runs/<id>/completions/``: which samples, in which order, as samples or as groups
    (all optional; the downloads take the filters too)."""

    split = _split_field()
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
            split=data["split"],
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


class CompletionStepsQuerySerializer(serializers.Serializer):
    """``GET /api/v1/runs/<id>/completions/steps/``: the steps of one split."""

    split = _split_field()


class CompletionStepSerializer(serializers.Serializer):
    step = serializers.IntegerField()
    samples = serializers.IntegerField(help_text="samples stored at this step")


class CompletionRolloutSerializer(CompletionOutputSerializer):
    match = serializers.BooleanField(help_text="this rollout passes q and the reward range")

    class Meta(CompletionOutputSerializer.Meta):
        fields = [*CompletionOutputSerializer.Meta.fields, "match"]


class CompletionGroupSerializer(serializers.Serializer):
    """One group of ``?by=group``: its rollouts whole, whichever of them matched."""

    split = serializers.ChoiceField(choices=CompletionSplit.values)
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
