"""The spec's module path ``trl.trainer.async_grpo_trainer`` under this package's name.

A TRL user switches by changing ``trl`` to ``trainer`` in every import, the deep ones included::

    from trainer.trainer.async_grpo_trainer import AsyncGRPOTrainer, AsyncRolloutLoop, Rollout, TurnRecord

Each name lives in its own module (see the README's "Where each public name lives"); this module only
gathers them where the spec's signatures and examples look for them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from trainer.trainer import AsyncGRPOTrainer


@runtime_checkable
class _SupportsReset(Protocol):
    """What ``environment_factory`` must return (the spec's signature names this type): an object
    whose ``reset(**row)`` starts an episode and returns the initial observation (or None); its
    public methods are the tools the model may call."""

    def reset(self, **kwargs: Any) -> Any: ...


__all__ = [
    "AsyncGRPOTrainer",
    "AsyncRolloutLoop",
    "Rollout",
    "RolloutGroup",
    "TrainingSequence",
    "TurnRecord",
    "_SupportsReset",
]
