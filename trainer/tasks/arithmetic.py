"""Procedural arithmetic: the built-in task the embedded tiny model is warm-started on and RL-trained on.

Rows are conversational (``{"prompt": [{"role": "user", "content": ...}], "solution": "68"}``) so that
``trainer.rewards.accuracy_reward`` scores them through math-verify; the model answers ``\\boxed{68}``.
Difficulty varies by operation and operand size, from single-digit sums a tiny model learns at once to
three-digit sums and two-digit products it does not, so sampled rewards within a group are mixed.
Every problem belongs to exactly one split, decided by a hash of the problem itself, so the train and
eval splits never share a problem whatever seeds are used.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

__all__ = [
    "LEVELS",
    "LEVEL_WEIGHTS",
    "Problem",
    "arithmetic_rows",
    "problem_split",
    "question_text",
    "sample_problem",
]

SPLITS = ("train", "eval")
# One problem in EVAL_MODULUS goes to the eval split (20%).
EVAL_MODULUS = 5

# (operator, digits of the left operand, digits of the right operand), easiest first.
# The mix is what sets the warm-started model's accuracy: the first levels are learned within the
# build budget, the last ones are not, which leaves room for RL.
LEVELS: tuple[tuple[str, int, int], ...] = (
    ("+", 1, 1),
    ("-", 1, 1),
    ("×", 1, 1),
    ("+", 2, 1),
    ("-", 2, 1),
    ("+", 2, 2),
    ("-", 2, 2),
    ("×", 2, 1),
    ("+", 3, 3),
)
# Relative frequency of each level. Weighted toward the easy levels so the warm-started tiny model
# lands at 23-41% accuracy sampled at T=1 (measured over 8 build seeds), with mixed rewards in about
# half of the groups of 8.
LEVEL_WEIGHTS: tuple[float, ...] = (4, 4, 3, 2, 1, 1, 1, 1, 1)


@dataclass(frozen=True)
class Problem:
    """One ``a op b`` question; ``level`` indexes ``LEVELS``."""

    a: int
    op: str
    b: int
    level: int

    @property
    def answer(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        return self.a * self.b


def question_text(problem: Problem) -> str:
    """The user message: short and system-free, so rows of one group share the whole prompt."""
    return f"What is {problem.a} {problem.op} {problem.b}?"


def problem_split(problem: Problem) -> str:
    """``"eval"`` or ``"train"``: a stable hash of the problem (not of the seed) decides."""
    digest = hashlib.sha256(f"{problem.a}{problem.op}{problem.b}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_MODULUS == 0 else "train"


def _operand(rng: random.Random, digits: int) -> int:
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def sample_problem(rng: random.Random, level: int | None = None) -> Problem:
    """A random problem of ``level`` (drawn by ``LEVEL_WEIGHTS`` when None), either split."""
    if level is None:
        level = rng.choices(range(len(LEVELS)), weights=LEVEL_WEIGHTS)[0]
    op, da, db = LEVELS[level]
    a, b = _operand(rng, da), _operand(rng, db)
    if op == "-" and da == db and rng.random() < 0.7:
        # Mostly non-negative differences at equal sizes; some negatives keep the sign in play.
        a, b = max(a, b), min(a, b)
    return Problem(a, op, b, level)


def arithmetic_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` rows of ``split`` ("train" or "eval"), deterministic given ``seed``.

    Each row: ``prompt`` (one user message), ``solution`` (the integer answer as text, what
    ``accuracy_reward`` reads) and ``level`` (index into ``LEVELS``; higher is harder).
    Problems may repeat within a split (the small levels have few distinct problems).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"arithmetic:{split}:{seed}")
    rows: list[dict] = []
    while len(rows) < n:
        problem = sample_problem(rng)
        if problem_split(problem) != split:
            continue
        rows.append(
            {
                "prompt": [{"role": "user", "content": question_text(problem)}],
                "solution": str(problem.answer),
                "level": problem.level,
            }
        )
    return rows
