"""Scoring a finished group: reward functions, summed rewards, advantages and their metrics.

Reward functions follow the spec's contract (keyword arguments ``prompts``, ``completions``,
``completion_ids`` and every dataset column but ``prompt``; one ``float`` or ``None`` per
completion). Several functions run concurrently: ``async def`` functions are awaited together and
plain functions run in threads, so their latencies overlap. A rollout's reward is the sum over
every source that scored it (reward functions, the environment's ``get_reward``, ``Rollout.reward``);
``None`` means "does not apply" and is left out; a rollout no source scored gets NaN, which
:func:`standardize` turns into advantage 0 and leaves out of the group's mean and std.

Standard deviations are population standard deviations (``ddof=0``) over the scored rollouts.

Also here: :func:`check_picklable` (everything crossing into the rollout process) and the bounded
:class:`ScoreQueue` between generation and scoring (``rollout/score_*`` metrics).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import pickle
import time
from collections.abc import Awaitable, Callable, Sequence, Set
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer.reporting.metrics import (
    COMPLETIONS_CLIPPED_RATIO,
    COMPLETIONS_DUPLICATE_FRAC,
    COMPLETIONS_MAX_LENGTH,
    COMPLETIONS_MAX_TERMINATED_LENGTH,
    COMPLETIONS_MEAN_LENGTH,
    COMPLETIONS_MEAN_TERMINATED_LENGTH,
    COMPLETIONS_MIN_LENGTH,
    COMPLETIONS_MIN_TERMINATED_LENGTH,
    FRAC_REWARD_ZERO_STD,
    REWARD,
    REWARD_DROPPED,
    REWARD_FUNC_GROUP_STD,
    REWARD_FUNC_MEAN,
    REWARD_GROUP_STD,
    REWARD_KEPT,
    ROLLOUT_SCORE_BLOCK_S,
    ROLLOUT_SCORE_QUEUE_SIZE,
    ROLLOUT_SCORE_S,
    ROLLOUT_SCORE_WAIT_S,
    MetricWindow,
)
from trainer.rollout.types import Rollout, RolloutGroup

__all__ = [
    "GroupScore",
    "ScoreQueue",
    "call_reward_funcs",
    "check_picklable",
    "is_async_callable",
    "is_zero_std",
    "record_completion_metrics",
    "record_reward_metrics",
    "reward_func_name",
    "score_group",
    "spread",
    "standardize",
]


def _callable_label(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        return f"functools.partial({_callable_label(obj.func)})"
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if qualname:
        return f"{module}.{qualname}" if module else qualname
    return f"instance of {type(obj).__module__}.{type(obj).__qualname__}"


def check_picklable(obj: Any, what: str) -> None:
    """Raise ``TypeError`` naming ``obj`` and the fix when it cannot be pickled into the rollout process.

    ``what`` says which argument it came from (``"reward function"``, ``"tool"``,
    ``"environment_factory"``, ...). Lambdas, closures and locally defined classes fail here, at
    start-up, instead of inside the spawned process.
    """
    try:
        pickle.dumps(obj)
    except Exception as exc:  # pickle raises PicklingError, AttributeError, TypeError, ...
        raise TypeError(
            f"{what} {_callable_label(obj)} cannot be pickled into the rollout process "
            f"({type(exc).__name__}: {exc}). The rollout worker is a spawned process, so every reward "
            "function, tool and environment factory (and everything it closes over) must be picklable: "
            "define it as a module-level function, or use functools.partial or a callable class instance "
            "instead of a lambda or closure."
        ) from exc


def reward_func_name(func: Any) -> str:
    """The name a reward function's metrics use: ``__name__``, the wrapped function's for a partial,
    or the class name for a callable instance."""
    if isinstance(func, functools.partial):
        return reward_func_name(func.func)
    name = getattr(func, "__name__", None)
    return name if name else type(func).__name__


def is_async_callable(func: Any) -> bool:
    """True for ``async def`` functions, partials of them and instances with an ``async def __call__``."""
    if isinstance(func, functools.partial):
        return is_async_callable(func.func)
    if inspect.iscoroutinefunction(func):
        return True
    if inspect.isfunction(func) or inspect.ismethod(func):
        return False
    for klass in type(func).__mro__:  # the __call__ an instance call would run
        if "__call__" in klass.__dict__:
            return inspect.iscoroutinefunction(klass.__dict__["__call__"])
    return False


def _check_rewards(name: str, values: Any, n: int) -> list[float | None]:
    if values is None or len(values) != n:
        got = "None" if values is None else f"{len(values)} values"
        raise ValueError(
            f"reward function {name!r} returned {got} for {n} completions; return one per completion"
        )
    out: list[float | None] = []
    for v in values:
        out.append(None if v is None else float(v))
    return out


async def call_reward_funcs(
    funcs: Sequence[Callable[..., Any]], kwargs: dict[str, Any], n: int, executor: Executor | None
) -> list[list[float | None]]:
    """Call every reward function on one group concurrently; one list of ``n`` values per function.

    Async functions are awaited together; sync functions run in ``executor`` threads meanwhile.
    """
    loop = asyncio.get_running_loop()
    pending: list[Awaitable[Any]] = []
    for func in funcs:
        if is_async_callable(func):
            pending.append(func(**kwargs))
        else:
            pending.append(loop.run_in_executor(executor, functools.partial(func, **kwargs)))
    results = await asyncio.gather(*pending)
    return [_check_rewards(reward_func_name(f), r, n) for f, r in zip(funcs, results, strict=True)]


@dataclass
class GroupScore:
    """A scored group.

    Attributes:
        rewards: (G,) total reward per rollout, NaN where no source scored it.
        per_source: ``{name: (G,) values}`` per reward function / environment class, NaN = None.
        kept: the group has >= 2 scored rollouts with different rewards (it will be trained).
    """

    rewards: np.ndarray
    per_source: dict[str, np.ndarray] = field(default_factory=dict)
    kept: bool = False


def _as_array(values: Sequence[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else float(v) for v in values], dtype=np.float64)


def sum_rewards(
    per_source: dict[str, np.ndarray], rollout_rewards: Sequence[float | None], n: int
) -> np.ndarray:
    """(G,) sum over sources of the non-NaN values; NaN where nothing scored the rollout."""
    stacked = np.stack([*per_source.values(), _as_array(rollout_rewards)]).reshape(-1, n)  # (S, G)
    scored = ~np.isnan(stacked)
    total = np.where(scored, stacked, 0.0).sum(axis=0)
    return np.where(scored.any(axis=0), total, math.nan)


def spread(values: np.ndarray) -> float:
    """Population std of ``values`` (no NaN), exactly 0.0 when they are all equal.

    ``np.std`` of equal floats is not always 0: the mean of three rewards of 0.4 rounds to
    0.4000000000000001, so the std comes out ~5e-17 and standardizing by it turns a group the spec
    drops (all rewards equal) into advantages of +-1 on no signal. Equality decides, not the std.
    """
    if values.size == 0 or bool(np.all(values == values[0])):
        return 0.0
    return float(np.std(values))


def is_zero_std(rewards: np.ndarray) -> bool:
    """True when fewer than two rollouts are scored or all scored rewards are equal (group dropped)."""
    scored = rewards[~np.isnan(rewards)]
    return len(scored) < 2 or spread(scored) == 0.0


def standardize(rewards: np.ndarray) -> np.ndarray:
    """(G,) advantages ``(r - mean) / std`` over the scored rollouts; NaN rewards (and std 0) give 0."""
    advantages = np.zeros(len(rewards), dtype=np.float64)
    scored = ~np.isnan(rewards)
    if scored.sum() < 2:
        return advantages
    values = rewards[scored]
    std = spread(values)
    if std == 0.0:
        return advantages
    advantages[scored] = (values - float(np.mean(values))) / std
    return advantages


async def score_group(
    group: RolloutGroup, reward_funcs: Sequence[Callable[..., Any]], executor: Executor | None
) -> GroupScore:
    """Run the reward functions on ``group`` and sum every source; sets ``group.rewards``."""
    n = len(group.completions)
    per_source: dict[str, np.ndarray] = {}
    if reward_funcs:
        kwargs = {
            "prompts": group.prompts,
            "completions": group.completions,
            "completion_ids": group.completions_ids,
            **group.reward_kwargs,
        }
        values = await call_reward_funcs(reward_funcs, kwargs, n, executor)
        for func, column in zip(reward_funcs, values, strict=True):
            name = reward_func_name(func)
            if name in per_source:  # two functions with one name: keep both, distinguishably
                name = f"{name}_{len(per_source)}"
            per_source[name] = _as_array(column)
    env_columns: dict[str, list[float | None]] = {}
    for i, entry in enumerate(group.env_rewards):
        if entry is None:
            continue
        cls, value = entry
        env_columns.setdefault(cls.__name__, [None] * n)[i] = value
    for name, column in env_columns.items():
        per_source[name] = _as_array(column)
    rewards = sum_rewards(per_source, group.rollout_rewards, n)
    group.rewards = rewards
    return GroupScore(rewards=rewards, per_source=per_source, kept=not is_zero_std(rewards))


def _group_std(values: np.ndarray) -> float | None:
    scored = values[~np.isnan(values)]
    return spread(scored) if len(scored) else None


def record_reward_metrics(
    window: MetricWindow, score: GroupScore, samples_per_rollout: Sequence[int]
) -> None:
    """The reward metrics of one group (spec, "Logged metrics").

    Per scored completion, all groups: ``reward``, ``rewards/{name}/mean``. Per group:
    ``frac_reward_zero_std``. Per trained sample of kept groups: ``reward_kept``, ``reward_group_std``,
    ``rewards/{name}/group_std``. Per scored completion of dropped groups: ``reward_dropped``.
    """
    rewards = score.rewards
    scored = ~np.isnan(rewards)
    window.extend(REWARD, rewards[scored].tolist())
    for name, values in score.per_source.items():
        window.extend(REWARD_FUNC_MEAN.format(name=name), values[~np.isnan(values)].tolist())
    window.add(FRAC_REWARD_ZERO_STD, 0.0 if score.kept else 1.0)
    if not score.kept:
        window.extend(REWARD_DROPPED, rewards[scored].tolist())
        return
    group_std = _group_std(rewards)
    source_stds = {name: _group_std(values) for name, values in score.per_source.items()}
    for reward, count in zip(rewards, samples_per_rollout, strict=True):
        for _ in range(count):
            window.add(REWARD_KEPT, None if math.isnan(reward) else float(reward))
            window.add(REWARD_GROUP_STD, group_std)
            for name, std in source_stds.items():
                window.add(REWARD_FUNC_GROUP_STD.format(name=name), std)


def rollout_terminated(rollout: Rollout, eos_token_ids: Set[int]) -> bool:
    if not rollout.turns:
        return False
    last = rollout.turns[-1]
    if last.finish_reason is not None:
        return last.finish_reason == "stop"
    return bool(last.output_ids) and last.output_ids[-1] in eos_token_ids


def record_completion_metrics(
    window: MetricWindow, rollouts: Sequence[Rollout], eos_token_ids: Set[int]
) -> None:
    """``completions/*`` of one group (all groups, dropped ones included).

    Lengths are ``len(completion_ids)`` (generated tokens, tool results excluded); a rollout is
    terminated when its last turn ended with EOS / a stop token; a duplicate is token-identical, over
    all turns, to an earlier rollout of the group.
    """
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for rollout in rollouts:
        length = len(rollout.completion_ids)
        for name in (COMPLETIONS_MEAN_LENGTH, COMPLETIONS_MIN_LENGTH, COMPLETIONS_MAX_LENGTH):
            window.add(name, length)
        terminated = rollout_terminated(rollout, eos_token_ids)
        window.add(COMPLETIONS_CLIPPED_RATIO, 0.0 if terminated else 1.0)
        if terminated:
            for name in (
                COMPLETIONS_MEAN_TERMINATED_LENGTH,
                COMPLETIONS_MIN_TERMINATED_LENGTH,
                COMPLETIONS_MAX_TERMINATED_LENGTH,
            ):
                window.add(name, length)
        key = tuple(tuple(turn.output_ids) for turn in rollout.turns)
        window.add(COMPLETIONS_DUPLICATE_FRAC, 1.0 if key in seen else 0.0)
        seen.add(key)


class ScoreQueue:
    """Bounded queue of finished groups waiting to be scored, with its timing metrics.

    ``put`` blocks while the queue is full (``rollout/score_block_s``); each item waits
    ``rollout/score_wait_s`` before a scorer takes it and ``handler`` runs for ``rollout/score_s``.
    ``rollout/score_queue_size`` is sampled by :meth:`record_size`.
    """

    def __init__(self, window: MetricWindow, maxsize: int, handler: Callable[[Any], Awaitable[None]]) -> None:
        self.window = window
        self.handler = handler
        self._queue: asyncio.Queue[tuple[float, Any]] = asyncio.Queue(maxsize=max(1, maxsize))

    async def put(self, item: Any) -> None:
        started = time.monotonic()
        await self._queue.put((time.monotonic(), item))
        self.window.add(ROLLOUT_SCORE_BLOCK_S, time.monotonic() - started)

    def qsize(self) -> int:
        return self._queue.qsize()

    def record_size(self) -> None:
        self.window.add(ROLLOUT_SCORE_QUEUE_SIZE, self._queue.qsize())

    async def run(self) -> None:
        """Score forever (one item at a time; rewards of one group run concurrently)."""
        while True:
            queued_at, item = await self._queue.get()
            started = time.monotonic()
            self.window.add(ROLLOUT_SCORE_WAIT_S, started - queued_at)
            try:
                await self.handler(item)
            finally:
                self.window.add(ROLLOUT_SCORE_S, time.monotonic() - started)
                self._queue.task_done()
