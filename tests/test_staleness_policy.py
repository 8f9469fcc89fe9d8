"""``max_staleness`` as one rule (``flow.StalenessPolicy``), the loop's admission and slots
(``flow.RolloutAdmission``) and the typed process boundary (``channels.RolloutChannels``).

No server, no process: the rule's arithmetic at its boundaries, and the places that apply it (the
feed's allowance and drop, the LoRA window, the diagnosis' queue fill) agreeing with it.
"""

from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from tests.conftest import REPO
from trainer.reporting.diagnosis import diagnose
from trainer.reporting.metrics import MetricWindow
from trainer.rollout.channels import RolloutChannels
from trainer.rollout.flow import ConcurrencyController, RolloutAdmission, StalenessGate, StalenessPolicy
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.process import start_rollout_process
from trainer.rollout.types import GroupResult, TrainingSequence
from trainer.step.feed import RolloutFeed


# --- the rule -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("max_staleness", "lead"), [(0, 1000.0), (1, 1000.0), (4, 4000.0)])
def test_lead_is_max_staleness_at_least_one_steps_worth(max_staleness, lead):
    policy = StalenessPolicy(max_staleness=max_staleness)
    assert policy.lead(1000) == lead and isinstance(policy.lead(1000), float)
    assert policy.lead_steps == max(max_staleness, 1)
    assert policy.lead(0.5) == 0.5 * max(max_staleness, 1)  # any unit per step (diagnosis: samples)


def test_a_sample_is_stale_only_past_max_staleness_updates():
    two = StalenessPolicy(max_staleness=2)
    assert not two.is_stale(sample_version=5, trainer_version=5)
    assert not two.is_stale(sample_version=3, trainer_version=5)  # lags exactly max_staleness: trained
    assert two.is_stale(sample_version=2, trainer_version=5)
    zero = StalenessPolicy(max_staleness=0)
    assert not zero.is_stale(sample_version=7, trainer_version=7)
    assert zero.is_stale(sample_version=6, trainer_version=7)


def test_lora_window_keeps_exactly_the_versions_whose_samples_are_not_stale():
    policy = StalenessPolicy(max_staleness=1)
    assert list(policy.lora_window(3)) == [2, 3]
    assert policy.lora_live_versions == 2 and policy.lora_slots == 3  # --max-loras >= max_staleness + 2
    for s in (0, 1, 4):
        p = StalenessPolicy(max_staleness=s)
        window = p.lora_window(10)
        assert len(window) == p.lora_live_versions == s + 1 and p.lora_slots == s + 2
        assert all(not p.is_stale(sample_version=v, trainer_version=10) for v in window)
        assert p.is_stale(sample_version=window.start - 1, trainer_version=10)


def test_policy_comes_from_the_config():
    assert StalenessPolicy.from_config(SimpleNamespace(max_staleness=3)) == StalenessPolicy(max_staleness=3)


def test_diagnosis_imports_the_policy_without_torch_or_the_http_client():
    code = (
        "import sys, trainer.reporting.diagnosis; "
        "print(sorted(m for m in ('torch', 'aiohttp', 'httpx', 'numpy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_diagnosis_queue_fill_is_the_queue_over_the_policys_lead():
    series = {
        "rollout/queue_size": [(1, 90.0)],
        "batch/samples_per_step": [(1, 30.0)],
        "perf/rollout_wait_s": [(1, 0.0)],
        "rollout/backpressure_s": [(1, 0.0)],
    }
    for s in (0, 3):
        found = [d for d in diagnose(series, config={"max_staleness": s}) if d.topic == "bottleneck"]
        fill = found[0].evidence["rollout/queue_size:fill"]
        assert fill == pytest.approx(90.0 / StalenessPolicy(max_staleness=s).lead(30.0))
    assert fill == pytest.approx(1.0)  # 90 queued = 3 steps of 30


# --- the feed applies it ----------------------------------------------------------------------------
def _group(position: int, version: int, n: int = 2, length: int = 10) -> GroupResult:
    samples = [
        TrainingSequence(list(range(100 * k, 100 * k + length)), [0] * 2 + [1] * (length - 2), [0.0] * length)
        for k in range(n)
    ]
    for i, s in enumerate(samples):
        s.model_version = version
        s.advantage = 1.0 if i % 2 else -1.0
    return GroupResult(position=position, row_index=position, group_id=position, kind="kept", samples=samples)


@pytest.mark.parametrize("max_staleness", [0, 3])
def test_feed_allowance_leads_by_the_policy_and_drops_what_it_calls_stale(max_staleness):
    policy = StalenessPolicy(max_staleness=max_staleness)
    version = max_staleness + 1
    arrivals = [_group(0, version=0), _group(1, version=1), _group(2, version=version)]
    feed = RolloutFeed(
        next_group=None,
        model_version=lambda: version,
        token_budget=None,
        num_rows=1,
        staleness=policy,
        num_top_logprobs=0,
        start_position=0,
        window=MetricWindow(),
    )
    published: list[float] = []

    def next_group(timeout: float) -> GroupResult | None:
        if arrivals:
            return arrivals.pop(0)
        time.sleep(timeout)  # an empty queue: the feed flushes the open row after STARVED_FLUSH_S
        return None

    feed.attach(next_group, 60, on_allowance=published.append, rows_per_step=2)
    assert feed.allowance_lead == feed.initial_lead(60, 2) == policy.lead(120)
    row = next(iter(feed))["row"]
    # version 0 lags max_staleness + 1 updates (dropped); version 1 lags max_staleness (kept)
    assert feed.window.reduce()["sample/dropped_stale_count"] == 2
    assert row is not None and len(set(row.sample_index.tolist())) == 4
    report = feed.finish_step()
    assert report["raw_tokens"] == 40
    assert feed.allowance_lead == policy.lead(40)  # the step's raw tokens, max(max_staleness, 1) times
    feed.publish_allowance()
    assert published[-1] == feed.consumed_raw_tokens + policy.lead(40) == 60 + policy.lead(40)


def _distinct_group(position: int) -> GroupResult:
    """Two 10-token samples sharing no token with another group's (the trie shares nothing)."""
    group = _group(position, version=0)
    for k, sample in enumerate(group.samples):
        sample.input_ids = [10_000 * (position + 1) + 100 * k + i for i in range(len(sample.input_ids))]
    return group


def _starving_feed(arrivals: list[GroupResult], polls: list[int], token_budget: int) -> RolloutFeed:
    """A one-row feed whose queue hands out ``arrivals``, is empty for a few polls (counted in
    ``polls``), then hands out two more groups: what its first row holds tells whether it flushed early."""
    feed = RolloutFeed(
        next_group=None,
        model_version=lambda: 0,
        token_budget=token_budget,
        num_rows=1,
        staleness=StalenessPolicy(max_staleness=2),
        num_top_logprobs=0,
        start_position=0,
        window=MetricWindow(),
    )
    late = [_distinct_group(len(arrivals) + k) for k in range(2)]

    def next_group(timeout: float) -> GroupResult | None:
        polls.append(1)
        if arrivals:
            return arrivals.pop(0)
        if len(polls) > 11 and late:  # empty ~2 s (> the default 1 s flush), then two groups
            return late.pop(0)
        time.sleep(timeout)
        return None

    feed.attach(next_group, token_budget, on_allowance=lambda _: None, rows_per_step=1)
    return feed


@pytest.mark.parametrize(("setting", "samples_in_first_row"), [("0.3", 2), ("off", 4)])
def test_starved_flush_setting_trains_a_part_filled_row_or_waits_for_a_full_one(
    monkeypatch, setting, samples_in_first_row
):
    """GRPO_STARVED_FLUSH_S: after 0.3 s on an empty queue the open row (one group, room for two) is
    trained as is; ``off`` waits for the second group, so a step's samples do not follow the box's speed."""
    monkeypatch.setenv("GRPO_STARVED_FLUSH_S", setting)
    polls: list[int] = []
    feed = _starving_feed([_distinct_group(0)], polls, token_budget=40)
    row = next(iter(feed))["row"]
    assert len(set(row.sample_index.tolist())) == samples_in_first_row


def test_starved_flush_setting_is_checked_naming_it(monkeypatch):
    monkeypatch.setenv("GRPO_STARVED_FLUSH_S", "soon")
    with pytest.raises(ValueError, match="GRPO_STARVED_FLUSH_S='soon': give seconds"):
        _starving_feed([], [], token_budget=40)


@pytest.mark.parametrize(("settled", "samples_in_first_row"), [("held", 4), ("in flight", 6)])
def test_a_part_filled_row_is_trained_once_the_rollout_side_is_held_by_the_allowance(
    monkeypatch, settled, samples_in_first_row
):
    """With the timer off, the feed still trains a part-filled row when nothing more can come: the
    rollout side reports every finished group sent and none in flight, and what it sent reaches the
    ceiling. Two groups of identical samples fill the 40-token ceiling (raw tokens) but only 20 of
    the row's 40 unique tokens, so waiting for a full row would deadlock both sides (the demo did).
    While a group is still in flight (-1), the feed waits for it instead."""
    monkeypatch.setenv("GRPO_STARVED_FLUSH_S", "off")
    arrivals = [_group(0, version=0), _group(1, version=0)]
    for group in arrivals:
        group.generated_tokens = sum(len(s) for s in group.samples)
    polls: list[int] = []
    feed = _starving_feed(arrivals, polls, token_budget=40)
    feed.staleness = StalenessPolicy(max_staleness=0)
    feed.attach(
        feed.next_group,
        40,
        on_allowance=lambda _: None,
        rows_per_step=1,
        settled_tokens=lambda: float(feed.received_tokens) if settled == "held" else -1.0,
    )
    assert feed.published_ceiling == 40.0
    row = next(iter(feed))["row"]
    assert len(set(row.sample_index.tolist())) == samples_in_first_row
    assert (len(polls) <= 4) == (settled == "held")  # flushed at the first empty poll, not later


# --- admission and slots ------------------------------------------------------------------------------
def test_admission_waits_for_the_allowance_then_for_the_cap_and_counts_the_wait():
    async def scenario():
        admission = RolloutAdmission(
            StalenessGate(num_generations=2), ConcurrencyController(2, None, 1), num_generations=2
        )
        stopping = asyncio.Event()
        allowance = [0.0]
        blocked = asyncio.ensure_future(admission.admit(lambda: allowance[0], stopping))
        await asyncio.sleep(0.1)
        assert not blocked.done() and admission.backpressure_since is not None
        assert admission.take_backpressure(admission.backpressure_since + 0.05) == pytest.approx(0.05)
        allowance[0] = 1e9
        first = await asyncio.wait_for(blocked, 1.0)
        assert first.reservation == 0.0 and first.waited_s > 0  # held back ~0.1 s, less the 0.05 taken
        assert admission.wanting == 2 and admission.take_backpressure(0.0) is None
        # a second group waits: one group at a time until the first finishes (no estimate yet)
        second = asyncio.ensure_future(admission.admit(lambda: allowance[0], stopping))
        await asyncio.sleep(0.05)
        assert not second.done()
        for _ in range(2):
            await admission.acquire_slot()
        assert admission.running == 2
        third_slot = asyncio.ensure_future(admission.acquire_slot())  # the cap (2) is full
        await asyncio.sleep(0.05)
        assert not third_slot.done()
        await admission.release_slot()
        await asyncio.wait_for(third_slot, 1.0)  # a freed slot lets it in at once
        await admission.release_slot()
        await admission.release_slot()
        admission.finish(first.reservation, [10, 10], 20)
        assert (await asyncio.wait_for(second, 1.0)).reservation == 20.0  # 2 rollouts x 10 tokens
        assert admission.wanting == 1  # 2 - 3 released + 2 newly admitted
        stopped = asyncio.ensure_future(admission.admit(lambda: 0.0, stopping))
        stopping.set()
        assert await asyncio.wait_for(stopped, 1.0) is None

    asyncio.run(scenario())


# --- the process boundary -----------------------------------------------------------------------------
def _thread_channels() -> RolloutChannels:
    return RolloutChannels(
        rollout_buffer=queue.Queue(),
        metrics_queue=queue.Queue(),
        exception_info_queue=queue.Queue(),
        model_version_value=SimpleNamespace(value=0),
        token_allowance=SimpleNamespace(value=0.0),
        heartbeat_value=SimpleNamespace(value=0.0),
        failed_event=threading.Event(),
        stop_event=threading.Event(),
        oldest_pinned_version=SimpleNamespace(value=0),
    )


def test_loop_takes_the_channels_whole_or_the_specs_loose_arguments():
    channels = _thread_channels()
    loop = AsyncRolloutLoop(None, "m", [], [], None, [0], channels=channels)
    assert loop.channels is channels and loop.stop_event is channels.stop_event
    assert loop.rollout_buffer is channels.rollout_buffer and loop.token_allowance is channels.token_allowance
    assert loop.pins.oldest_pinned_version is channels.oldest_pinned_version  # no patching after construction
    loose = AsyncRolloutLoop(None, "m", [], [], None, [0], *[channels.rollout_buffer] + [None] * 6)
    assert loose.channels.rollout_buffer is channels.rollout_buffer and loose.stop_event is None
    with pytest.raises(TypeError, match="either channels"):
        AsyncRolloutLoop(None, "m", [], [], None, [0], rollout_buffer=queue.Queue(), channels=channels)


def test_failure_report_goes_through_the_channels():
    channels = _thread_channels()
    channels.report_failure(ValueError("boom"))
    info = channels.exception_info_queue.get_nowait()
    assert channels.failed_event.is_set() and info["type"] == "ValueError" and "boom" in info["traceback"]


@pytest.mark.parametrize("name", ["channels", "token_allowance", "stop_event", "oldest_pinned_version"])
def test_start_rollout_process_creates_the_channels_itself(name):
    with pytest.raises(TypeError, match=f"creates {name} itself"):
        start_rollout_process(AsyncRolloutLoop, config=None, reward_funcs=[], **{name: None})
