"""Multi-turn rollouts: tool schemas, tool execution, environments and turn reconciliation.

Reconciliation (spec, "Multi-turn rollouts"): a rollout's turns become training sequences. A turn
whose prompt starts with the tokens held so far (previous prompt + sampled tokens) is appended to
the same sequence, the new prompt tokens (tool results, the next generation prompt) as context with
loss mask 0; any other turn (the chat template re-rendered history differently) forks a new
sequence that starts from that turn's prompt, all of it context. Each sampled token is trained in
exactly one sequence, so a fork costs forward tokens, never extra signal.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from trainer.reporting.metrics import (
    ENV_RESET_S,
    ENV_REWARD_S,
    TOOL_CALL_COUNT,
    TOOL_FAILURE_COUNT,
    TOOL_LATENCY_S,
    TOOLS_FAILURE_FREQUENCY,
    TOOLS_LATENCY_S,
    TOOLS_PARALLEL_CALLS_MEAN,
    TOOLS_UNKNOWN_NAME_COUNT,
    MetricWindow,
)
from trainer.rollout.scoring import is_async_callable
from trainer.rollout.types import TrainingSequence, TurnRecord

__all__ = [
    "ENV_RESERVED_METHODS",
    "EnvironmentPool",
    "Reconciled",
    "ToolOutcome",
    "environment_tools",
    "reconcile_turns",
    "run_tool_calls",
    "tool_schema",
]

ENV_RESERVED_METHODS = frozenset({"reset", "get_reward"})


# --- tools ---------------------------------------------------------------------------------------
_SCHEMA_CACHE: dict[Any, dict[str, Any]] = {}


def _schema_key(tool: Callable) -> Any:
    func = getattr(tool, "__func__", None)  # bound method: one schema per class method
    return func if func is not None else tool


def tool_schema(tool: Callable) -> dict[str, Any]:
    """The JSON schema transformers renders for ``tool`` (name, description, parameters), cached."""
    key = _schema_key(tool)
    schema = _SCHEMA_CACHE.get(key)
    if schema is None:
        from transformers.utils import get_json_schema

        schema = get_json_schema(tool)
        _SCHEMA_CACHE[key] = schema
    return schema


def tool_name(tool: Callable) -> str:
    return getattr(tool, "__name__", type(tool).__name__)


def environment_tools(env: object) -> list[Callable]:
    """The environment's public methods (not ``reset`` / ``get_reward``), bound, in definition order."""
    tools = []
    for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction):
        if name.startswith("_") or name in ENV_RESERVED_METHODS:
            continue
        tools.append(getattr(env, name))
    return tools


def _format_result(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, dict | list):
        return json.dumps(result, ensure_ascii=False)
    return str(result)


@dataclass
class ToolOutcome:
    """The tool messages of one assistant turn and their counts."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    failures: int = 0


async def _call_tool(tool: Callable, arguments: dict[str, Any], executor: Executor | None) -> Any:
    if is_async_callable(tool):
        return await tool(**arguments)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, lambda: tool(**arguments))


async def run_tool_calls(
    calls: Sequence[dict[str, Any]],
    tools: Sequence[Callable],
    executor: Executor | None,
    window: MetricWindow,
) -> ToolOutcome:
    """Run one assistant turn's tool calls in the order the model wrote them.

    ``calls`` are :func:`trainer.tiny.chat_template.parse_tool_calls` entries (``name``, ``arguments``,
    optional ``error`` for a malformed block). A malformed call, an unknown name and a raising tool
    are failures; the model sees an ``Error: ...`` tool message instead of a result.
    """
    by_name = {tool_name(t): t for t in tools}
    outcome = ToolOutcome()
    window.add(TOOLS_PARALLEL_CALLS_MEAN, len(calls))
    for call in calls:
        name = call.get("name")
        outcome.calls += 1
        started = time.monotonic()
        failed = True
        if "error" in call:
            content = f"Error: {call['error']}"
        elif name not in by_name:
            window.add(TOOLS_UNKNOWN_NAME_COUNT, 1)
            content = f"Error: unknown tool {name!r}; available: {', '.join(sorted(by_name)) or 'none'}"
        else:
            try:
                content = _format_result(
                    await _call_tool(by_name[name], call.get("arguments") or {}, executor)
                )
                failed = False
            except Exception as exc:  # a tool's failure is the policy's signal, not the run's
                content = f"Error: {type(exc).__name__}: {exc}"
        latency = time.monotonic() - started
        outcome.failures += int(failed)
        window.add(TOOLS_LATENCY_S, latency)
        window.add(TOOLS_FAILURE_FREQUENCY, 1.0 if failed else 0.0)
        if name in by_name:
            window.add(TOOL_LATENCY_S.format(tool=name), latency)
            window.add(TOOL_CALL_COUNT.format(tool=name), 1)
            window.add(TOOL_FAILURE_COUNT.format(tool=name), int(failed))
        outcome.messages.append({"role": "tool", "name": name or "", "content": content})
    return outcome


# --- environments --------------------------------------------------------------------------------
class EnvironmentPool:
    """Reuses environment instances across rollouts (reset between episodes).

    ``factory`` is one callable or ``{name: callable}`` (routed by the dataset's ``environment``
    column). At most one instance exists per rollout in flight, so the pool never grows past
    ``max_concurrent_rollouts``. Factories run in ``executor`` (they may be slow).
    """

    def __init__(
        self, factory: Callable[[], object] | dict[str, Callable[[], object]], executor: Executor | None
    ):
        self.factory = factory
        self.executor = executor
        self._free: dict[str | None, list[object]] = {}

    def _factory_for(self, key: str | None) -> Callable[[], object]:
        if isinstance(self.factory, dict):
            if key not in self.factory:
                raise KeyError(
                    f"environment {key!r} (dataset column 'environment') is not in environment_factory "
                    f"(known: {', '.join(sorted(self.factory))})"
                )
            return self.factory[key]
        return self.factory

    @staticmethod
    def key_of(row: dict[str, Any], routed: bool) -> str | None:
        if not routed:
            return None
        if "environment" not in row:
            raise KeyError(
                "environment_factory is a dict, so every dataset row needs an 'environment' column"
            )
        return row["environment"]

    async def acquire(self, key: str | None) -> object:
        free = self._free.setdefault(key, [])
        if free:
            return free.pop()
        factory = self._factory_for(key)
        return await asyncio.get_running_loop().run_in_executor(self.executor, factory)

    def release(self, key: str | None, env: object) -> None:
        self._free.setdefault(key, []).append(env)

    async def reset(
        self, env: object, row: dict[str, Any], prompt: list[dict[str, Any]] | None, window: MetricWindow
    ) -> list[dict[str, Any]] | None:
        """Start an episode: ``env.reset(**row columns)`` (sync in the executor, or async).

        The dataset row's columns other than ``prompt`` and ``environment`` are its keyword
        arguments. A string it returns is the prompt when the row has none, else it is appended to
        the last user message (a new user message when there is none); None keeps the row's prompt.
        Records ``env/reset_s``.
        """
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", "environment")}
        started = time.monotonic()
        text = await asyncio.get_running_loop().run_in_executor(self.executor, lambda: env.reset(**kwargs))
        if inspect.isawaitable(text):
            text = await text
        window.add(ENV_RESET_S, time.monotonic() - started)
        if text is None:
            return None if prompt is None else [dict(m) for m in prompt]
        if prompt is None:
            return [{"role": "user", "content": str(text)}]
        messages = [dict(m) for m in prompt]
        for message in reversed(messages):
            if message.get("role") == "user":
                message["content"] = f"{message.get('content') or ''}{text}"
                break
        else:
            messages.append({"role": "user", "content": str(text)})
        return messages

    async def reward(self, env: object, window: MetricWindow) -> float | None:
        """The episode's own score, ``env.get_reward()`` (sync in the executor, or async); records
        ``env/reward_s``."""
        started = time.monotonic()
        getter = env.get_reward
        if is_async_callable(getter):
            value = await getter()
        else:
            value = await asyncio.get_running_loop().run_in_executor(self.executor, getter)
        window.add(ENV_REWARD_S, time.monotonic() - started)
        return None if value is None else float(value)


# --- reconciliation ------------------------------------------------------------------------------
@dataclass
class Reconciled:
    """A rollout's training sequences and how its turn transitions were reconciled.

    Attributes:
        sequences: sequences with at least one trained token.
        forks: one 0/1 per turn transition (1 = the turn started a new sequence).
        drift_tokens: per transition, held tokens the fork re-rendered (0 when appended).
    """

    sequences: list[TrainingSequence]
    forks: list[int] = field(default_factory=list)
    drift_tokens: list[int] = field(default_factory=list)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Builder:
    """One training sequence under construction (token-aligned lists, see ``types.py``)."""

    def __init__(self, with_tops: bool, with_mask: bool) -> None:
        self.ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[dict[int, float] | None] | None = [] if with_tops else None
        self.sampling_mask: list[list[int] | None] | None = [] if with_mask else None

    def context(self, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        if self.tops is not None:
            self.tops.extend([None] * len(ids))
        if self.sampling_mask is not None:
            self.sampling_mask.extend([None] * len(ids))

    def output(self, turn: TurnRecord) -> None:
        n = len(turn.output_ids)
        mask = turn.output_mask if turn.output_mask is not None else [1] * n
        logprobs = turn.output_log_probs if turn.output_log_probs else [0.0] * n
        if len(mask) != n or len(logprobs) != n:
            raise ValueError(
                f"TurnRecord has {n} output_ids but {len(mask)} mask entries and {len(logprobs)} log-probs; "
                "output_log_probs is required (one per token) when output tokens are trained"
            )
        self.ids.extend(turn.output_ids)
        self.loss_mask.extend(int(bool(m)) for m in mask)
        self.logprobs.extend(float(lp) if m else 0.0 for lp, m in zip(logprobs, mask, strict=True))
        if self.tops is not None:
            tops = turn.output_sampler_logprobs or [None] * n
            self.tops.extend(t if m else None for t, m in zip(tops, mask, strict=True))
        if self.sampling_mask is not None:
            sm = turn.output_sampling_mask or [None] * n
            self.sampling_mask.extend(s if m else None for s, m in zip(sm, mask, strict=True))

    def build(self) -> TrainingSequence:
        return TrainingSequence(
            input_ids=self.ids,
            loss_mask=self.loss_mask,
            sampler_logprobs=self.logprobs,
            sampler_top_logprobs=self.tops,
            sampling_mask=self.sampling_mask,
        )


def reconcile_turns(turns: Sequence[TurnRecord]) -> Reconciled:
    """Turn a rollout's turns into training sequences (append vs fork), see the module docstring.

    ``sampler_top_logprobs`` / ``sampling_mask`` are kept only when some turn carries them.
    Sequences without trained tokens (every output masked) are not returned.
    """
    with_tops = any(t.output_sampler_logprobs is not None for t in turns)
    with_mask = any(t.output_sampling_mask is not None for t in turns)
    result = Reconciled(sequences=[])
    builders: list[_Builder] = []
    current: _Builder | None = None
    for turn in turns:
        if current is not None:
            held = current.ids
            if len(turn.prompt_ids) >= len(held) and turn.prompt_ids[: len(held)] == held:
                result.forks.append(0)
                result.drift_tokens.append(0)
                current.context(turn.prompt_ids[len(held) :])
                current.output(turn)
                continue
            result.forks.append(1)
            result.drift_tokens.append(len(held) - _common_prefix(held, turn.prompt_ids))
        current = _Builder(with_tops, with_mask)
        builders.append(current)
        current.context(turn.prompt_ids)
        current.output(turn)
    for builder in builders:
        sequence = builder.build()
        if sequence.num_trained_tokens > 0:
            result.sequences.append(sequence)
    return result
