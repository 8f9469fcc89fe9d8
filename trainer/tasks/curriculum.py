"""A curriculum over a dataset's levels, built on the spec's own hook: a rollout loop subclass (T11).

The demo (:mod:`trainer.tasks.demo`) trains through it, and it is the documented example of
``loop_cls`` (docs/config.md): a run document names it (``loop_cls:
trainer.tasks.curriculum.LevelCurriculumLoop``), or a trainer subclass sets it::

    class CurriculumTrainer(AsyncGRPOTrainer):
        loop_cls = LevelCurriculumLoop

Why a curriculum: on a fixed mix, a task the policy masters turns into groups whose rollouts all
pass; they teach nothing and are dropped (spec, "Saturation"), so each step needs ever more
generation and the run slows as it succeeds. Served one level at a time, the policy trains where its
groups still disagree, and moves on once a level is passed.

How it serves: the dataset's ``level_column`` (numbers or strings, sorted easiest first) splits the
rows into levels. ``filter_prompt`` accepts the rows of the current level only (the others count as
consumed, as the spec says of a rejected prompt). ``compute_advantages`` sees every scored group of
the current level and keeps its pass rate (the share of scored rollouts whose reward is above
``pass_reward``); once the last ``window_groups`` groups average at least ``advance_at``, the next
level begins. After the last level, every row is served (the ``review`` stage), so a saturated last
level cannot starve the run. A level whose every prompt ``retire_saturated_prompts`` has retired is
passed over as well (with every other level rejected, an epoch would have nothing to train on).

Logged: ``curriculum/level`` (the stage: the level's index, ``len(levels)`` for the review), which
the run page marks on every chart where it changes. Change the thresholds with a subclass (class
attributes below). The level is the rollout process's state: a resumed run starts at the first level
again and passes the levels it has mastered within a window each.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np

from trainer.reporting.metrics import CURRICULUM_LEVEL
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.types import RolloutGroup

logger = logging.getLogger(__name__)

__all__ = ["LevelCurriculumLoop"]


class LevelCurriculumLoop(AsyncRolloutLoop):
    """Serve a dataset level by level, advancing when the current level's groups pass.

    Class attributes (override in a subclass):
        level_column: the dataset column naming each row's level.
        advance_at: mean group pass rate over the window that passes a level, in [0, 1].
        window_groups: scored groups of the current level in the window.
        pass_reward: a rollout passes when its summed reward is above this.
    """

    level_column: str = "level"
    advance_at: float = 0.8
    window_groups: int = 8
    pass_reward: float = 0.0

    async def setup(self) -> None:
        """Index the rows by level (needs a dataset with ``len``: an ``IterableDataset`` cannot be split)."""
        await super().setup()
        try:
            if hasattr(self.dataset, "column_names"):  # a datasets.Dataset: the column at once
                column = list(self.dataset[self.level_column])
            else:  # a list of row dicts
                column = [row[self.level_column] for row in self.dataset]
            len(self.dataset)  # an IterableDataset has none: its rows cannot be indexed by level
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{type(self).__name__} needs a train_dataset with a {self.level_column!r} column and a "
                f"length (got {type(self.dataset).__name__}: {exc}); set level_column on a subclass to name "
                "another column"
            ) from exc
        self.levels: list[Any] = sorted(set(column))
        self._stage_of_row: list[int] = [self.levels.index(value) for value in column]
        # The prompts of each level (retirement counts prompts, not rows): read only when retiring.
        self._prompts_of_stage: list[set[int]] = [set() for _ in self.levels]
        if self.retirement.enabled:
            for row, stage in zip(self.dataset, self._stage_of_row, strict=True):
                self._prompts_of_stage[stage].add(self.retirement.key_of(row))
        self.stage = 0
        self._pass_rates: deque[float] = deque(maxlen=self.window_groups)
        self._record_stage()

    @property
    def in_review(self) -> bool:
        """Past the last level: every row is served."""
        return self.stage >= len(self.levels)

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Accept the current level's rows (every row in the review stage)."""
        while not self.in_review and self._level_retired():
            self._advance("every prompt of the level is retired")
        return self.in_review or self._stage_of_row[row_index] == self.stage

    def _level_retired(self) -> bool:
        prompts = self._prompts_of_stage[self.stage]
        return bool(prompts) and all(self.retirement.is_retired(key) for key in prompts)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """Count the group toward its level's window (if it is the current level), then GRPO's advantages."""
        rewards = np.asarray(group.rewards, dtype=np.float64)
        scored = rewards[~np.isnan(rewards)]
        if not self.in_review and len(scored) and self._stage_of_row[group.row_index] == self.stage:
            self._pass_rates.append(float(np.mean(scored > self.pass_reward)))
            window = len(self._pass_rates)
            if window == self.window_groups and sum(self._pass_rates) / window >= self.advance_at:
                self._advance(f"pass rate {sum(self._pass_rates) / window:.2f} over {window} groups")
        self._record_stage()
        return super().compute_advantages(group)

    def _advance(self, why: str) -> None:
        self.stage += 1
        self._pass_rates.clear()
        where = "review (every level)" if self.in_review else f"level {self.levels[self.stage]!r}"
        logger.info("curriculum: %s -> %s", why, where)
        self._record_stage()

    def _record_stage(self) -> None:
        self.window.add(CURRICULUM_LEVEL, self.stage)
