"""Datasets of the example plugin."""

from __future__ import annotations

import random


def sums() -> list[dict]:
    """Single-digit sums with an `answer` column, 512 rows."""
    rng = random.Random(0)
    rows = []
    for _ in range(512):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})
    return rows
