"""``rollout_state.json`` in a checkpoint: where the rollout process resumes in the prompt stream."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

ROLLOUT_STATE_NAME = "rollout_state.json"


def read_rollout_state(checkpoint: str | os.PathLike) -> int:
    """The first untrained prompt position stored in a checkpoint (0 when it has no rollout state)."""
    path = Path(checkpoint) / ROLLOUT_STATE_NAME
    if not path.exists():
        logger.warning(
            "%s has no %s: the rollout restarts from the first prompt", checkpoint, ROLLOUT_STATE_NAME
        )
        return 0
    return int(json.loads(path.read_text())["first_untrained_prompt_index"])


def read_rollout_counters(checkpoint: str | os.PathLike) -> dict[str, float]:
    """The running totals a checkpoint stored (``num_tokens``, ``consumed_prompts``), so that the
    metrics the spec defines as totals so far continue after a resume; {} when it stored none."""
    path = Path(checkpoint) / ROLLOUT_STATE_NAME
    if not path.exists():
        return {}
    counters = json.loads(path.read_text()).get("counters") or {}
    return {str(name): float(value) for name, value in counters.items()}


def read_retired_rows(checkpoint: str | os.PathLike) -> list[int]:
    """The dataset rows retired for saturation (``retire_saturated_prompts``) a checkpoint stored."""
    path = Path(checkpoint) / ROLLOUT_STATE_NAME
    if not path.exists():
        return []
    return [int(row) for row in json.loads(path.read_text()).get("retired_rows") or []]


def write_rollout_state(
    folder: Path,
    position: int,
    dataset,
    counters: dict[str, float] | None = None,
    retired_rows: Iterable[int] = (),
) -> None:
    """Write ``rollout_state.json``: the first untrained prompt position (global: epoch × len + row),
    the running totals ``counters`` (name -> value) that a resume continues from, and the rows
    retired for saturation (``retired_rows``, sorted)."""
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
    state = {
        "first_untrained_prompt_index": int(position),
        "epoch": int(position // size) if size else None,
        "row_index": int(position % size) if size else None,
        "counters": {name: float(value) for name, value in (counters or {}).items()},
        "retired_rows": sorted(int(row) for row in retired_rows),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ROLLOUT_STATE_NAME).write_text(json.dumps(state, indent=2))
