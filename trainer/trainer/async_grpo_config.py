"""The spec's module path ``trl.trainer.async_grpo_config`` under this package's name::

    from trainer.trainer.async_grpo_config import AsyncGRPOConfig

The class itself lives in :mod:`trainer.config.async_grpo_config`.
"""

from __future__ import annotations

from trainer.config.async_grpo_config import AsyncGRPOConfig

__all__ = ["AsyncGRPOConfig"]
