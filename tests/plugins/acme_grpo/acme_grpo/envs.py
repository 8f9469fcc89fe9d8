"""Environments of the example plugin."""

from __future__ import annotations


class LedgerEnv:
    """Keeps each episode's expected answer (no tools: the reward function scores the text)."""

    resets = 0

    def reset(self, answer: str, **kwargs) -> None:
        LedgerEnv.resets += 1
        self.answer = answer
