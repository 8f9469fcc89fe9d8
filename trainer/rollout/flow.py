"""The two automatic limits on how much generation runs at once (spec, "Concurrency").

* :class:`StalenessGate` (token-based ``max_staleness``): the trainer keeps a cumulative token
  ceiling, ``token_allowance``; the worker starts a new group only while
  ``tokens already queued (cumulative) + estimate of groups in flight + estimate of the new group``
  stays under it. The estimate per rollout is the running mean of tokens per finished rollout;
  until the first group finishes the worker runs one group at a time. One exception keeps the
  pipeline from stalling: with nothing in flight and the queued tokens still under the ceiling, one
  group starts even if its estimate overshoots (so the ceiling is exceeded by at most one group).
* :class:`ConcurrencyController` (vLLM load): a live cap on rollouts in flight. It starts at the
  number of max-length requests the KV cache holds (KV tokens / ``max_model_len``), rises by up to
  25% (by at most the number of rollouts completed since the last poll) while KV usage is under
  60% and nothing waits, and falls by 30% when usage exceeds 80%. ``max_concurrent_rollouts`` is
  the hard cap, and the cap itself when the server has no ``/metrics``.

Token units: raw tokens, ``sum(len(s.input_ids))`` of a group's training sequences, the same unit
the trainer counts when it consumes samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.rollout.client import ServerLoad

__all__ = ["ConcurrencyController", "StalenessGate", "CapDecision"]

RAISE_BELOW_USAGE = 0.60
LOWER_ABOVE_USAGE = 0.80
RAISE_FRACTION = 0.25
LOWER_FRACTION = 0.30
POLL_INTERVAL_S = 5.0


class StalenessGate:
    """Token accounting against the trainer's cumulative ``token_allowance`` ceiling.

    All quantities are tokens. ``queued_tokens`` only grows (cumulative, kept groups only: the
    trainer's allowance is computed from what it consumed, and dropped groups reach it with zero
    tokens). In-flight groups hold a reservation of ``G x estimated tokens per rollout`` taken at
    admission, released when the group finishes.
    """

    def __init__(self, num_generations: int) -> None:
        self.num_generations = num_generations
        self.queued_tokens = 0
        self.reserved_tokens = 0.0
        self.groups_in_flight = 0
        self.groups_finished = 0
        self._rollout_tokens_total = 0
        self._rollouts_finished = 0

    @property
    def tokens_per_rollout(self) -> float | None:
        """Running mean of tokens per finished rollout; None before the first group finished."""
        if self._rollouts_finished == 0:
            return None
        return self._rollout_tokens_total / self._rollouts_finished

    def group_estimate(self) -> float:
        """Estimated tokens of one new group (0 before any estimate exists)."""
        per_rollout = self.tokens_per_rollout
        return 0.0 if per_rollout is None else per_rollout * self.num_generations

    def can_admit(self, allowance: float) -> bool:
        """Whether a new group may start under the cumulative ceiling ``allowance`` (tokens)."""
        if self.groups_finished == 0:
            # No estimate yet: one group at a time, and only while the trainer allows any tokens.
            return self.groups_in_flight == 0 and self.queued_tokens < allowance
        needed = self.queued_tokens + self.reserved_tokens + self.group_estimate()
        if needed <= allowance:
            return True
        # Nothing in flight and the ceiling not reached yet: start one group even if its estimate
        # overshoots, or a trainer waiting for a step's last tokens would wait forever.
        return self.groups_in_flight == 0 and self.queued_tokens < allowance

    def admit(self) -> float:
        """Reserve a group's estimate; returns the reservation to pass back to :meth:`finish`."""
        reservation = self.group_estimate()
        self.reserved_tokens += reservation
        self.groups_in_flight += 1
        return reservation

    def finish(self, reservation: float, rollout_tokens: list[int], queued_tokens: int) -> None:
        """Release a group: ``rollout_tokens`` per rollout (raw), ``queued_tokens`` put on the queue."""
        self.reserved_tokens = max(0.0, self.reserved_tokens - reservation)
        self.groups_in_flight -= 1
        self.groups_finished += 1
        self.queued_tokens += int(queued_tokens)
        self._rollout_tokens_total += int(sum(rollout_tokens))
        self._rollouts_finished += len(rollout_tokens)

    def in_flight_estimate(self) -> float:
        """Tokens counted against the allowance right now (queued + reserved)."""
        return self.queued_tokens + self.reserved_tokens


@dataclass(frozen=True)
class CapDecision:
    """What one poll did to the cap: ``"raise"``, ``"lower"``, ``"hold"`` or ``"no_metrics"``."""

    action: str
    cap: int


class ConcurrencyController:
    """The live cap on rollouts in flight, driven by the server's ``/metrics``.

    Args:
        hard_cap: ``max_concurrent_rollouts``.
        kv_cache_tokens: the server's KV capacity (tokens), None when it does not expose it.
        max_model_len: the server's ``max_model_len`` (tokens).
    """

    def __init__(self, hard_cap: int, kv_cache_tokens: int | None, max_model_len: int) -> None:
        self.hard_cap = int(hard_cap)
        self.has_metrics = kv_cache_tokens is not None
        if kv_cache_tokens is None:
            self._cap = float(self.hard_cap)
        else:
            self._cap = float(min(self.hard_cap, max(1, kv_cache_tokens // max(1, max_model_len))))
        self._completed_since_poll = 0

    @property
    def cap(self) -> int:
        return max(1, min(self.hard_cap, int(self._cap)))

    def rollout_completed(self, n: int = 1) -> None:
        """Count finished rollouts: the cap rises by at most this many per poll."""
        self._completed_since_poll += n

    def observe(self, load: ServerLoad | None) -> CapDecision:
        """Apply one ``/metrics`` reading (None = no metrics: the cap becomes the hard cap)."""
        completed, self._completed_since_poll = self._completed_since_poll, 0
        if load is None:
            self.has_metrics = False
            self._cap = float(self.hard_cap)
            return CapDecision("no_metrics", self.cap)
        self.has_metrics = True
        if load.kv_cache_usage > LOWER_ABOVE_USAGE:
            self._cap = max(1.0, math.floor(self._cap * (1.0 - LOWER_FRACTION)))
            return CapDecision("lower", self.cap)
        if load.kv_cache_usage < RAISE_BELOW_USAGE and load.waiting <= 0 and completed > 0:
            step = min(math.ceil(self._cap * RAISE_FRACTION), completed)
            before = self.cap
            self._cap = min(float(self.hard_cap), self._cap + step)
            return CapDecision("raise" if self.cap > before else "hold", self.cap)
        return CapDecision("hold", self.cap)
