"""The built-in models and datasets as registry entries: zero-argument loaders, declared as entry
points in this project's ``pyproject.toml`` exactly as a plugin package declares its own
(:mod:`trainer.plugins.registry`). Each docstring's first line is what the form and the API show."""

from __future__ import annotations

__all__ = ["arithmetic", "arithmetic_levels", "arithmetic_small", "arithmetic_unseen", "tiny_model"]


def tiny_model() -> str:
    """The embedded random-init Qwen3-architecture model, warm-started on arithmetic (no network)."""
    from trainer.plugins.registry import cache_root
    from trainer.tiny.build import ensure_tiny

    return str(ensure_tiny(cache_root() / "tiny"))


def arithmetic() -> list[dict]:
    """Procedural arithmetic prompts (conversational) with a `solution` column, 4,000 rows."""
    from trainer.tasks.arithmetic import arithmetic_rows

    return arithmetic_rows(4000, seed=0, split="train")


def arithmetic_small() -> list[dict]:
    """The same task, 256 rows (quick runs, tests)."""
    from trainer.tasks.arithmetic import arithmetic_rows

    return arithmetic_rows(256, seed=0, split="train")


def arithmetic_unseen() -> list[dict]:
    """Single-digit facts the tiny model's warm start never saw (~55 problems), 4,000 rows: the demo's."""
    from trainer.tasks.demo import unseen_fact_rows

    return unseen_fact_rows(4000, seed=0)


def arithmetic_levels() -> list[dict]:
    """The demo's curriculum, 6,000 rows: the held-out single-digit facts (levels 0-2), then two-digit
    plus one-digit sums (level 3, ~900 problems the warm start gets ~12% right)."""
    from trainer.tasks.demo import curriculum_rows

    return curriculum_rows(6000, seed=0)
