"""The trainer's side of the rollout queue: the token allowance it hands the rollout process."""

from __future__ import annotations

import threading

from trainer.feed import RolloutFeed
from trainer.metrics import MetricWindow
from trainer.rollout.types import GroupResult, TrainingSequence


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
        max_staleness=0,
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
