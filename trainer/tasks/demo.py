"""The demo run: what ``make run`` starts, and the run form's preset for the ``tiny`` model.

Kept apart from :mod:`trainer.tasks.arithmetic` on purpose: that module is part of the tiny model's
source hash (changing it rebuilds the model), while the demo's hyper-parameters are tuned freely.
"""

from __future__ import annotations

import copy
import random

from trainer.tasks.arithmetic import LEVELS, problem_split, question_text, sample_problem

__all__ = [
    "CURRICULUM_LEVELS",
    "DEMO_RUN",
    "UNSEEN_LEVELS",
    "curriculum_rows",
    "demo_run_document",
    "unseen_fact_rows",
]

# The single-digit levels (a + b, a - b, a × b with a, b in 0..9): the warm start learns the facts of
# its train split well and generalises to the held-out ones only part-way (sampled accuracy ~0.5),
# which is where reward alone can teach the rest within minutes.
UNSEEN_LEVELS: tuple[int, ...] = tuple(i for i, (_, da, db) in enumerate(LEVELS) if da == db == 1)

# The demo's curriculum (``arithmetic-levels``): (level, split drawn from or None for both, weight
# among the rows). Measured by ``python -m bench.task_levels`` (bench/results/task-levels-cpu.json,
# sampled accuracy at T=1, share of groups of 8 with mixed rewards):
# * the held-out single-digit facts (+, -, x; eval split, ~55 problems): 0.46-0.56, mixed 0.36-0.6;
# * two-digit plus one-digit sums (``+ 2d 1d``, ~900 problems): the warm start trained on four in five
#   and still gets 0.10-0.12 of either split right, with mixed groups in 0.54-0.63: a level the run
#   learns by reward, and a pool large enough that 200 steps do not exhaust it. The harder levels
#   (``- 2d 1d`` and beyond: 0-0.04, mixed 0-0.29) would make most groups all-wrong, so they are out.
# Weighted toward the large level so an epoch holds as many of its rows as the run trains.
CURRICULUM_LEVELS: tuple[tuple[int, str | None, float], ...] = (
    *((level, "eval", 1.0) for level in UNSEEN_LEVELS),
    (next(i for i, spec in enumerate(LEVELS) if spec == ("+", 2, 1)), None, 5.0),
)

# Measured by ``python -m bench.demo_learning`` (docs/benchmarks.md, "Demo learning curve"):
# * the held-out single-digit facts start near 0.45 sampled accuracy and have room to rise, where the
#   whole task mix stays flat (39% of its prompts are beyond the model; the rest it has memorised);
# * ``token_budget: 256``: ~55 distinct prompts share prefixes (and often whole completions) in the
#   trie, so the default budget (the server's 1,024) packed up to 2,700 samples into one step and a
#   step waited ~10-40 s for them; 256 keeps steps near 1.5 s, so the curve moves every few seconds;
# * ``learning_rate: 1e-3``: the rise within ~40 steps (5e-4 was flat on this task mix).
# Measured by ``python -m bench.demo_pace`` (docs/benchmarks.md, "Demo pace"): served as one mix, the
# facts were learned within ~2 minutes and then most groups were all-correct and dropped, so each
# step waited for two to three times the generation, and converged completions (shared once in the
# token budget) packed hundreds of samples into a row: 1.6 s per step in the first minute, 18 s by
# the ninth. Hence:
# * ``loop_cls``: a curriculum over the task's levels (+, -, x, then two-digit sums), the spec's
#   ``loop_cls`` hook (:mod:`trainer.tasks.curriculum`): the run trains where its groups still disagree;
# * ``train_dataset: arithmetic-levels`` (:data:`CURRICULUM_LEVELS`): the facts alone are ~55 problems,
#   mastered or retired within ~40 steps, after which every step waited on generation for the few
#   prompts left (ratio of the last 20 steps' median step time to the first 20's: 6.3); with the
#   two-digit sums behind them the pool outlasts the run (ratio 0.84-1.22, step 200 at 2.4-2.7 min);
# * ``max_samples_per_row: 32``: a row closes at 32 samples however much they share;
# * ``retire_saturated_prompts: 2``: a problem whose groups were twice in a row all-equal (mastered,
#   or beyond the model for now) is skipped from then on (rows are told apart by their prompt, and
#   the facts recur across the rows), so generation goes to the problems still being learned.
DEMO_RUN: dict = {
    "model": "tiny",
    "train_dataset": "arithmetic-levels",
    "reward_funcs": ["trainer.rewards.accuracy_reward"],
    "loop_cls": "trainer.tasks.curriculum.LevelCurriculumLoop",
    "args": {
        "max_steps": 200,
        "num_generations": 8,
        "max_completion_length": 24,
        "learning_rate": 1e-3,
        "token_budget": 256,
        "max_samples_per_row": 32,
        "retire_saturated_prompts": 2,
        "max_staleness": 2,
        "log_completions": True,
        "save_steps": 50,
        "gradient_checkpointing": False,
        "dtype": "float32",
        "seed": 0,
        "disable_tqdm": True,
    },
}


def unseen_fact_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows (``prompt``, ``solution``, ``level``) of single-digit facts from the task's eval split,
    which the tiny model's warm start never trained on; deterministic given ``seed``.

    About 55 distinct problems, so each recurs often: the demo's reward is the model getting these
    right more often, from the reward alone.
    """
    rng = random.Random(f"arithmetic-unseen:{seed}")
    rows: list[dict] = []
    while len(rows) < n:
        problem = sample_problem(rng, rng.choice(UNSEEN_LEVELS))
        if problem_split(problem) != "eval":
            continue
        rows.append(
            {
                "prompt": [{"role": "user", "content": question_text(problem)}],
                "solution": str(problem.answer),
                "level": problem.level,
            }
        )
    return rows


def curriculum_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows (``prompt``, ``solution``, ``level``) of :data:`CURRICULUM_LEVELS`, each level drawn by
    its weight and its problems from its split; deterministic given ``seed``. The held-out facts
    recur (a few dozen problems), the two-digit sums rarely do (~900 problems)."""
    rng = random.Random(f"arithmetic-levels:{seed}")
    weights = [weight for _, _, weight in CURRICULUM_LEVELS]
    rows: list[dict] = []
    while len(rows) < n:
        level, split, _ = rng.choices(CURRICULUM_LEVELS, weights=weights)[0]
        problem = sample_problem(rng, level)
        while split is not None and problem_split(problem) != split:  # the level keeps its weight
            problem = sample_problem(rng, level)
        rows.append(
            {
                "prompt": [{"role": "user", "content": question_text(problem)}],
                "solution": str(problem.answer),
                "level": problem.level,
            }
        )
    return rows


def demo_run_document() -> dict:
    """A fresh copy of :data:`DEMO_RUN` (callers may change it)."""
    return copy.deepcopy(DEMO_RUN)
