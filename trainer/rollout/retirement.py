"""Retiring saturated prompts: ``retire_saturated_prompts`` (an extension beyond the spec, off by default).

A group whose scored rewards are all equal teaches nothing and is dropped (spec, "Saturation"); as a
task becomes easy, most groups are, and each step needs ever more generation to fill its rows. A
prompt whose groups had all-equal rewards ``retire_saturated_prompts`` times in a row is *retired*:
the dispatcher skips it (it counts as consumed, like a filtered prompt) instead of generating for it
again. The idea is DAPO's dynamic sampling and online difficulty filtering, applied before the
generation is spent rather than after.

Prompts are told apart by their content (:func:`prompt_key`: a digest of the row's ``prompt``, of
the whole row when it has none), not by their row: a dataset that repeats a problem in many rows (the
demo's ~4,000 rows hold a few dozen problems per level) counts every row of it toward one prompt, and
retires them together. "In a row" counts across the prompt's visits, whichever row and epoch brings
it, and a retired prompt stays retired for the rest of training. When every prompt of the dataset is
retired (known once a whole pass over the rows has shown every prompt), nothing could train: they
all come back (and their counts start again), which is logged.

The set lives in the rollout process; each :class:`~trainer.rollout.types.GroupResult` that retires a
prompt (or brings them all back) says so, the trainer keeps one row of each retired prompt in
``rollout_state.json`` (``retired_rows``), and a resume hands those rows back, read as prompts again.
Metrics: ``rollout/retired_prompts`` (retired now) and ``rollout/retired_fraction`` (of the distinct
prompts dispatched so far). Memory: one 8-byte digest per distinct prompt seen, only while on.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from trainer.reporting.metrics import ROLLOUT_RETIRED_FRACTION, ROLLOUT_RETIRED_PROMPTS, MetricWindow
from trainer.rollout.scoring import is_zero_std

logger = logging.getLogger(__name__)

__all__ = ["PromptRetirement", "is_saturated", "prompt_key"]


def is_saturated(rewards: np.ndarray) -> bool:
    """Whether a group's rewards, shape (G,) with NaN where unscored, are all equal over at least two
    scored rollouts: the drop rule (``is_zero_std``) less its "fewer than two scored" case, which
    says nothing about the prompt."""
    return int(np.count_nonzero(~np.isnan(rewards))) >= 2 and is_zero_std(rewards)


def prompt_key(row: Mapping[str, Any]) -> int:
    """The prompt a dataset row asks: a 64-bit digest of its ``prompt`` (text or messages), or of the
    whole row when it has none (an environment's reset builds the prompt from the row)."""
    content = row["prompt"] if "prompt" in row else dict(row)
    text = json.dumps(content, sort_keys=True, default=str, ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class PromptRetirement:
    """Counts each prompt's saturated groups in a row and keeps the retired prompts.

    Args:
        after: ``retire_saturated_prompts``: saturated groups in a row that retire a prompt; None or 0
            turns retirement off.
        num_rows: the dataset's rows (None for an ``IterableDataset``: no "all retired" check).
        retired: prompts already retired, as rows (a resume's ``rollout_state.json``): ``(row_index,
            row)`` pairs.
    """

    def __init__(
        self,
        after: int | None,
        num_rows: int | None,
        retired: Iterable[tuple[int, Mapping[str, Any]]] = (),
    ) -> None:
        self.after = int(after or 0)
        self.num_rows = num_rows
        # prompt key -> the row that retired it (kept for rollout_state.json)
        self.retired: dict[int, int] = (
            {prompt_key(row): int(index) for index, row in retired} if self.after else {}
        )
        self._in_a_row: dict[int, int] = {}
        self._seen: set[int] = set()  # distinct prompts dispatched (retired_fraction, "all retired")
        self._visits = 0  # rows the dispatcher asked about: a whole pass makes _seen complete
        self._restored = False

    @property
    def enabled(self) -> bool:
        return self.after > 0

    def key_of(self, row: Mapping[str, Any]) -> int | None:
        """``row``'s :func:`prompt_key`, taken once where the dispatcher reads the row; None while off."""
        return prompt_key(row) if self.enabled else None

    def record(self, row_index: int, key: int | None, rewards: np.ndarray) -> bool:
        """Count one scored group of the prompt ``key`` (:meth:`key_of`) dispatched from ``row_index``;
        True when it retires the prompt."""
        if key is None or not self.enabled:
            return False
        if not is_saturated(rewards):
            self._in_a_row.pop(key, None)
            return False
        count = self._in_a_row.get(key, 0) + 1
        self._in_a_row[key] = count
        if count >= self.after and key not in self.retired:
            self.retired[key] = row_index
            return True
        return False

    def skips(self, key: int | None) -> bool:
        """Whether the dispatcher skips the row whose prompt is ``key`` (:meth:`key_of`; retired). Once a
        whole pass over the dataset has shown that every prompt is retired, they all come back first
        (:meth:`take_restored` then says so once)."""
        if key is None or not self.enabled:
            return False
        self._seen.add(key)
        self._visits += 1
        if key not in self.retired:
            return False
        every_prompt_seen = self.num_rows is not None and self._visits >= self.num_rows
        if every_prompt_seen and len(self.retired) >= len(self._seen) and self._seen <= self.retired.keys():
            logger.warning(
                "every one of the dataset's %d prompts was retired (retire_saturated_prompts=%d): they "
                "all come back, their counts started again",
                len(self._seen),
                self.after,
            )
            self.retired.clear()
            self._in_a_row.clear()
            self._restored = True
            return False
        return True

    def is_retired(self, key: int) -> bool:
        """Whether the prompt with this :func:`prompt_key` is retired."""
        return key in self.retired

    def take_restored(self) -> bool:
        """True once after every retired prompt came back (for the next result to carry)."""
        restored, self._restored = self._restored, False
        return restored

    def record_metrics(self, window: MetricWindow) -> None:
        """``rollout/retired_prompts`` and ``rollout/retired_fraction`` as they stand now."""
        if not self.enabled:
            return
        window.add(ROLLOUT_RETIRED_PROMPTS, len(self.retired))
        if self._seen:
            window.add(ROLLOUT_RETIRED_FRACTION, min(1.0, len(self.retired) / len(self._seen)))
