"""Built-in reward functions (importable by dotted path, e.g. ``trainer.rewards.accuracy_reward``).

Every function follows the spec's reward contract: keyword arguments ``prompts``, ``completions``
(conversational: a list of message dicts per completion), ``completion_ids`` and every dataset
column except ``prompt``; it returns one ``float`` (or ``None`` = "does not apply") per completion.
All are module-level so they pickle into the rollout process.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

# math-verify logs a line per call when its SIGALRM timeout is off (see _parse).
logging.getLogger("math_verify").setLevel(logging.ERROR)

__all__ = [
    "accuracy_reward",
    "boxed_format_reward",
    "think_format_reward",
    "completion_length_reward",
    "completion_text",
]


def completion_text(completion: Any) -> str:
    """The assistant text of one completion: a conversational list of messages or a plain string.

    Tool-result messages are skipped; multi-message completions are joined with newlines.
    """
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion:
        if message.get("role", "assistant") == "assistant":
            content = message.get("content") or ""
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(content)
    return "\n".join(parts)


def _parse(text: str, gold: bool):
    # math-verify's default timeouts use SIGALRM, which only works in the main thread; sync reward
    # functions run in a thread pool (spec), so timeouts are disabled and inputs are short anyway.
    from math_verify import LatexExtractionConfig, parse
    from math_verify.parser import ExprExtractionConfig, NormalizationConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if gold:
            return parse(text, extraction_mode="first_match", parsing_timeout=None)
        config = [
            LatexExtractionConfig(
                normalization_config=NormalizationConfig(
                    nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
                ),
                boxed_match_priority=0,
                try_extract_without_anchor=False,
            ),
            ExprExtractionConfig(try_extract_without_anchor=False),
        ]
        return parse(text, extraction_config=config, extraction_mode="first_match", parsing_timeout=None)


def accuracy_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals ``solution`` under math-verify, else 0.0.

    The answer is read from ``\\boxed{...}`` (or an anchored expression such as ``answer: 42``).
    A gold ``solution`` that math-verify cannot parse yields ``None``: the completion is not scored
    by this function rather than scored wrong.
    """
    from math_verify import verify

    rewards: list[float | None] = []
    for completion, gold_text in zip(completions, solution, strict=True):
        gold = _parse(str(gold_text), gold=True)
        if not gold:
            rewards.append(None)
            continue
        answer = _parse(completion_text(completion), gold=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rewards.append(float(bool(answer) and verify(gold, answer, timeout_seconds=None)))
    return rewards


_BOXED_ONLY = re.compile(r"^\s*\\boxed\{[^{}]+\}\s*$")
_THINK = re.compile(r"^<think>\n?.*?\n?</think>\n?.*\S.*$", re.DOTALL)


def boxed_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly one ``\\boxed{...}`` answer (the built-in arithmetic format)."""
    return [1.0 if _BOXED_ONLY.match(completion_text(c)) else 0.0 for c in completions]


def think_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion opens with one ``<think>...</think>`` block followed by an answer."""
    out = []
    for c in completions:
        text = completion_text(c)
        out.append(1.0 if _THINK.match(text) and text.count("<think>") == 1 else 0.0)
    return out


def completion_length_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """The completion's length in tokens (the spec's example 1); useful to test that RL moves."""
    return [float(len(ids)) for ids in completion_ids]
