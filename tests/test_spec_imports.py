"""The spec's imports with ``trl`` changed to ``trainer`` resolve (issue 23 items 1, 2, 8)."""

from __future__ import annotations

import importlib
import warnings

import pytest

import trainer
from trainer.config.async_grpo_config import AsyncGRPOConfig

# Every import the spec's examples and signatures use, with `trl` replaced by `trainer`.
SPEC_IMPORTS = {
    "trainer": ["AsyncGRPOTrainer", "AsyncGRPOConfig"],
    "trainer.rewards": ["accuracy_reward"],
    "trainer.trainer.async_grpo_trainer": [
        "AsyncGRPOTrainer",
        "AsyncRolloutLoop",
        "Rollout",
        "TurnRecord",
        "RolloutGroup",
        "TrainingSequence",
        "_SupportsReset",
    ],
    "trainer.trainer.async_grpo_config": ["AsyncGRPOConfig"],
    # the config's module path before trainer/ was grouped into rooms (issue 33): still importable
    "trainer.config": ["AsyncGRPOConfig"],
}


@pytest.mark.parametrize("module", sorted(SPEC_IMPORTS))
def test_the_spec_module_paths_resolve_to_the_same_objects(module):
    imported = importlib.import_module(module)
    for name in SPEC_IMPORTS[module]:
        value = getattr(imported, name)
        if name in trainer.__all__:
            assert value is getattr(trainer, name), (module, name)


def test_an_environment_with_reset_is_a_supports_reset():
    from trainer.trainer.async_grpo_trainer import _SupportsReset

    class Env:
        def reset(self, **row):
            return "start"

    assert isinstance(Env(), _SupportsReset) and not isinstance(object(), _SupportsReset)


def test_bf16_default_without_an_accelerator_is_off_and_bf16_weights_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the float32 default says nothing
        assert AsyncGRPOConfig(output_dir="unused").bf16 is False
    with pytest.warns(UserWarning, match="dtype=bfloat16 weights with bf16 mixed precision off"):
        AsyncGRPOConfig(output_dir="unused", dtype="bfloat16")
