"""A user's own settings of the run pages (not of a run): the charts pinned at the top."""

from __future__ import annotations

from typing import Any

from controlplane.runs.models import ChartPreference


def chart_preference_update(*, user: Any, pinned: list[str]) -> ChartPreference:
    """Replace the user's pinned charts with ``pinned`` (metric names, in display order; the
    serializer checked their count against ``GRPO_MAX_PINNED_CHARTS`` and dropped duplicates).
    One upsert on the user, so two tabs saving at once leave one row, the later list."""
    preference, _ = ChartPreference.objects.update_or_create(user=user, defaults={"pinned": list(pinned)})
    return preference
