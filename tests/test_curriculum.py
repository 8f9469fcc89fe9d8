"""The demo's curriculum (trainer/tasks/curriculum.py), a rollout loop subclass on the spec's hooks:
which rows ``filter_prompt`` accepts at each stage, when ``compute_advantages`` moves it on, the
``curriculum/level`` metric, the guard against a level retirement emptied, and the errors a dataset
without levels gets. Its hooks are called here as the loop calls them (no vLLM); the demo trains
through it live in tests/test_demo_learning.py."""

from __future__ import annotations

import asyncio

import datasets
import numpy as np
import pytest

from controlplane.runs.validation import run_document_validate
from trainer.config.async_grpo_config import AsyncGRPOConfig
from trainer.plugins.registry import load_dataset_by_name
from trainer.reporting.metrics import CATALOGUE, CURRICULUM_LEVEL
from trainer.rollout.retirement import prompt_key
from trainer.rollout.types import RolloutGroup
from trainer.tasks.arithmetic import LEVELS, Problem, problem_split
from trainer.tasks.curriculum import LevelCurriculumLoop
from trainer.tasks.demo import curriculum_rows, demo_run_document

PASS, HALF = [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]


def level_rows(levels: list[int]) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "level": level} for i, level in enumerate(levels)
    ]


def make_loop(dataset, tmp_path, cls=LevelCurriculumLoop, **config) -> LevelCurriculumLoop:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=4, use_cpu=True, bf16=False, **config)
    loop = cls(
        config=args,
        model_name="m",
        dataset=dataset,
        reward_funcs=[],
        processing_class=None,
        eos_token_ids=[0],
    )
    asyncio.run(loop.setup())
    return loop


def group(row_index: int, rewards: list[float]) -> RolloutGroup:
    n = len(rewards)
    return RolloutGroup(
        prompts=[[]] * n, reward_kwargs={}, completions=[[]] * n, completions_ids=[[]] * n,
        completions_sequences=[[]] * n, tool_call_counts=[0] * n, tool_failure_counts=[0] * n,
        model_version=0, group_id=row_index, row_index=row_index, env_rewards=[None] * n,
        rollout_rewards=[None] * n, rewards=np.asarray(rewards, dtype=np.float64),
    )  # fmt: skip


def accepted(loop: LevelCurriculumLoop, rows: list[dict]) -> list[int]:
    return [i for i, row in enumerate(rows) if loop.filter_prompt(i, row, 0)]


def stages_logged(loop: LevelCurriculumLoop) -> list[float]:
    values = loop.window.state()["values"].get(CURRICULUM_LEVEL, [])
    loop.window.clear()
    return values


def test_levels_are_served_in_order_and_a_passed_window_moves_on(tmp_path):
    rows = level_rows([2, 0, 1, 0, 2, 1, 0, 1])  # levels sorted easiest first, whatever the row order
    loop = make_loop(rows, tmp_path)
    assert loop.levels == [0, 1, 2] and stages_logged(loop) == [0]
    assert accepted(loop, rows) == [1, 3, 6]

    # Half-passing groups of the level never move it on; other levels' groups (in flight from an
    # earlier stage) do not count toward the window.
    for _ in range(3 * loop.window_groups):
        advantages = loop.compute_advantages(group(1, HALF))
        loop.compute_advantages(group(2, PASS))
    assert loop.stage == 0
    np.testing.assert_allclose(advantages, [1, -1, 1, -1])  # GRPO's own advantages, unchanged
    # Passing groups do, once the last window_groups (a sliding window) average advance_at: after
    # 4 the last 8 average (4 x 0.5 + 4) / 8 = 0.75, after 5 they average 0.81.
    for _ in range(4):
        loop.compute_advantages(group(3, PASS))
    assert loop.stage == 0
    loop.compute_advantages(group(6, PASS))
    assert loop.stage == 1 and accepted(loop, rows) == [2, 5, 7]
    assert set(stages_logged(loop)) == {0, 1}

    # Unscored rollouts (NaN) are left out of the pass rate; all-NaN groups count for nothing.
    for _ in range(loop.window_groups):
        loop.compute_advantages(group(2, [np.nan] * 4))
    assert loop.stage == 1
    for _ in range(loop.window_groups):
        loop.compute_advantages(group(5, [1.0, np.nan, np.nan, np.nan]))
    assert loop.stage == 2 and accepted(loop, rows) == [0, 4]
    for _ in range(loop.window_groups):
        loop.compute_advantages(group(0, PASS))
    # Past the last level: every row again (a saturated last level cannot starve the run).
    assert loop.in_review and loop.stage == 3 and accepted(loop, rows) == list(range(len(rows)))
    loop.compute_advantages(group(0, PASS))
    assert loop.stage == 3 and stages_logged(loop)[-1] == 3


class StrictCurriculum(LevelCurriculumLoop):
    """A user's thresholds: a subclass's class attributes."""

    advance_at, window_groups, pass_reward = 1.0, 2, 0.5


def test_a_subclass_sets_the_thresholds_and_a_datasets_dataset_works(tmp_path):
    rows = level_rows([0, 0, 1, 1])
    loop = make_loop(datasets.Dataset.from_list(rows), tmp_path, cls=StrictCurriculum)
    loop.compute_advantages(group(0, [1.0, 1.0, 1.0, 0.5]))  # 0.5 is not above pass_reward
    loop.compute_advantages(group(1, PASS))
    assert loop.stage == 0
    loop.compute_advantages(group(0, PASS))
    assert loop.stage == 1 and accepted(loop, rows) == [2, 3]


def test_a_level_whose_rows_are_all_retired_is_passed_over(tmp_path):
    """With the level's rows retired and the others rejected, an epoch would accept nothing (the
    loop raises then, as the spec says): the curriculum moves on instead."""
    rows = level_rows([0, 1, 0, 1])
    loop = make_loop(rows, tmp_path, retire_saturated_prompts=1)
    assert loop.retirement.record(0, prompt_key(rows[0]), np.asarray(PASS))
    assert accepted(loop, rows) == [0, 2] and loop.stage == 0
    assert loop.retirement.record(2, prompt_key(rows[2]), np.asarray(PASS))
    assert accepted(loop, rows) == [1, 3] and loop.stage == 1


def test_a_dataset_without_levels_is_refused_naming_the_column_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"needs a train_dataset with a 'level' column .* set level_column"):
        make_loop([{"prompt": "p"}], tmp_path)
    iterable = datasets.Dataset.from_list(level_rows([0, 1])).to_iterable_dataset()
    with pytest.raises(ValueError, match="and a length"):
        make_loop(iterable, tmp_path)


def test_the_demo_trains_through_it_and_the_web_accepts_it_by_name():
    doc = demo_run_document()
    assert doc["loop_cls"] == "trainer.tasks.curriculum.LevelCurriculumLoop"
    assert run_document_validate(document=doc) == doc  # a registered rollout loop (grpo.rollout_loops)
    assert CATALOGUE[CURRICULUM_LEVEL].marks  # the run page marks its changes on every chart


def test_the_demo_dataset_is_the_held_out_facts_then_a_level_too_large_to_exhaust():
    """``arithmetic-levels``: levels 0-2 are single-digit facts of the eval split only (the warm start
    never saw them), level 3 two-digit plus one-digit sums of both splits, weighted so an epoch holds
    more of them than a 200-step demo trains; the same rows every call."""
    rows = list(load_dataset_by_name("arithmetic-levels"))  # the registry entry, as a run loads it
    assert len(rows) == 6000 and rows[:50] == curriculum_rows(6000)[:50]
    problems: dict[int, set[str]] = {}
    for row in rows:
        problems.setdefault(row["level"], set()).add(row["prompt"][0]["content"])
    assert sorted(problems) == [0, 1, 2, 3] and [LEVELS[i] for i in range(3)] == [
        ("+", 1, 1),
        ("-", 1, 1),
        ("×", 1, 1),
    ]
    assert LEVELS[3] == ("+", 2, 1)
    for level in (0, 1, 2):
        for text in problems[level]:
            a, op, b = text.removeprefix("What is ").removesuffix("?").split()
            assert problem_split(Problem(int(a), op, int(b), level)) == "eval", text
        assert 10 <= len(problems[level]) <= 25
    splits = {problem_split(Problem(int(t.split()[2]), "+", int(t.split()[4][:-1]), 3)) for t in problems[3]}
    assert splits == {"train", "eval"} and len(problems[3]) > 800
    level_rows = sum(row["level"] == 3 for row in rows)
    assert 0.55 < level_rows / len(rows) < 0.70  # weight 5 of 8
