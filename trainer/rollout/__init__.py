"""The rollout side of the async GRPO trainer: the spawned process that generates and scores.

Public names (the spec's API): :class:`AsyncRolloutLoop`, :class:`Rollout`, :class:`TurnRecord`,
:class:`RolloutGroup`, :class:`TrainingSequence`; for the trainer: :func:`start_rollout_process`,
:class:`RolloutWorkerHandle`, :class:`RolloutChannels`, :class:`GroupResult`, :func:`check_picklable`.

Names are imported lazily so that ``import trainer.rollout.types`` does not pull in the HTTP client.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncRolloutLoop": "trainer.rollout.loop",
    "lora_adapter_name": "trainer.rollout.pinning",
    "Rollout": "trainer.rollout.types",
    "TurnRecord": "trainer.rollout.types",
    "RolloutGroup": "trainer.rollout.types",
    "TrainingSequence": "trainer.rollout.types",
    "GroupResult": "trainer.rollout.types",
    "RolloutWorkerHandle": "trainer.rollout.process",
    "RolloutChannels": "trainer.rollout.channels",
    "start_rollout_process": "trainer.rollout.process",
    "check_rollout_picklable": "trainer.rollout.process",
    "check_picklable": "trainer.rollout.scoring",
    "VLLMClient": "trainer.rollout.vllm_client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer.rollout' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
