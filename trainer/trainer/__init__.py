"""``AsyncGRPOTrainer``: a ``transformers.Trainer`` whose batches come from a live rollout queue.

The Trainer loop is kept (optimizer, scheduler, gradient accumulation, callbacks, ``report_to``,
checkpoints, accelerate/FSDP2); what changes:

* ``get_train_dataloader`` returns a :class:`~trainer.step.feed.RolloutFeed`: packed tree rows built
  from the spawned rollout process's samples (one row per process, ``gradient_accumulation_steps``
  micro-batches per optimizer step);
* ``compute_loss`` runs the packed forward with tree attention and the GRPO loss of ``loss.py``;
* after every optimizer step (:class:`_PipelineCallback`): step accounting, staleness allowance,
  weight sync every ``weight_sync_steps`` (full weights, a PEFT adapter merged into them, or the
  adapter alone when the server serves LoRA: :mod:`trainer.weight_sync.lora`), epoch/stop bookkeeping;
* ``log`` merges the metric window (both processes) and hands the step's metrics and sampled
  completions to the trainer's sinks (:mod:`trainer.reporting.sinks`; ``metrics.jsonl`` / ``completions.jsonl``
  by default), as ``_save_checkpoint`` does each checkpoint (the main process only, through ``_emit``);
* checkpoints also hold ``rollout_state.json`` (first untrained prompt position) for resume.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint

from trainer.config.async_grpo_config import AsyncGRPOConfig
from trainer.processes.host import main_process_value, share_cpu_with_local_server, write_rank_layout
from trainer.processes.interrupt import interrupt_requested
from trainer.processes.rollout_state import (
    read_retired_rows,
    read_rollout_counters,
    read_rollout_state,
    write_rollout_state,
)
from trainer.processes.server_checks import served_model_of_all, server_urls, wait_for_server
from trainer.reporting.metrics import (
    AUX_LOSS,
    EPOCH,
    FRAC_REWARD_ZERO_STD,
    LOSS,
    NUM_TOKENS,
    PERF_EVAL_WAIT_S,
    PERF_FWD_BWD_FORWARDED_TOKENS_PER_S,
    PERF_FWD_BWD_MFU,
    PERF_FWD_BWD_S,
    PERF_FWD_S,
    PERF_OPTIMIZER_S,
    PERF_STEP_S,
    PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S,
    PERF_WALL_CLOCK_MFU,
    PERF_WALL_CLOCK_TRAINED_TOKENS_PER_S,
    MetricWindow,
    counts_in,
    fill_absent,
)
from trainer.reporting.perf import peak_flops, training_flops
from trainer.reporting.progress import RunProgressCallback
from trainer.reporting.sinks import JsonlSink, Sink
from trainer.rollout.flow import StalenessPolicy
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.multiturn import tool_name
from trainer.rollout.process import RolloutWorkerHandle, check_rollout_picklable, start_rollout_process
from trainer.step.attention import tree_forward_kwargs
from trainer.step.compiled_layers import (
    checkpointing_left_to_the_compiler,
    compile_decoder_layers,
    layer_memory_budget,
)
from trainer.step.feed import RolloutFeed
from trainer.step.fused_head import fused_lm_head
from trainer.step.loss import LossConfig, packed_row_loss
from trainer.step.modeling import (
    adapter_state_for_sync,
    compile_pointwise_modules,
    empty_row_loss,
    eos_token_ids,
    load_policy,
    load_tokenizer,
    merged_adapter,
    named_weights_for_sync,
    peft_adapter_config,
    prepare_tokenizer,
    wrap_peft,
)
from trainer.tiny.chat_template import check_text_only
from trainer.trainer.evaluation import EvalBook
from trainer.weight_sync.client import WeightSyncClient, check_dtype, server_info
from trainer.weight_sync.fanout import WeightSyncFanout, weight_sync_client
from trainer.weight_sync.lora import (
    LORA_DIR_NAME,
    LoraPublisher,
    adapter_rank,
    adapter_sync_blocker,
    check_server_lora,
    server_lora,
)

logger = logging.getLogger(__name__)


def _identity_collator(features):
    return features


class AsyncGRPOTrainer(Trainer):
    """Asynchronous GRPO (see the spec). ``loop_cls`` on a subclass swaps the rollout loop."""

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop
    _tag_names = ["trl", "async-grpo"]

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable | list[Callable] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config=None,
        tools: list[Callable] | None = None,
        environment_factory: Callable | dict[str, Callable] | None = None,
        sinks: list[Sink] | None = None,
        eval_dataset=None,
    ) -> None:
        """``sinks``: where metrics, completions and checkpoints are reported (default: one
        :class:`~trainer.reporting.sinks.JsonlSink` on ``args.output_dir``, which the control plane reads;
        a list given here replaces it, so include a ``JsonlSink`` to keep the files).

        ``eval_dataset`` (an extension): held-out prompts (a ``prompt`` column, and what the reward
        functions read) scored through the vLLM server when ``args.eval_strategy`` says, logged as
        ``eval/*`` at the step evaluated (:mod:`trainer.trainer.evaluation`)."""
        name = model if isinstance(model, str) else model.config._name_or_path
        if args is None:
            args = AsyncGRPOConfig(output_dir=f"{Path(str(name)).name}-AsyncGRPO")
        elif not isinstance(args, AsyncGRPOConfig):
            raise TypeError(f"args must be an AsyncGRPOConfig, got {type(args).__name__}")
        self.reward_funcs = _as_reward_list(reward_funcs)
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        if not self.reward_funcs and environment_factory is None:
            raise ValueError("reward_funcs: pass at least one reward function (or an environment_factory)")
        if train_dataset is None and environment_factory is None:
            raise ValueError("train_dataset is required unless environment_factory's reset() returns prompts")
        if train_dataset is None and args.max_steps <= 0:
            raise ValueError(
                "max_steps: without train_dataset the environment generates prompts forever; set max_steps > 0"
            )
        if train_dataset is not None and environment_factory is None:
            columns = getattr(train_dataset, "column_names", None)
            if columns is not None and "prompt" not in columns:
                raise ValueError(f"train_dataset needs a 'prompt' column (conversational); it has {columns}")
            _check_prompts_text_only(train_dataset)
        if _evaluates(args) and eval_dataset is None:
            raise ValueError(
                f"eval_strategy={str(args.eval_strategy)!r} needs eval_dataset (held-out prompts); pass one or "
                "leave eval_strategy 'no'"
            )
        if eval_dataset is not None and environment_factory is None:
            columns = getattr(eval_dataset, "column_names", None)
            if columns is not None and "prompt" not in columns:
                raise ValueError(f"eval_dataset needs a 'prompt' column (conversational); it has {columns}")
            _check_prompts_text_only(eval_dataset)

        share_cpu_with_local_server(
            args.vllm_server_base_url, uses_cuda=torch.cuda.is_available() and not args.use_cpu
        )
        policy = load_policy(model, args)
        self.model_name = policy.config._name_or_path or str(name)
        if processing_class is None:
            processing_class = load_tokenizer(self.model_name, args)
        else:
            processing_class = prepare_tokenizer(processing_class)
        if peft_config is not None:
            policy = wrap_peft(policy, peft_config)
        # Whole-model compilation would trace through the tree mask. On CUDA each decoder layer is
        # compiled whole (its block mask built before the first layer) and the compiler chooses
        # what the backward recomputes; elsewhere the norm and MLP blocks are (trainer.step.compiled_layers).
        self._layer_budget = (
            layer_memory_budget(policy, args, on_cuda=torch.cuda.is_available() and not args.use_cpu)
            if args.torch_compile
            else None
        )
        if self._layer_budget is not None:
            compile_decoder_layers(policy, memory_budget=self._layer_budget)
            logger.info(
                "torch_compile: decoder layers compiled whole, activation_memory_budget %.3g",
                self._layer_budget,
            )
        elif args.torch_compile:
            compile_pointwise_modules(policy)
        self.rollout_dataset = train_dataset
        self.loss_config = LossConfig.from_args(args)
        self._window = MetricWindow()
        self._pending_completions: list[dict] = []
        self._evals = EvalBook(self._emit)
        self._counts_seen: set[str] = set()  # counts logged so far: 0, not absent, when not seen again
        self.sinks: list[Sink] = list(sinks) if sinks is not None else [JsonlSink(args.output_dir)]
        # The step at whose end an interrupt request was honoured (trainer/processes/interrupt.py), else None.
        self.interrupted_at: int | None = None
        self._handle: RolloutWorkerHandle | None = None
        self._sync_client: WeightSyncClient | WeightSyncFanout | None = None
        self._lora: LoraPublisher | None = None  # main process, adapter-only sync
        self._sync_adapter_only = False  # every process
        self._feed: RolloutFeed | None = None
        self._start_position = 0
        self._retired_rows: list[int] = []
        self._resumed_counters: dict[str, float] = {}
        self._model_version = 0
        self._num_tokens = 0.0
        self._timers: dict[str, float] = {}
        self._step_started: float | None = None

        super().__init__(
            model=policy,
            args=args,
            data_collator=_identity_collator,
            train_dataset=None,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.train_dataset = train_dataset
        # Our loss is already divided by the global trained tokens and gradient_accumulation_steps.
        self.loss_is_scaled_for_ga = True
        self.add_callback(_PipelineCallback(self))
        if not self.args.disable_tqdm:
            self.remove_callback(ProgressCallback)
            self.add_callback(RunProgressCallback)

    # ------------------------------------------------------------------------------- training entry
    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kw
    ):
        """Train until ``max_steps`` (or ``num_train_epochs`` passes over the prompts); see the spec."""
        checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
        self._start_position = read_rollout_state(checkpoint) if checkpoint else 0
        # Totals so far (num_tokens, the epoch's consumed prompts) continue from the checkpoint.
        self._resumed_counters = read_rollout_counters(checkpoint) if checkpoint else {}
        self._retired_rows = read_retired_rows(checkpoint) if checkpoint else []
        self._num_tokens = self._resumed_counters.get("num_tokens", 0.0)
        if self.rollout_dataset is not None and not hasattr(self.rollout_dataset, "__len__"):
            self._start_position = 0  # an IterableDataset cannot seek: restart from its first prompt
        if checkpoint:
            logger.warning(
                "resuming from %s: rollouts start at prompt position %d", checkpoint, self._start_position
            )
        check_rollout_picklable(self.loop_cls, self.reward_funcs, self.tools, self.environment_factory)
        try:
            output = super().train(
                resume_from_checkpoint=checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kw,
            )
            if self._handle is not None and self.interrupted_at is None:
                self._evals.wait(self._handle, self._drain_rollout_metrics)  # the last step's eval
            return output
        finally:
            self._shutdown_pipeline()
            self._emit("close")

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        """transformers' accelerator arguments without its whole-model ``torch.compile``.

        ``torch_compile=True`` compiles the norm and MLP blocks instead (see ``__init__``).
        """
        built = super()._build_accelerator_args(**kwargs)
        if "dynamo_plugin" in built:
            from accelerate.utils import TorchDynamoPlugin

            built["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return built

    def _resolve_checkpoint(self, resume: str | bool | None) -> str | None:
        if resume is None or resume is False:
            return None
        if resume is True:
            last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if last is None:
                raise ValueError(
                    f"resume_from_checkpoint=True but {self.args.output_dir} holds no checkpoint"
                )
            return last
        if not os.path.isdir(resume):
            raise ValueError(f"resume_from_checkpoint={resume!r}: no such checkpoint directory")
        return str(resume)

    def set_initial_training_values(self, args, dataloader):
        """Epoch-based runs have no known step count: a safety cap, the real stop is the epoch count."""
        if args.max_steps > 0:
            return super().set_initial_training_values(args, dataloader)
        saved = args.max_steps
        args.max_steps = 10**8
        try:
            values = super().set_initial_training_values(args, dataloader)
        finally:
            args.max_steps = saved
        return values

    def get_train_dataloader(self) -> RolloutFeed:
        if self._feed is None:
            self._feed = RolloutFeed(
                next_group=None,
                model_version=lambda: self._model_version,
                token_budget=None,
                num_rows=self.accelerator.num_processes,
                staleness=StalenessPolicy.from_config(self.args),
                num_top_logprobs=self.args.num_sampler_logprobs if self.args.score_centering else 0,
                start_position=self._start_position,
                window=self._window,
                rank=self.accelerator.process_index,
                min_shared_tokens=self.args.tree_min_shared_tokens,
                max_samples_per_row=self.args.max_samples_per_row,
                idle_log_s=self.args.idle_log_s,
                dropped_groups_warning=self.args.dropped_groups_warning,
                max_dropped_groups=self.args.max_dropped_groups,
            )
            self._feed.positions.consumed = int(self._resumed_counters.get("consumed_prompts", 0))
            self._feed.on_idle = self._log_while_waiting
            self._feed.on_exhausted = self._epochs_exhausted
            if self.args.max_steps <= 0 and hasattr(self.rollout_dataset, "__len__"):
                # N epochs = N passes over the distinct prompts, counting only those trained.
                self._feed.end_position = math.ceil(self.args.num_train_epochs * len(self.rollout_dataset))
        return self._feed

    def _epochs_exhausted(self) -> None:
        """The last epoch ended between two steps with nothing left to train (every group since the
        last step was dropped): stop without an optimizer step of 0 samples, and save the last trained
        step as an epoch's end does (Trainer saves after the epoch when ``should_save`` is set)."""
        logger.warning(
            "the last epoch ended with nothing left to train after step %d (its last groups were all "
            "dropped: equal rewards); training stops there",
            self.state.global_step,
        )
        self.control.should_training_stop = True
        if self.is_world_process_zero() and self._counts_epochs:
            # The dropped groups consumed their prompts too: the epoch is whole, as a step's end counts it.
            self.state.epoch = self._epochs_consumed()
        if self.state.global_step > 0 and self.args.save_strategy != SaveStrategy.NO:
            self.control.should_save = True

    def _epochs_consumed(self) -> float:
        """Epochs of prompts consumed so far (trained or dropped: a dropped group used its prompt)."""
        return self._feed.positions.consumed / max(len(self.rollout_dataset), 1)

    # ------------------------------------------------------------------------------ pipeline start
    def _start_pipeline(self) -> None:
        """Connect to the server, sync the policy, start the rollout process (main process owns both)."""
        args = self.args
        token_budget = served_name = None
        write_rank_layout(args.output_dir, self.accelerator.device, main_process=self.is_world_process_zero())
        if self.is_world_process_zero():
            # One server, or several (comma-separated): rollouts spread over them, weights synced to each.
            urls = server_urls(args.vllm_server_base_url)
            for url in urls:
                wait_for_server(url, args.vllm_server_timeout)
            served_name, max_model_len = served_model_of_all(urls, self.model_name)
            token_budget = args.token_budget or max_model_len
            infos = {url: server_info(url, timeout=min(60.0, args.vllm_server_timeout)) for url in urls}
            for url, info in infos.items():
                warning = check_dtype(_training_dtype(self.model, args), info)
                if warning:
                    logger.warning("%s: %s", url, warning)
            self._lora = self._lora_publisher(infos)
            self._sync_client = weight_sync_client(urls, timeout=min(args.vllm_server_timeout, 600))
            self._sync_client.init()
        self._sync_adapter_only = main_process_value(self._lora is not None)
        # The server may serve other weights (a resumed run's base model, an earlier run's policy):
        # start from exactly the trainer's policy, as version 0. Every rank gathers its shards.
        self._sync_weights(new_version=False)
        if not self.is_world_process_zero():
            return
        rows_per_step = args.gradient_accumulation_steps * self.accelerator.num_processes
        tokenizer = self.processing_class
        self._handle = start_rollout_process(
            self.loop_cls,
            initial_token_allowance=self._feed.initial_lead(token_budget, rows_per_step),
            initial_model_version=self._model_version,
            config=args,
            model_name=served_name,
            dataset=self.rollout_dataset,
            reward_funcs=self.reward_funcs,
            processing_class=tokenizer,
            eos_token_ids=eos_token_ids(self.accelerator.unwrap_model(self.model), tokenizer),
            tools=self.tools or None,
            environment_factory=self.environment_factory,
            dataset_start_index=self._start_position,
            lora_name=self._lora.lora_name if self._lora is not None else None,
            retired_rows=self._retired_rows,
            eval_dataset=self.eval_dataset if _evaluates(args) else None,
        )
        self._feed.retired_rows = set(self._retired_rows) if args.retire_saturated_prompts else set()
        self._feed.attach(
            self._next_group,
            token_budget,
            on_allowance=self._handle.set_token_allowance,
            rows_per_step=rows_per_step,
            settled_tokens=self._handle.settled_tokens,
        )
        logger.info(
            "rollout process pid %s started (server %s, model %s, token_budget %d, start position %d)",
            self._handle.pid,
            args.vllm_server_base_url,
            served_name,
            token_budget,
            self._start_position,
        )

    def _lora_publisher(self, infos: dict[str, dict]) -> LoraPublisher | None:
        """Adapter-only sync when the policy has a LoRA adapter and every server serves LoRA
        (``infos``: each server's ``/server_info`` by URL).

        Otherwise (and for adapters vLLM cannot serve as they are) the adapter is merged into the
        full weights at each sync. A LoRA server too small for the staleness window is an error that
        names the flags to restart it with.
        """
        config = peft_adapter_config(self.accelerator.unwrap_model(self.model))
        loras = {url: server_lora(info) for url, info in infos.items()}
        without = [url for url, lora in loras.items() if lora is None]
        if config is None or without:
            if config is not None:
                logger.info(
                    "%s: no --enable-lora: the adapter is merged and full weights synced", ", ".join(without)
                )
            return None
        blocker = adapter_sync_blocker(config)
        if blocker is not None:
            logger.warning("adapter-only sync impossible, merging the adapter instead: %s", blocker)
            return None
        staleness = StalenessPolicy.from_config(self.args)
        for url, lora in loras.items():
            check_server_lora(lora, rank=adapter_rank(config), staleness=staleness, base_url=url)
        return LoraPublisher(
            list(loras),
            Path(self.args.output_dir) / LORA_DIR_NAME,
            lora_name=f"grpo-{secrets.token_hex(4)}",  # unique per run: names never clash on a shared server
            staleness=staleness,
            timeout=min(self.args.vllm_server_timeout, 600),
        )

    def _next_group(self, timeout: float):
        result = self._handle.get(timeout)
        self._drain_rollout_metrics()
        return result

    def _drain_rollout_metrics(self) -> None:
        for payload in self._handle.drain_metrics():
            if self._evals.take(payload):
                continue
            self._window.merge(payload.get("metrics") or {})
            self._pending_completions.extend(payload.get("completions") or [])

    def _log_while_waiting(self) -> None:
        """No micro-batch for ``idle_log_s``: log the metrics gathered so far at the step in progress
        (``global_step + 1``; that step's own log later replaces them), so that a run whose groups
        are all dropped shows ``frac_reward_zero_std`` and ``reward_dropped`` instead of nothing.
        The window is not cleared: the step's log still reduces everything it gathered."""
        if self._handle is not None:
            self._drain_rollout_metrics()
        logs = self._window.reduce() if self._window else {}
        if not logs:
            return
        step = self.state.global_step + 1
        logger.warning(
            "waiting for samples for step %d: frac_reward_zero_std=%s over the groups received so far",
            step,
            logs.get(FRAC_REWARD_ZERO_STD, "n/a"),
        )
        self._emit("metrics", step, logs)
        in_progress = copy.copy(self.state)
        in_progress.global_step = step
        self.control = self.callback_handler.on_log(self.args, in_progress, self.control, logs)

    def _shutdown_pipeline(self) -> None:
        if self._handle is not None:
            self._handle.stop()
            self._handle = None
        if self._sync_client is not None:
            self._sync_client.close()
            self._sync_client = None
        if self._lora is not None:
            self._lora.close()
            self._lora = None
        self._feed = None

    # --------------------------------------------------------------------------------- the loss
    def training_step(self, model, inputs, num_items_in_batch=None):
        started = _now(self.args.device)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._timers["fwd_bwd"] = self._timers.get("fwd_bwd", 0.0) + _now(self.args.device) - started
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """GRPO loss of this process's packed row (see :mod:`trainer.step.loss`)."""
        started = _now(self.args.device)
        row = inputs["row"]
        if row is None:  # this process got an empty row: contribute zero, keep collectives in step
            loss = empty_row_loss(model, self.args.device)
            return (loss, None) if return_outputs else loss
        device = self.args.device
        row = row.to(device)
        keep, logit_rows = row.logits_to_keep()  # the LM head runs only where the loss reads
        unwrapped = self.accelerator.unwrap_model(model)
        # head.weight, set after the forward (FSDP2: the gathered one), None: the model's own head
        with fused_lm_head(unwrapped, device) as head:
            outputs = model(**tree_forward_kwargs(row, device), logits_to_keep=keep)
        out = packed_row_loss(
            outputs.logits,
            row,
            config=self.loss_config,
            num_trained_tokens=max(float(inputs["global_trained_tokens"]), 1.0),
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            logit_rows=logit_rows,
            lm_head_weight=head.weight,
        )
        loss = out.loss * self.accelerator.num_processes  # DP averages gradients; the spec sums
        aux = getattr(outputs, "aux_loss", None)
        if aux is not None and self.args.router_aux_loss_coef:
            self._window.add(AUX_LOSS, float(aux.detach()))
            loss = loss + self.args.router_aux_loss_coef * aux / self.args.gradient_accumulation_steps
        for key, value in out.metrics.items():
            self._window.add(key, value)
        self._timers["fwd"] = self._timers.get("fwd", 0.0) + _now(self.args.device) - started
        return (loss, outputs) if return_outputs else loss

    def floating_point_ops(self, inputs) -> int:
        row = inputs.get("row") if isinstance(inputs, dict) else None
        if row is None:
            return 0
        flops = training_flops(
            self.model.config, row.num_tokens, row.stats.attention_cost, row.stats.head_positions
        )
        return int(flops or 0)

    # --------------------------------------------------------------------- after each optimizer step
    def _end_of_step(self, state, control) -> None:
        now = time.perf_counter()
        if self.is_world_process_zero() and self._feed is not None:
            report = self._feed.finish_step()
            if self._handle is not None:  # finish_step set the new lead
                self._feed.publish_allowance()
                self._drain_rollout_metrics()
            self._record_perf(report, now)
            if self._counts_epochs:
                state.epoch = self._epochs_consumed()
                end = self._feed.end_position
                if end is not None and self._feed.positions.next_untrained >= end:
                    control.should_training_stop = True
                    # The last epoch's end saves a checkpoint, as reaching max_steps does.
                    control.should_save = self.args.save_strategy != SaveStrategy.NO
            if interrupt_requested(self.args.output_dir):
                # Asked to stop (trainer/processes/interrupt.py): checkpoint this step, whatever save_strategy says.
                control.should_training_stop = control.should_save = True
                self.interrupted_at = state.global_step
        # The main process alone sees the epoch's end and an interrupt: every rank must stop (and
        # save: the save is collective, FSDP's state dict gather and transformers' flops all-gather)
        # on its word.
        control.should_training_stop, control.should_save, self.interrupted_at = main_process_value(
            (control.should_training_stop, control.should_save, self.interrupted_at)
        )
        if self.interrupted_at is None and state.global_step % self.args.weight_sync_steps == 0:
            self._sync_weights()  # not on the way out: the next attempt pushes its weights first
        self._step_started = time.perf_counter()

    def _record_perf(self, report: dict[str, float], now: float) -> None:
        w = self._window
        step_s = now - self._step_started if self._step_started is not None else None
        fwd_bwd = self._timers.pop("fwd_bwd", 0.0)
        fwd = self._timers.pop("fwd", 0.0)
        optimizer_s = self._timers.pop("optimizer", 0.0)
        self._num_tokens += report["forwarded_tokens"]
        w.add(NUM_TOKENS, self._num_tokens)
        w.add(PERF_FWD_BWD_S, fwd_bwd)
        w.add(PERF_FWD_S, fwd)
        w.add(PERF_OPTIMIZER_S, optimizer_s)
        if fwd_bwd > 0:
            w.add_rate(PERF_FWD_BWD_FORWARDED_TOKENS_PER_S, report["forwarded_tokens"], fwd_bwd)
        if step_s:
            w.add(PERF_STEP_S, step_s)
            w.add_rate(PERF_WALL_CLOCK_FORWARDED_TOKENS_PER_S, report["forwarded_tokens"], step_s)
            w.add_rate(PERF_WALL_CLOCK_TRAINED_TOKENS_PER_S, report["trained_tokens"], step_s)
        peak = peak_flops(self.args.device, _precision(self.args))
        flops = training_flops(
            self.model.config,
            int(report["forwarded_tokens"]),
            report["attention_pairs"],
            int(report["head_positions"]),
        )
        if peak and flops:
            n = self.accelerator.num_processes
            if fwd_bwd > 0:
                w.add(PERF_FWD_BWD_MFU, flops / (fwd_bwd * peak * n))
            if step_s:
                w.add(PERF_WALL_CLOCK_MFU, flops / (step_s * peak * n))

    def _sync_weights(self, new_version: bool = True) -> None:
        """Push the policy to the server (every rank gathers; the main process sends).

        Full weights (a PEFT adapter merged into them), or with adapter-only sync: the base weights
        once at start, then each version's adapter alone.
        """
        model = self.accelerator.unwrap_model(self.model)
        version = self._model_version + int(new_version)
        timings: dict[str, float] = {}
        if self._handle is not None and self._evals.pending:
            # An eval pass samples from one policy: the weights it evaluates stay until it ends.
            self._window.add(PERF_EVAL_WAIT_S, self._evals.wait(self._handle, self._drain_rollout_metrics))
        with torch.no_grad():
            if not (self._sync_adapter_only and new_version):
                with nullcontext() if self._sync_adapter_only else merged_adapter(model):
                    tensors = list(named_weights_for_sync(model))
                    if self._sync_client is not None:
                        timings = self._sync_client.sync(tensors, weight_version=str(version))
            if self._sync_adapter_only:
                adapter, document = adapter_state_for_sync(model)
                if self._lora is not None:
                    timings = self._lora.publish(version, adapter, document)
        if new_version:
            for key, value in timings.items():
                self._window.add(key, value)
            self._model_version += 1
            if self._handle is not None:
                self._handle.set_model_version(self._model_version)
        self._evals.synced(step=self.state.global_step, version=self._model_version)
        if self._lora is not None:
            pinned = self._handle.oldest_pinned_version() if self._handle is not None else None
            self._lora.retire(self._model_version, pinned)

    # -------------------------------------------------------------------------------- evaluation
    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Ask the rollout process for an eval pass over ``eval_dataset`` with the weights the server
        holds (those of the last synced step); its ``eval/*`` metrics are logged at that step when it
        ends (:mod:`trainer.trainer.evaluation`). Returns ``{}``: nothing for transformers to rank
        (``save_strategy="best"`` is refused). Only during ``train()``, which starts the pipeline."""
        if eval_dataset is not None:
            raise ValueError("evaluate(eval_dataset=...) is not supported: pass eval_dataset to the trainer")
        if not self.is_world_process_zero():
            return {}
        if self._handle is None:
            logger.warning("evaluate() scores through the rollout process, which runs only inside train()")
            return {}
        self._evals.request(self._handle)
        return {}

    # ----------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the window's metrics (spec names), write ``metrics.jsonl``, then the usual callbacks."""
        if self._handle is not None:
            self._drain_rollout_metrics()
        if LOSS in logs and self._window:
            logs = {**logs, **self._window.reduce()}
            self._counts_seen |= counts_in(logs)
            logs = fill_absent(
                logs,
                has_tools=bool(self.tools) or self.environment_factory is not None,
                tool_names=[tool_name(t) for t in self.tools],
                counts_seen=self._counts_seen,
            )
            self._window.clear()
        if not self._counts_epochs:
            # Epochs are passes over the prompts (spec); prompts an environment makes, or an
            # IterableDataset's, have no count to pass over, and Trainer's own value (step / max_steps)
            # would read as one. So no `epoch` at all (docs/metrics.md).
            logs.pop(EPOCH, None)
            epoch, self.state.epoch = self.state.epoch, None
            try:
                self._emit("metrics", self.state.global_step, logs)
                self._log_completions()
                super().log(logs, start_time)
            finally:
                self.state.epoch = epoch
            return
        if self.state.epoch is not None:  # Trainer.log adds it only after: the sinks need it too
            logs = {**logs, EPOCH: self.state.epoch}
        self._emit("metrics", self.state.global_step, logs)
        self._log_completions()
        super().log(logs, start_time)

    @property
    def _counts_epochs(self) -> bool:
        """Whether the prompts come from a dataset with a length (what an epoch passes over)."""
        return self.rollout_dataset is not None and hasattr(self.rollout_dataset, "__len__")

    def _emit(self, kind: str, *record: Any) -> None:
        """The one place records reach the sinks: ``metrics(step, values)``, ``completions(step,
        rows)``, ``checkpoint(step, path)`` or ``close()``, on the main process only. A sink that
        raises is logged, not fatal: training must not stop for a reporting failure."""
        if not self.is_world_process_zero():
            return
        for sink in self.sinks:
            if not hasattr(sink, kind):  # "evaluation" is optional (trainer.reporting.sinks.EvalSink)
                continue
            try:
                getattr(sink, kind)(*record)
            except Exception:
                logger.exception("sink %s: %s of %s failed", type(sink).__name__, kind, record[:1])

    def _log_completions(self) -> None:
        if not self.is_world_process_zero():
            return
        items, self._pending_completions = self._pending_completions, []
        if not items:
            return
        step = self.state.global_step
        self._emit("completions", step, items)
        limit = self.args.num_completions_to_print
        for item in items[: len(items) if limit is None else limit]:
            print(
                f"[step {step}] reward={item.get('reward')} adv={item.get('advantage'):.3f}\n"
                f"  prompt: {item.get('prompt')!s:.200}\n  completion: {item.get('completion')!s:.300}"
            )

    # ------------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.is_world_process_zero() and self._feed is not None:
            folder = (
                Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            counters = {"num_tokens": self._num_tokens, "consumed_prompts": self._feed.positions.consumed}
            write_rollout_state(
                folder,
                self._feed.positions.next_untrained,
                self.rollout_dataset,
                counters,
                retired_rows=self._feed.retired_rows,
            )
            self._emit("checkpoint", self.state.global_step, str(folder))


class _PipelineCallback(TrainerCallback):
    """Hooks the async pipeline into the Trainer loop (start, timings, per-step bookkeeping)."""

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer._layer_budget is not None:
            checkpointing_left_to_the_compiler(self.trainer.model)
        self.trainer._start_pipeline()
        self.trainer._step_started = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._timers["optimizer_started"] = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        started = self.trainer._timers.pop("optimizer_started", None)
        if started is not None:
            self.trainer._timers["optimizer"] = time.perf_counter() - started

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._end_of_step(state, control)


# ------------------------------------------------------------------------------------- helpers
def _check_prompts_text_only(dataset, rows: int = 256) -> None:
    """Fail at construction (not in the rollout process) when the first prompts carry images."""
    try:
        count = min(len(dataset), rows)
    except TypeError:  # an iterable dataset: the rollout loop checks each prompt as it renders it
        return
    for i in range(count):
        row = dataset[i]
        if isinstance(row, dict):
            check_text_only(row.get("prompt"), f"train_dataset row {i}, column 'prompt'")


def _evaluates(args: AsyncGRPOConfig) -> bool:
    """Whether transformers' ``eval_strategy`` asks for evaluations (then ``eval_dataset`` is scored)."""
    return args.eval_strategy not in (None, "no")


def _as_reward_list(reward_funcs) -> list[Callable]:
    funcs = (
        []
        if reward_funcs is None
        else list(reward_funcs)
        if isinstance(reward_funcs, list | tuple)
        else [reward_funcs]
    )
    for func in funcs:
        if isinstance(func, str) or not callable(func):
            raise TypeError(
                f"reward_funcs: {func!r} is not a callable; reward models given as ids are not supported: pass a "
                "function (sync or async) that returns one float per completion"
            )
    return funcs


def _training_dtype(model, args) -> str:
    if args.bf16:
        return "bfloat16"
    if args.fp16:
        return "float16"
    return str(next(model.parameters()).dtype).replace("torch.", "")


def _precision(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _now(device) -> float:
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()
