"""The trainer's side of the rollout queue: the token allowance it hands the rollout process."""

from __future__ import annotations

import itertools
import threading

import pytest

from trainer.reporting.metrics import MetricWindow
from trainer.rollout.flow import StalenessPolicy
from trainer.rollout.types import GroupResult, TrainingSequence
from trainer.step.feed import DroppedGroupsLimitError, RolloutFeed
from worker.log_records import failure_sentence


def _group(position: int, version: int, n: int = 4, length: int = 10) -> GroupResult:
    samples = [
        TrainingSequence(
            list(range(length)), [0] * 4 + [1] * (length - 4), [0.0] * length, model_version=version
        )
        for _ in range(n)
    ]
    for i, s in enumerate(samples):
        s.advantage = 1.0 if i % 2 else -1.0
    return GroupResult(position=position, row_index=position, group_id=position, kind="kept", samples=samples)


def test_samples_dropped_as_stale_raise_the_allowance_while_the_trainer_waits():
    """max_staleness=0: groups generated on the old weights arrive after the sync and are dropped.

    The rollout process queued their tokens against the ceiling; unless dropping them raises it, the
    rollout process waits for the trainer and the trainer for fresh samples, forever (the stall seen
    in LoRA runs). The ceiling must rise as they are dropped, before any step ends.
    """
    version = 1
    arrivals = [_group(0, version=0), _group(1, version=0), _group(2, version=1)]
    published: list[float] = []
    fresh_allowed = threading.Event()

    def next_group(timeout: float):
        if len(arrivals) == 1 and not fresh_allowed.is_set():
            # the rollout process sends the fresh group only once the ceiling covers it
            if not published or published[-1] < 60 + 40:
                raise AssertionError(f"ceiling never rose above what was queued: {published}")
            fresh_allowed.set()
        return arrivals.pop(0) if arrivals else None

    feed = RolloutFeed(
        next_group=next_group,
        model_version=lambda: version,
        token_budget=64,
        num_rows=1,
        staleness=StalenessPolicy(max_staleness=0),
        num_top_logprobs=0,
        start_position=0,
        window=MetricWindow(),
    )
    feed.allowance_lead = 40.0
    feed.on_allowance = published.append
    batch = next(iter(feed))
    # both stale groups (2 x 4 x 10 raw tokens) were consumed by dropping them, the ceiling followed
    assert feed.consumed_raw_tokens == 80
    assert published[:2] == [40.0 + 40, 80.0 + 40]
    assert batch["row"] is not None and len(set(batch["row"].sample_index.tolist())) == 4
    report = feed.finish_step()
    assert report["raw_tokens"] == 40 and feed.consumed_raw_tokens == 120
    assert feed.positions.next_untrained == 3  # dropped groups count as consumed prompts


def _distinct_group(position: int) -> GroupResult:
    """A kept group of 4 samples of 10 tokens sharing nothing (distinct first tokens)."""
    group = _group(position, version=0)
    for k, sample in enumerate(group.samples):
        sample.input_ids = [1000 * position + 100 * k + t for t in range(10)]
    return group


def test_the_last_epoch_ends_exactly_at_its_prompts_and_drops_what_was_generated_ahead():
    """num_train_epochs: positions from end_position on are never trained nor counted; once every
    earlier prompt is back, the batcher's remainder is the last batch, then empty micro-batches."""
    arrivals = [_distinct_group(p) for p in (0, 1, 6, 2, 7, 3, 4, 5, 8, 9)]  # 6.. generated ahead
    feed = RolloutFeed(
        next_group=lambda timeout: arrivals.pop(0) if arrivals else None,
        model_version=lambda: 0,
        token_budget=90,  # nine 10-token samples (nothing shared) per row
        num_rows=1,
        staleness=StalenessPolicy(max_staleness=4),
        num_top_logprobs=0,
        start_position=0,
        window=MetricWindow(),
    )
    feed.end_position = 6  # e.g. 1.5 epochs of a 4-prompt dataset
    batches = iter(feed)
    trained_positions: list[int] = []
    for _ in range(4):
        row = next(batches)["row"]
        trained_positions.append(row.num_tokens if row is not None else 0)
    report = feed.finish_step()
    # rows filled to the budget, the remainder flushed once every prompt before the end is in, then empty
    assert trained_positions == [90, 90, 60, 0]
    assert report["trained_tokens"] == 6 * 4 * 6
    assert feed.positions.next_untrained == 6 and feed.positions.consumed == 6
    assert feed.consumed_raw_tokens == 6 * 40 + 2 * 40  # the two groups ahead released, not trained


def _dropped(position: int) -> GroupResult:
    return GroupResult(position=position, row_index=position, group_id=position, kind="dropped", samples=[])


def _feed(arrivals: list[GroupResult], **kwargs) -> RolloutFeed:
    return RolloutFeed(
        next_group=lambda timeout: arrivals.pop(0) if arrivals else None,
        model_version=lambda: 0,
        token_budget=90,
        num_rows=1,
        staleness=StalenessPolicy(max_staleness=4),
        num_top_logprobs=0,
        start_position=0,
        window=MetricWindow(),
        **kwargs,
    )


def test_an_epoch_that_ends_between_steps_on_dropped_groups_ends_the_iteration():
    """Issue 35 item 3: the groups after the last step were all dropped, so no step is left to train.
    The feed ends its iteration (the trainer stops, on_exhausted) instead of handing Trainer empty
    micro-batches that made an optimizer step of 0 samples."""
    feed = _feed([_distinct_group(0), _distinct_group(1), _dropped(2), _dropped(3)])
    feed.end_position = 4
    exhausted: list[bool] = []
    feed.on_exhausted = lambda: exhausted.append(True)
    batches = iter(feed)
    assert next(batches)["row"].num_tokens == 80  # the two kept groups, flushed at the epoch's end
    feed.finish_step()
    assert list(itertools.islice(batches, 3)) == [] and exhausted == [True]  # was: empty micro-batches
    assert feed.positions.next_untrained == 4  # the dropped prompts count as consumed


def test_max_dropped_groups_in_a_row_fail_the_run_in_one_sentence():
    """Issue 35 item 6: a run whose rewards never vary ends, with the reason, instead of generating
    forever; a kept group starts the count again."""
    arrivals = [_dropped(0), _dropped(1), _distinct_group(2), _dropped(3), _dropped(4), _dropped(5)]
    feed = _feed(arrivals, max_dropped_groups=3)
    with pytest.raises(DroppedGroupsLimitError) as caught:
        next(iter(feed))
    assert arrivals == [] and feed.dropped_in_a_row == 3  # the kept group reset the count
    message = str(caught.value)
    assert message.startswith("3 groups in a row were dropped (max_dropped_groups=3)")
    sentence = failure_sentence(
        process="trainer", status="1", log_text=f"trainer.step.feed.DroppedGroupsLimitError: {message}"
    )
    assert "3 groups in a row got equal rewards" in sentence and "args.max_dropped_groups (now 3" in sentence
