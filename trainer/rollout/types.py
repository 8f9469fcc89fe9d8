"""The data that crosses the rollout process boundary: the spec's public dataclasses.

Token alignment used everywhere in this package: a :class:`TrainingSequence` is one flat list of
token ids. ``loss_mask[i] == 1`` means token ``i`` is trained, i.e. its log-probability is read from
the logits at position ``i - 1`` (so ``loss_mask[0]`` is always 0). Per-token sampler data
(``sampler_logprobs``, ``sampler_top_logprobs``, ``sampling_mask``) is indexed the same way and is
only meaningful where ``loss_mask`` is 1.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _new_rollout_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class TurnRecord:
    """One sampling request: the prompt sent to the sampler and the tokens it produced.

    Attributes:
        prompt_ids: token ids of the whole prompt sent this turn (all earlier turns included).
        output_ids: token ids the sampler generated.
        output_log_probs: sampler log-probability of each ``output_ids`` token (nats).
        output_mask: per ``output_ids`` token, 1 = trained, 0 = context only; ``None`` = all trained.
        output_sampling_mask: per token, the candidate token ids under top-k/top-p truncation;
            ``None`` = the full vocabulary.
        output_sampler_logprobs: per token, ``{token_id: logprob}`` of the sampler's most likely
            tokens (``num_sampler_logprobs`` of them), used by score centering.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    output_sampling_mask: list[list[int]] | None = None
    output_sampler_logprobs: list[dict[int, float]] | None = None
    # Not in the spec's signature: why generation stopped ("stop" = EOS/stop token, "length" = cut).
    finish_reason: str | None = None


@dataclass
class Rollout:
    """One finished rollout returned by ``AsyncRolloutLoop.generate_one``."""

    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=_new_rollout_id)


@dataclass
class TrainingSequence:
    """One training sample (what the loss is computed on), built from a rollout's turns.

    Attributes:
        input_ids: (T,) token ids: prompt, context and generated tokens in order.
        loss_mask: (T,) 1 where the token is trained (predicted from position ``i - 1``).
        sampler_logprobs: (T,) sampler log-probability of each trained token; 0.0 elsewhere.
        sampler_top_logprobs: (T,) per token ``{token_id: logprob}`` of the sampler's top tokens,
            or ``None`` (untrained tokens, or score centering off).
        sampling_mask: (T,) per token the candidate set under top-k/top-p, or ``None`` (full vocab).
        advantage: the rollout's advantage, set after the group is scored.
        model_version: policy version (weight updates) the rollout's first turn was sampled with.
        group_id, row_index, rollout_id: provenance (group within the run, dataset row, rollout).
        queued_at: ``time.time()`` when the sample entered the rollout queue (seconds).
    """

    input_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    sampler_top_logprobs: list[dict[int, float] | None] | None = None
    sampling_mask: list[list[int] | None] | None = None
    advantage: float = 0.0
    model_version: int = 0
    group_id: int = 0
    row_index: int = 0
    rollout_id: str = ""
    queued_at: float = 0.0

    @property
    def num_trained_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class RolloutGroup:
    """The ``num_generations`` rollouts of one prompt, scored together (one entry per rollout)."""

    prompts: list[list[dict[str, Any]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, Any]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None


@dataclass
class GroupResult:
    """What the rollout process puts on the rollout queue for one dispatched prompt (internal).

    Not in the spec's public API. Every dispatched or filtered prompt produces exactly one, so the
    trainer can count consumed prompts (epochs, ``rollout_state.json``) and release staleness
    allowance even when a group is dropped.

    Attributes:
        position: global prompt position, ``epoch * len(dataset) + row_index`` (resume / epochs).
        row_index: dataset row of the prompt.
        group_id: group counter within this rollout process (0-based).
        kind: ``"kept"`` (samples to train), ``"dropped"`` (identical rewards / < 2 scored) or
            ``"filtered"`` (rejected by ``filter_prompt``).
        samples: the kept group's training sequences (advantage set); empty otherwise.
        generated_tokens: tokens this group added to the queue/in-flight accounting (raw, unpacked:
            ``sum(len(s.input_ids))`` of its samples for kept groups, 0 otherwise).
        retired: this group retired its prompt (``retire_saturated_prompts``, rollout/retirement.py).
        restored_all: every retired prompt came back before this result (all had been retired).
        metrics: a kept group carries the rollout process's metric window (``MetricWindow.state()``,
            everything recorded since the last flush, this group's scores included), so the step
            that trains on it logs them; the 0.5 s flush to ``metrics_queue`` could reach the
            trainer only after that step's log. None for dropped and filtered groups.
    """

    position: int
    row_index: int
    group_id: int
    kind: str
    samples: list[TrainingSequence] = field(default_factory=list)
    generated_tokens: int = 0
    retired: bool = False
    restored_all: bool = False
    metrics: dict[str, Any] | None = None
