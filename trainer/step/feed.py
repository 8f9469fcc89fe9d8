"""The trainer's side of the rollout queue: samples → staleness filter → TokenBudgetBatcher → rows.

:class:`RolloutFeed` is the iterable the ``transformers.Trainer`` loop pulls micro-batches from
(``gradient_accumulation_steps`` of them make one optimizer step). It also keeps the books the
async pipeline needs:

* the staleness allowance it hands the rollout process (``token_allowance``, cumulative raw tokens:
  consumed + :meth:`StalenessPolicy.lead <trainer.rollout.flow.StalenessPolicy.lead>` of the last
  step's raw tokens);
* which prompt positions are fully trained, hence ``rollout_state.json``'s first untrained index
  and the epoch count (distinct prompts consumed, dropped and filtered ones included);
* the queue-side metrics (``rollout/queue_size``, ``sample/*``, ``perf/rollout_wait_s``).

Only the main process owns the rollout process; with several processes it forms every rank's row
and broadcasts the micro-batch (``torch.distributed``), so each rank forwards its own row.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from trainer.processes.host import main_process_value
from trainer.reporting.metrics import (
    BATCH_DROPPED_OVERSIZE_COUNT,
    PERF_ROLLOUT_WAIT_S,
    ROLLOUT_QUEUE_SIZE,
    SAMPLE_DROPPED_STALE_COUNT,
    SAMPLE_STALENESS_MAX,
    SAMPLE_STALENESS_MEAN,
    SAMPLE_TIME_IN_QUEUE_S,
    MetricWindow,
)
from trainer.rollout.flow import StalenessPolicy
from trainer.rollout.types import GroupResult, TrainingSequence
from trainer.step.packing import MicroBatch, TokenBudgetBatcher, batch_metrics, pack_row, row_stats

logger = logging.getLogger(__name__)

# How long the feed waits on an empty queue before training a partly filled micro-batch: packing
# fuller rows is not worth idling the trainer. ``GRPO_STARVED_FLUSH_S`` sets it; ``off`` never flushes
# on the timer, so a step trains the same samples however fast the machine is (a reproducible run).
# Either way a part-filled micro-batch is trained as soon as the rollout side is held by the
# allowance with every finished group received (RolloutFeed._rollout_held): no more samples can come
# until this one is trained, so waiting longer would deadlock both sides.
STARVED_FLUSH_ENV = "GRPO_STARVED_FLUSH_S"
STARVED_FLUSH_S = 1.0


def starved_flush_s() -> float:
    """Seconds on an empty queue before a partly filled micro-batch is trained (``inf``: never)."""
    raw = os.environ.get(STARVED_FLUSH_ENV, "").strip().lower()
    if not raw:
        return STARVED_FLUSH_S
    if raw in ("off", "never", "inf"):
        return math.inf
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0:  # NaN (not a number) fails this too
        raise ValueError(f"{STARVED_FLUSH_ENV}={raw!r}: give seconds (a number >= 0) or 'off'")
    return value


@dataclass
class PositionBook:
    """Which prompt positions are consumed: every sample trained or dropped, or the group dropped."""

    next_untrained: int
    remaining: dict[int, int] = field(default_factory=dict)
    done_ahead: set[int] = field(default_factory=set)
    consumed: int = 0

    def receive(self, result: GroupResult) -> None:
        if result.samples:
            self.remaining[result.position] = len(result.samples)
        else:
            self._complete(result.position)

    def sample_done(self, sample: TrainingSequence, position: int) -> None:
        left = self.remaining.get(position, 0) - 1
        if left <= 0:
            self.remaining.pop(position, None)
            self._complete(position)
        else:
            self.remaining[position] = left

    def _complete(self, position: int) -> None:
        self.consumed += 1
        if position < self.next_untrained:
            return
        self.done_ahead.add(position)
        while self.next_untrained in self.done_ahead:
            self.done_ahead.discard(self.next_untrained)
            self.next_untrained += 1


class RolloutFeed:
    """Iterable of micro-batches for the Trainer loop (see module docstring).

    Args:
        next_group: ``timeout_s -> GroupResult | None`` (None on timeout; raises ``RuntimeError``
            when the rollout process failed); None on non-main ranks or until :meth:`attach`
            (which also connects where the allowance is published).
        model_version: ``() -> int``, the policy version (weight syncs so far).
        token_budget: unique tokens per row.
        num_rows: rows per micro-batch (= processes).
        staleness: the ``max_staleness`` rule: which samples are dropped, the allowance's lead.
        num_top_logprobs: sampler top-logprobs kept per token (``num_sampler_logprobs``).
        start_position: global prompt position the rollout process starts from.
        window: the logging window metrics are recorded into.
    """

    def __init__(
        self,
        *,
        next_group: Callable[[float], GroupResult] | None,
        model_version: Callable[[], int],
        token_budget: int | None,
        num_rows: int,
        staleness: StalenessPolicy,
        num_top_logprobs: int | None,
        start_position: int,
        window: MetricWindow,
        rank: int = 0,
        min_shared_tokens: int = 0,
        max_samples_per_row: int | None = None,
        idle_log_s: float = 30.0,
        dropped_groups_warning: int = 32,
        max_dropped_groups: int | None = None,
    ) -> None:
        self.next_group = next_group
        # While no micro-batch is ready, on_idle() is called every idle_log_s (the trainer logs the
        # rollout metrics then); dropped_groups_warning groups dropped in a row log a warning.
        self.on_idle: Callable[[], None] | None = None
        # Called on every rank when the last epoch ends between steps (see __iter__).
        self.on_exhausted: Callable[[], None] | None = None
        # num_train_epochs runs: prompt positions from end_position on are generated ahead of the
        # last epoch's end and never trained (set by the trainer; None = no end).
        self.end_position: int | None = None
        self._start_position = start_position
        self._received_before_end = 0
        self.idle_log_s = idle_log_s
        self.starved_flush_s = starved_flush_s()  # read at start: a bad value fails the run at once
        self.dropped_groups_warning = dropped_groups_warning
        self.max_dropped_groups = max_dropped_groups
        self.dropped_in_a_row = 0
        self.min_shared_tokens = min_shared_tokens
        self.max_samples_per_row = max_samples_per_row
        self.model_version = model_version
        self.token_budget = token_budget
        self.num_rows = num_rows
        self.staleness = staleness
        self.num_top_logprobs = num_top_logprobs
        self.window = window
        self.rank = rank
        self.batcher = (
            TokenBudgetBatcher(token_budget, num_rows, min_shared_tokens, max_samples_per_row)
            if token_budget
            else None
        )
        self.positions = PositionBook(next_untrained=start_position)
        # Rows the rollout process retired (retire_saturated_prompts), for rollout_state.json.
        self.retired_rows: set[int] = set()
        self._position_of: dict[int, int] = {}  # id(sample) -> prompt position
        self._ready: list[MicroBatch] = []
        self._step_batches: list[MicroBatch] = []
        self._queued_samples = 0  # received, not yet placed in a closed micro-batch
        self.consumed_raw_tokens = 0  # trained or dropped samples' raw tokens (allowance accounting)
        # The rollout process may run this many raw tokens ahead of what is consumed: set by
        # attach() (full rows), then by each finish_step() (the step's raw tokens), both through
        # staleness.lead; publish_allowance() hands the ceiling to on_allowance.
        self.allowance_lead = 0.0
        self.on_allowance: Callable[[float], None] | None = None
        self.published_ceiling = 0.0  # the last ceiling handed to the rollout process (raw tokens)
        self.received_tokens = 0  # raw tokens of every group received (GroupResult.generated_tokens)
        # The rollout side's settled_tokens (RolloutChannels); None: not known (no held-flush).
        self.settled_tokens: Callable[[], float] | None = None
        self.step_wait_s = 0.0

    def attach(
        self,
        next_group: Callable[[float], GroupResult | None],
        token_budget: int,
        *,
        on_allowance: Callable[[float], None],
        rows_per_step: int,
        settled_tokens: Callable[[], float] | None = None,
    ) -> None:
        """Connect the rollout process once it is started (the budget comes from the server).

        ``on_allowance`` receives each new ceiling (cumulative raw tokens). Until a step tells how
        many raw tokens a step takes, the lead is :meth:`initial_lead` (``rows_per_step`` full rows),
        which is also the ceiling the rollout process was started with. ``settled_tokens`` reads the
        rollout side's settled tokens (``RolloutWorkerHandle.settled_tokens``).
        """
        self.next_group = next_group
        self.token_budget = token_budget
        self.batcher = TokenBudgetBatcher(
            token_budget, self.num_rows, self.min_shared_tokens, self.max_samples_per_row
        )
        self.on_allowance = on_allowance
        self.settled_tokens = settled_tokens
        self.allowance_lead = self.initial_lead(token_budget, rows_per_step)
        self.published_ceiling = self._ceiling()

    def initial_lead(self, token_budget: int, rows_per_step: int) -> float:
        """The lead before the first step (raw tokens): every row of a step full, ``token_budget``
        tokens each, ``rows_per_step`` rows per step (micro-batches x processes)."""
        return self.staleness.lead(token_budget * rows_per_step)

    # ----------------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[dict]:
        while True:
            batch = self._next_micro_batch() if self.rank == 0 else None
            batch = main_process_value(batch)  # every rank forwards its own row of it
            if batch is None:
                # The last epoch ended between two steps with nothing left to train (its last groups
                # were all dropped): no step of 0 samples; the trainer stops (on_exhausted, every rank).
                if self.on_exhausted is not None:
                    self.on_exhausted()
                return
            yield self._inputs_for_rank(batch)

    def publish_allowance(self) -> None:
        """Hand the rollout process its ceiling: consumed raw tokens + ``allowance_lead``.

        Published whenever samples are consumed, dropped ones included, not only at step ends:
        samples dropped as stale while the trainer waits (at ``max_staleness=0``, whatever was
        generated on the old weights) would otherwise hold the ceiling below what the rollout
        process already queued, and both sides would wait on each other forever.
        """
        if self.on_allowance is not None:
            self.published_ceiling = self._ceiling()
            self.on_allowance(self.published_ceiling)

    def _ceiling(self) -> float:
        """The rollout process's cumulative raw-token ceiling now: consumed + ``allowance_lead``."""
        return self.consumed_raw_tokens + self.allowance_lead

    def _rollout_held(self) -> bool:
        """Whether no sample can arrive until this side consumes one: every group the rollout
        process finished is received, none is in flight, and what it queued reaches the ceiling
        (``StalenessGate.can_admit`` then admits nothing). Once true it stays true until the feed
        raises the ceiling, since only the feed raises it."""
        if self.settled_tokens is None:
            return False
        settled = self.settled_tokens()
        return settled == self.received_tokens and self.received_tokens >= self.published_ceiling

    def _next_micro_batch(self) -> MicroBatch | None:
        """Block until a micro-batch is closed (or flushed after starving); time blocked is the wait.
        None: the last epoch's prompts are all in and nothing is left for a new step."""
        starved_s = 0.0
        next_idle_log = time.monotonic() + self.idle_log_s
        while True:
            if not self._ready and self._every_prompt_received():
                # The last epoch's prompts are all in: what the batcher holds is the last batch; after
                # it, empty ones (a step's remaining micro-batches) until the trainer stops.
                closed = self.batcher.flush()
                if not closed and not self._step_batches:
                    return None  # no step begun: none to train (see __iter__)
                if not closed:
                    empty: MicroBatch = [[] for _ in range(self.num_rows)]
                    self._step_batches.append(empty)
                    return empty
                self._ready.extend(closed)
            while not self._ready and not self._every_prompt_received():
                started = time.monotonic()
                if self.on_idle is not None and started >= next_idle_log:
                    self.on_idle()
                    next_idle_log = started + self.idle_log_s
                result = self.next_group(0.2)
                if result is None:
                    elapsed = time.monotonic() - started
                    self.step_wait_s += elapsed
                    starved_s += elapsed
                    if self.batcher.num_pending_samples and (
                        starved_s >= self.starved_flush_s or self._rollout_held()
                    ):
                        self._ready.extend(self.batcher.flush())
                    continue
                self.step_wait_s += time.monotonic() - started
                starved_s = 0.0
                consumed = self.consumed_raw_tokens
                self._receive(result)
                if self.consumed_raw_tokens != consumed:
                    self.publish_allowance()
            if not self._ready:
                continue  # every prompt is in: the flush above
            batch = self._ready.pop(0)
            self._queued_samples -= sum(len(row) for row in batch)
            consumed = self.consumed_raw_tokens
            batch = self._drop_stale(batch)
            if self.consumed_raw_tokens != consumed:
                self.publish_allowance()
            if any(batch):
                self._step_batches.append(batch)
                return batch

    def _drop_stale(self, batch: MicroBatch) -> MicroBatch:
        """Staleness is judged when a sample is trained (now), not when it arrived: a sample can wait
        in an open micro-batch across a weight sync."""
        version = self.model_version()
        now = time.time()
        kept_batch: MicroBatch = []
        for row in batch:
            kept = []
            for sample in row:
                staleness = version - sample.model_version
                if self.staleness.is_stale(sample_version=sample.model_version, trainer_version=version):
                    self.window.add(SAMPLE_DROPPED_STALE_COUNT, 1)
                    self._sample_consumed(sample, self._position_of.get(id(sample), -1))
                    continue
                if sample.queued_at:
                    self.window.add(SAMPLE_TIME_IN_QUEUE_S, now - sample.queued_at)
                self.window.add(SAMPLE_STALENESS_MEAN, staleness)
                self.window.add(SAMPLE_STALENESS_MAX, staleness)
                kept.append(sample)
            kept_batch.append(kept)
        return kept_batch

    def _every_prompt_received(self) -> bool:
        """True once every prompt position before ``end_position`` has come back from the rollout
        process (trained, queued in the batcher, dropped or filtered)."""
        if self.end_position is None:
            return False
        return self._received_before_end >= self.end_position - self._start_position

    def _receive(self, result: GroupResult) -> None:
        self.received_tokens += int(result.generated_tokens or 0)
        if self.end_position is not None:
            if result.position >= self.end_position:
                # Generated ahead past the last epoch: never trained, not a consumed prompt; its
                # tokens are released from the allowance so the rollout process is not held up.
                self.consumed_raw_tokens += sum(len(s.input_ids) for s in result.samples)
                return
            self._received_before_end += 1
        self.positions.receive(result)
        if result.restored_all:
            self.retired_rows.clear()
        if result.retired:
            self.retired_rows.add(result.row_index)
        self._count_dropped(result)
        version = self.model_version()
        for sample in result.samples:
            self._position_of[id(sample)] = result.position
            if self.staleness.is_stale(sample_version=sample.model_version, trainer_version=version):
                # already too old: skip packing it
                self.window.add(SAMPLE_DROPPED_STALE_COUNT, 1)
                self._sample_consumed(sample, result.position)
                continue
            self._queued_samples += 1
            closed = self.batcher.add(sample)
            dropped = self.batcher.pop_dropped_oversize_count()
            if dropped:
                self.window.add(BATCH_DROPPED_OVERSIZE_COUNT, dropped)
                self._queued_samples -= 1
                self._sample_consumed(sample, result.position)
            self._ready.extend(closed)
        self.window.add(ROLLOUT_QUEUE_SIZE, self._queued_samples)

    def _count_dropped(self, result: GroupResult) -> None:
        """Count groups dropped in a row; warn at every multiple of ``dropped_groups_warning``."""
        if result.kind != "dropped":
            if result.kind == "kept":
                self.dropped_in_a_row = 0
            return
        self.dropped_in_a_row += 1
        limit = self.max_dropped_groups
        if limit and self.dropped_in_a_row >= limit:
            raise DroppedGroupsLimitError(
                f"{self.dropped_in_a_row} groups in a row were dropped (max_dropped_groups={limit}): every "
                "completion of each got the same reward, so nothing could train; check that the reward "
                "functions can tell completions apart and that the task is neither solved nor out of reach"
            )
        every = self.dropped_groups_warning
        if every > 0 and self.dropped_in_a_row % every == 0:
            logger.warning(_dropped_groups_message(self.dropped_in_a_row))

    def _sample_consumed(self, sample: TrainingSequence, position: int) -> None:
        self._position_of.pop(id(sample), None)
        self.consumed_raw_tokens += len(sample.input_ids)
        self.positions.sample_done(sample, position)

    def _inputs_for_rank(self, batch: MicroBatch) -> dict:
        """This rank's packed row plus what the loss needs about the whole micro-batch."""
        samples = batch[self.rank] if self.rank < len(batch) else []
        row = pack_row(samples, self.num_top_logprobs, self.min_shared_tokens) if samples else None
        global_trained = sum(s.num_trained_tokens for r in batch for s in r)
        return {"row": row, "global_trained_tokens": float(global_trained)}

    # ----------------------------------------------------------------------------- step bookkeeping
    def finish_step(self) -> dict[str, float]:
        """Mark the step's samples trained; record its batch metrics; return its accounting.

        Once attached, the allowance's lead becomes ``staleness.lead`` of the step's raw tokens
        (published by the next :meth:`publish_allowance`). Returns ``{"raw_tokens",
        "forwarded_tokens", "head_positions", "attention_pairs", "trained_tokens", "wait_s"}``.
        """
        batches, self._step_batches = self._step_batches, []
        stats = [[row_stats(row, self.min_shared_tokens) for row in mb] for mb in batches]
        metrics = batch_metrics(stats, self.token_budget)
        metrics.record(self.window)
        raw = 0
        for mb in batches:
            for row in mb:
                for sample in row:
                    raw += len(sample.input_ids)
                    position = self._position_of.get(id(sample))
                    if position is not None:
                        self._sample_consumed(sample, position)
        if self.on_allowance is not None:
            self.allowance_lead = self.staleness.lead(raw)
        wait, self.step_wait_s = self.step_wait_s, 0.0
        self.window.add(PERF_ROLLOUT_WAIT_S, wait)
        rows = [r for mb in stats for r in mb]
        return {
            "raw_tokens": float(raw),
            "forwarded_tokens": float(sum(r.forwarded_tokens for r in rows)),
            "head_positions": float(sum(r.head_positions for r in rows)),
            "trained_tokens": float(sum(r.trained_tokens for r in rows)),
            "attention_pairs": float(sum(r.attention_cost for r in rows)),
            "wait_s": wait,
        }


class DroppedGroupsLimitError(RuntimeError):
    """``max_dropped_groups`` groups in a row were dropped: the run stops instead of generating forever."""


def _dropped_groups_message(count: int) -> str:
    return (
        f"{count} groups in a row were dropped: every completion of each got the same reward "
        "(frac_reward_zero_std = 1), so they give no gradient and no step can train on them. Check "
        "that the reward functions can tell completions apart (a constant reward stalls the run) and "
        "the task's difficulty (reward_dropped at the top: too easy; at the bottom: too hard)."
    )
