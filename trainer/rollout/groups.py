"""From finished rollouts to one group: training sequences, per-rollout metrics, logged completions.

The rollout loop (``loop.py``) gathers the ``num_generations`` outcomes of one prompt; these pure
functions turn them into the :class:`~trainer.rollout.types.RolloutGroup` that is scored, record the
``rollout/*`` and ``tools/call_frequency`` metrics, and format the completions the trainer logs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.reporting.metrics import (
    ROLLOUT_DRIFT_TOKENS_MAX,
    ROLLOUT_DRIFT_TOKENS_MEAN,
    ROLLOUT_DURATION_S,
    ROLLOUT_FORK_FRAC,
    ROLLOUT_SAMPLES_PER_ROLLOUT,
    ROLLOUT_TURNS_MAX,
    ROLLOUT_TURNS_MEAN,
    ROLLOUT_VLLM_RETRY_COUNT,
    TOOLS_CALL_FREQUENCY,
    TOOLS_FAILURE_FREQUENCY,
    MetricWindow,
)
from trainer.rollout.multiturn import reconcile_turns
from trainer.rollout.scoring import GroupScore
from trainer.rollout.types import Rollout, RolloutGroup, TrainingSequence

__all__ = [
    "RolloutOutcome",
    "ReconcileStats",
    "build_group",
    "record_rollout_metrics",
    "completion_records",
    "messages_text",
    "REFERENCE_COLUMNS",
    "reference_answer",
]

# Dataset columns that hold a row's reference answer, in the order they are looked for: the first
# one present (and not None) is logged with each completion as ``reference`` (completions.jsonl).
REFERENCE_COLUMNS = ("answer", "solution", "ground_truth", "reference", "target")

# Per rollout: (fork flags per turn transition (0/1), drift tokens per turn transition).
ReconcileStats = tuple[list[int], list[int]]


@dataclass
class RolloutOutcome:
    """One finished rollout as the loop saw it: the prompt it was given (after the environment's
    ``reset``), the rollout, the environment's own reward (class, value) and its wall time in s."""

    prompt: list[dict[str, Any]]
    rollout: Rollout
    env_reward: tuple[type, float] | None
    duration_s: float


def build_group(
    row: dict[str, Any],
    row_index: int,
    group_id: int,
    version: int,
    outcomes: Sequence[RolloutOutcome],
) -> tuple[RolloutGroup, list[ReconcileStats]]:
    """The scored-to-be group of G = ``len(outcomes)`` rollouts and, per rollout, its reconciliation.

    Each rollout's turns are reconciled into training sequences (one per fork, ``multiturn.py``),
    stamped with the group's policy ``version``, ``group_id``, ``row_index`` and rollout id. The
    row's columns other than ``prompt`` become the reward functions' keyword arguments (G copies).
    """
    g = len(outcomes)
    sequences: list[list[TrainingSequence]] = []
    stats: list[ReconcileStats] = []
    for outcome in outcomes:
        reconciled = reconcile_turns(outcome.rollout.turns)
        for seq in reconciled.sequences:
            seq.model_version = version
            seq.group_id = group_id
            seq.row_index = row_index
            seq.rollout_id = outcome.rollout.rollout_id
        sequences.append(reconciled.sequences)
        stats.append((reconciled.forks, reconciled.drift_tokens))
    group = RolloutGroup(
        prompts=[o.prompt for o in outcomes],
        reward_kwargs={k: [v] * g for k, v in row.items() if k != "prompt"},
        completions=[o.rollout.completion for o in outcomes],
        completions_ids=[o.rollout.completion_ids for o in outcomes],
        completions_sequences=sequences,
        tool_call_counts=[o.rollout.tool_call_count for o in outcomes],
        tool_failure_counts=[o.rollout.tool_failure_count for o in outcomes],
        model_version=version,
        group_id=group_id,
        row_index=row_index,
        env_rewards=[o.env_reward for o in outcomes],
        rollout_rewards=[o.rollout.reward for o in outcomes],
    )
    return group, stats


def record_rollout_metrics(
    window: MetricWindow,
    outcomes: Sequence[RolloutOutcome],
    group: RolloutGroup,
    reconcile_stats: Sequence[ReconcileStats],
    has_tools: bool,
) -> int:
    """Per-rollout generation metrics (``rollout/*``, ``tools/call_frequency``) of one group, dropped
    or kept. Returns the group's generated tokens (every turn's sampled ids, tool results excluded)."""
    # A sum that reads 0 (not absent) in windows without retries, so dashboards plot a line.
    window.add(ROLLOUT_VLLM_RETRY_COUNT, 0)
    generated = 0
    for outcome, seqs, (forks, drift) in zip(
        outcomes, group.completions_sequences, reconcile_stats, strict=True
    ):
        rollout = outcome.rollout
        generated += sum(len(t.output_ids) for t in rollout.turns)
        window.add(ROLLOUT_DURATION_S, outcome.duration_s)
        window.add(ROLLOUT_TURNS_MEAN, len(rollout.turns))
        window.add(ROLLOUT_TURNS_MAX, len(rollout.turns))
        window.add(ROLLOUT_SAMPLES_PER_ROLLOUT, len(seqs))
        window.extend(ROLLOUT_FORK_FRAC, forks)
        window.extend(ROLLOUT_DRIFT_TOKENS_MEAN, drift)
        window.extend(ROLLOUT_DRIFT_TOKENS_MAX, drift)
        if has_tools:
            window.add(TOOLS_CALL_FREQUENCY, rollout.tool_call_count)
            if rollout.tool_call_count == 0:  # failure_frequency is NaN in a window without calls
                window.add(TOOLS_FAILURE_FREQUENCY, math.nan)
    return generated


def completion_records(
    group: RolloutGroup, score: GroupScore, advantages: np.ndarray
) -> list[dict[str, Any]]:
    """One logged completion per rollout (``log_completions``): prompt and completion as text, the
    summed reward (None when no function scored it), each source's reward, the (G,) advantage, and
    the dataset row's reference answer (:func:`reference_answer`; None when the row has none).

    The row's columns other than ``prompt`` reach here as the group's ``reward_kwargs`` (G copies)."""
    reference = reference_answer({k: v[0] for k, v in group.reward_kwargs.items() if v})
    records = []
    for i, (prompt, completion) in enumerate(zip(group.prompts, group.completions, strict=True)):
        reward = score.rewards[i]
        records.append(
            {
                "prompt": messages_text(prompt),
                "completion": messages_text(completion),
                "reward": None if math.isnan(reward) else float(reward),
                "rewards": {
                    name: float(values[i])
                    for name, values in score.per_source.items()
                    if not math.isnan(values[i])
                },
                "advantage": float(advantages[i]),
                "group_id": group.group_id,
                "row_index": group.row_index,
                "reference": reference,
            }
        )
    return records


def reference_answer(row: dict[str, Any]) -> str | None:
    """The row's reference answer as text: the first of :data:`REFERENCE_COLUMNS` it has (not
    None); strings as they are, anything else as JSON (``42`` -> ``"42"``). None when it has none."""
    for column in REFERENCE_COLUMNS:
        value = row.get(column)
        if value is not None:
            return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return None


def messages_text(messages: Any) -> str:
    """Messages as readable text for logged completions (one ``role: content`` line per message)."""
    if isinstance(messages, str):
        return messages
    if len(messages) == 1 and messages[0].get("role") == "assistant":
        return str(messages[0].get("content") or "")
    lines = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = ", ".join(
                f"{c['function']['name']}({c['function']['arguments']})" for c in m["tool_calls"]
            )
            content = f"{content} [tool calls: {calls}]".strip()
        lines.append(f"{m.get('role', '?')}: {content}")
    return "\n".join(lines)
