"""Values as JSON carries them, shared by every layer that answers in JSON (selectors, serializers,
downloads, the ingest's live messages): kept apart so that none of them imports another's layer."""

from __future__ import annotations

import math

__all__ = ["finite_or_none"]


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN/inf: the API and the websocket send those as null."""
    return value if value is not None and math.isfinite(value) else None
