"""Evaluation during training (an extension beyond the spec, issue 30): held-out prompts scored
through the run's own vLLM server, beside the rollouts.

The trainer asks for a pass when transformers' ``eval_strategy`` says so, after the step's weights
reached the server (:class:`EvalRequest`: the step, its policy version, its log's wall time). The
rollout process runs it as one more task of its event loop (:func:`run_eval_pass`): every eval
prompt's ``eval_num_generations`` completions are requested at once, outside the rollouts' admission
and staleness allowance, at ``eval_temperature`` and, where the server schedules by priority, ahead of
the rollouts (:data:`EVAL_PRIORITY`); they are scored by the run's own reward functions (and
environments) and summed as the training rewards are. The result (:class:`EvalResult`: the ``eval/*``
metrics and the completions, marked eval) returns over the metrics queue; the trainer writes it at
the step evaluated, and holds its next weight sync until then, so every eval completion was sampled
from that one version.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trainer.reporting.metrics import (
    EVAL_COMPLETIONS_CLIPPED_RATIO,
    EVAL_COMPLETIONS_MEAN_LENGTH,
    EVAL_DURATION_S,
    EVAL_PASS_AT_K,
    EVAL_REWARD,
    EVAL_REWARD_STD,
    EVAL_REWARDS_MEAN,
)
from trainer.rollout.groups import build_group, completion_records
from trainer.rollout.scoring import GroupScore, rollout_terminated, score_group
from trainer.rollout.types import Rollout
from trainer.rollout.vllm_client import SamplingSettings

__all__ = [
    "EVAL_PRIORITY",
    "EvalRequest",
    "EvalResult",
    "eval_metrics",
    "eval_rows",
    "eval_sampling",
    "run_eval_pass",
]

# vLLM serves lower priorities first; rollouts are sent with 0.
EVAL_PRIORITY = -10


@dataclass(frozen=True)
class EvalRequest:
    """One eval pass asked for by the trainer.

    Attributes:
        step: the optimizer step whose weights are evaluated (the step the metrics are logged at).
        version: the policy version the server holds for that step.
        timestamp: unix seconds of that step's log (the eval row keeps the step's wall time).
    """

    step: int
    version: int
    timestamp: float


@dataclass
class EvalResult:
    """What one pass sends back: ``metrics`` (``eval/*`` name -> value) and ``completions`` (one
    record per completion, as training's logged completions, without an advantage)."""

    step: int
    version: int
    timestamp: float
    metrics: dict[str, float] = field(default_factory=dict)
    completions: list[dict[str, Any]] = field(default_factory=list)


def eval_sampling(config: Any) -> SamplingSettings:
    """The config's sampling settings at ``eval_temperature`` (0: greedy), without sampler logprobs
    (nothing trains on them) and at :data:`EVAL_PRIORITY`."""
    return replace(
        SamplingSettings.from_config(config),
        temperature=float(config.eval_temperature),
        num_sampler_logprobs=0,
        priority=EVAL_PRIORITY,
    )


def eval_rows(dataset: Any, max_prompts: int | None) -> list[tuple[int, dict[str, Any]]]:
    """``(row index, row)`` of the first ``max_prompts`` rows of ``dataset`` (all when None), in
    order: the same prompts at every eval step, so the points of a chart compare the same thing."""
    try:
        n = len(dataset)
    except TypeError:  # an IterableDataset: read up to max_prompts rows (all of them if no cap)
        rows = []
        for i, row in enumerate(dataset):
            if max_prompts is not None and i >= max_prompts:
                break
            rows.append((i, dict(row)))
        return rows
    if max_prompts is not None:
        n = min(n, max_prompts)
    return [(i, dict(dataset[i])) for i in range(n)]


def eval_metrics(
    scores: Sequence[GroupScore],
    rollouts: Sequence[Sequence[Rollout]],
    *,
    k: int,
    pass_threshold: float,
    eos_token_ids: Set[int],
    duration_s: float,
) -> dict[str, float]:
    """The ``eval/*`` metrics of one pass over P prompts with k completions each.

    ``scores[p].rewards``: (k,) total rewards of prompt p (NaN: no function scored it);
    ``eval/reward`` and ``eval/reward_std`` are over all P*k completions (NaN left out);
    ``eval/pass@k`` is the share of prompts with at least one completion whose total reward is at
    least ``pass_threshold``; lengths are generated tokens; a completion is clipped when its last
    turn did not end with EOS."""
    totals = (
        np.concatenate([np.asarray(s.rewards, dtype=np.float64) for s in scores]) if scores else np.array([])
    )
    finite = totals[~np.isnan(totals)]
    out: dict[str, float] = {
        EVAL_REWARD: float(finite.mean()) if finite.size else math.nan,
        EVAL_REWARD_STD: float(finite.std()) if finite.size else math.nan,
    }
    per_source: dict[str, list[np.ndarray]] = {}
    for score in scores:
        for name, values in score.per_source.items():
            per_source.setdefault(name, []).append(np.asarray(values, dtype=np.float64))
    for name, parts in per_source.items():
        values = np.concatenate(parts)
        values = values[~np.isnan(values)]
        out[EVAL_REWARDS_MEAN.format(name=name)] = float(values.mean()) if values.size else math.nan
    passed = [
        bool(np.any(np.nan_to_num(np.asarray(s.rewards), nan=-math.inf) >= pass_threshold)) for s in scores
    ]
    out[EVAL_PASS_AT_K.format(k=k)] = float(np.mean(passed)) if passed else math.nan
    flat = [r for group in rollouts for r in group]
    if flat:
        out[EVAL_COMPLETIONS_MEAN_LENGTH] = float(np.mean([len(r.completion_ids) for r in flat]))
        out[EVAL_COMPLETIONS_CLIPPED_RATIO] = float(
            np.mean([0.0 if rollout_terminated(r, eos_token_ids) else 1.0 for r in flat])
        )
    out[EVAL_DURATION_S] = float(duration_s)
    return out


async def run_eval_pass(
    loop: Any, request: EvalRequest, rows: list[tuple[int, dict[str, Any]]]
) -> EvalResult:
    """Sample, score and summarise one pass over ``rows`` with ``loop``'s client, hooks and reward
    functions (``loop``: the running :class:`~trainer.rollout.loop.AsyncRolloutLoop`; its
    ``eval_rollout`` makes one completion under the eval sampling settings). At most
    ``max_concurrent_rollouts`` eval requests are in flight at once."""
    config = loop.config
    k = int(config.eval_num_generations)
    started = time.monotonic()
    slots = asyncio.Semaphore(max(1, int(config.max_concurrent_rollouts)))

    async def one(row: dict[str, Any], group_id: int) -> Any:
        async with slots:
            return await loop.eval_rollout(row, group_id)

    async def prompt(
        index: int, row_index: int, row: dict[str, Any]
    ) -> tuple[Any, GroupScore, list[Rollout]]:
        outcomes = await asyncio.gather(*(one(row, index) for _ in range(k)))
        group, _ = build_group(row, row_index, index, request.version, outcomes)
        score = await score_group(group, loop.reward_funcs, loop.executor)
        return group, score, [o.rollout for o in outcomes]

    passes = await asyncio.gather(*(prompt(i, r, row) for i, (r, row) in enumerate(rows)))
    scores = [s for _, s, _ in passes]
    metrics = eval_metrics(
        scores,
        [r for _, _, r in passes],
        k=k,
        pass_threshold=float(config.eval_pass_threshold),
        eos_token_ids=set(loop.renderer.eos_token_ids),
        duration_s=time.monotonic() - started,
    )
    completions = []
    for group, score, _ in passes:
        # No advantage: nothing trains on an eval completion.
        for record in completion_records(group, score, np.full(len(group.completions), math.nan)):
            completions.append({**record, "advantage": None})
    return EvalResult(request.step, request.version, request.timestamp, metrics, completions)
