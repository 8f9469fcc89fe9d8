"""Which policy version each in-flight rollout samples from, when the server serves LoRA adapters.

With adapter-only weight sync (``trainer/weight_sync/lora.py``) every policy version is a separately
named adapter on the vLLM server. A rollout keeps the adapter of the version it started under across
all its turns, so it never switches policy mid-generation; the trainer deletes an adapter's files
only once no rollout is pinned to it, which it learns from the shared ``oldest_pinned_version``.
"""

from __future__ import annotations

import contextvars
from collections import Counter
from typing import Any

__all__ = ["AdapterPins", "lora_adapter_name"]

# The version the rollout running in the current asyncio task is pinned to (None: not pinned).
_pinned_version: contextvars.ContextVar[int | None] = contextvars.ContextVar("pinned_version", default=None)


def lora_adapter_name(lora_name: str, version: int) -> str:
    """The served name of the LoRA adapter of policy ``version`` (the trainer loads it under this name)."""
    return f"{lora_name}-v{version}"


class AdapterPins:
    """Per-task version pins and their counts.

    The pin lives in a context variable, so each rollout task (one ``asyncio`` task per rollout)
    carries its own; ``counts`` maps version -> rollouts pinned to it, across all tasks.
    ``oldest_pinned_version`` is the shared ``multiprocessing.Value('i')`` the trainer reads
    (``RolloutChannels.oldest_pinned_version``; None when nobody reads it, e.g. a loop in a test).
    """

    def __init__(self, model_version_value: Any, oldest_pinned_version: Any = None) -> None:
        self.model_version_value = model_version_value
        self.oldest_pinned_version = oldest_pinned_version
        self.counts: Counter[int] = Counter()

    @property
    def current(self) -> int | None:
        """The version the current task is pinned to."""
        return _pinned_version.get()

    def pin(self, version: int) -> None:
        """Pin the current task's rollout to ``version`` (its requests use that version's adapter)."""
        _pinned_version.set(version)
        self.counts[version] += 1
        self.report()

    def unpin(self) -> None:
        """Release the current task's pin (nothing happens in a task that holds none)."""
        version = _pinned_version.get()
        if version is None:
            return
        _pinned_version.set(None)
        self.counts[version] -= 1
        if self.counts[version] <= 0:
            del self.counts[version]
        self.report()

    def repin(self, version: int) -> None:
        self.unpin()
        self.pin(version)

    def report(self) -> None:
        """Publish the oldest version in use (the current one while nothing is pinned): the trainer
        deletes only older adapters' files."""
        if self.oldest_pinned_version is not None:
            current = int(self.model_version_value.value)
            self.oldest_pinned_version.value = min(self.counts, default=current)
