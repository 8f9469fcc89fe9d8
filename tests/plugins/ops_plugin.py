"""A plugin module for GRPO_PLUGIN_MODULES (operators without packaging): ``register(add)``."""

from __future__ import annotations

__version__ = "0.9"


def shout_reward(completions: list, **kwargs) -> list[float]:
    """1.0 for completions in capitals."""
    return [1.0 if str(c).isupper() else 0.0 for c in completions]


def register(add) -> None:
    add("reward_func", "tests.plugins.ops_plugin:shout_reward")
