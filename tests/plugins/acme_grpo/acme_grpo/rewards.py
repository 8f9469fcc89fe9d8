"""Rewards of the example plugin."""

from __future__ import annotations

import re


def exact_answer(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 when the last integer in the completion equals the row's `answer`, else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = (
            completion if isinstance(completion, str) else "".join(m.get("content") or "" for m in completion)
        )
        numbers = re.findall(r"-?\d+", text)
        scores.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return scores
