"""The demo run: what ``make run`` starts, and the run form's preset for the ``tiny`` model.

Kept apart from :mod:`trainer.tasks.arithmetic` on purpose: that module is part of the tiny model's
source hash (changing it rebuilds the model), while the demo's hyper-parameters are tuned freely.
"""

from __future__ import annotations

import copy
import random

from trainer.tasks.arithmetic import LEVELS, problem_split, question_text, sample_problem

__all__ = ["DEMO_RUN", "UNSEEN_LEVELS", "demo_run_document", "unseen_fact_rows"]

# The single-digit levels (a + b, a - b, a × b with a, b in 0..9): the warm start learns the facts of
# its train split well and generalises to the held-out ones only part-way (sampled accuracy ~0.5),
# which is where reward alone can teach the rest within minutes.
UNSEEN_LEVELS: tuple[int, ...] = tuple(i for i, (_, da, db) in enumerate(LEVELS) if da == db == 1)

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
# * ``loop_cls``: a curriculum over the task's levels (+, -, x), the spec's ``loop_cls`` hook
#   (:mod:`trainer.tasks.curriculum`): the run trains where its groups still disagree;
# * ``max_samples_per_row: 32``: a row closes at 32 samples however much they share;
# * ``retire_saturated_prompts: 2``: in the review stage (every level again, once each is passed) most
#   problems are mastered and their groups all-correct; a problem whose groups were twice in a row
#   all-equal is skipped from then on (rows are told apart by their prompt, and the ~55 problems
#   recur across the 4,000 rows), so generation goes to the problems still being learned.
DEMO_RUN: dict = {
    "model": "tiny",
    "train_dataset": "arithmetic-unseen",
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


def demo_run_document() -> dict:
    """A fresh copy of :data:`DEMO_RUN` (callers may change it)."""
    return copy.deepcopy(DEMO_RUN)
