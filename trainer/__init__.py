"""Asynchronous GRPO trainer: the spec's public API (a TRL user switches by changing the import).

    from trainer import AsyncGRPOTrainer, AsyncGRPOConfig
    from trainer.rewards import accuracy_reward

Names are imported lazily so that ``import trainer`` stays cheap (the rollout process and the CLI
import only what they use).
"""

from __future__ import annotations

import importlib
from typing import Any

from trainer.processes import spawn_startup as _spawn_startup

_EXPORTS = {
    "AsyncGRPOConfig": "trainer.config.async_grpo_config",
    "AsyncGRPOTrainer": "trainer.trainer",
    "AsyncRolloutLoop": "trainer.rollout.loop",
    "Rollout": "trainer.rollout.types",
    "TurnRecord": "trainer.rollout.types",
    "RolloutGroup": "trainer.rollout.types",
    "TrainingSequence": "trainer.rollout.types",
}

__all__ = sorted(_EXPORTS)

# A spawned rollout process re-imports the user's script, which imports this package: from here on
# an error of that start-up phase reaches the trainer's failure message (trainer/processes/spawn_startup.py).
_spawn_startup.record_startup_errors()


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
