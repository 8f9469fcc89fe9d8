"""GENERATED from transformers.TrainingArguments; do not edit. Regenerate with
``python -c 'from trainer.config.async_grpo_config import write_training_args_fields as w; w()'`` and
``ruff format``; tests/test_run_schema.py fails when this is stale. Pure data: the web reads it
without importing transformers (trainer/config/run_schema.py)."""

from typing import Any

TRANSFORMERS_VERSION = "5.19.0"

TRAINING_ARGS_FIELDS: dict[str, dict[str, Any]] = {
    "accelerator_config": {
        "default": None,
        "help": "Configuration for the internal Accelerate integration. Can be a path to a "
        "JSON config file or a dict.",
        "keys": (
            "split_batches",
            "dispatch_batches",
            "even_batches",
            "use_seedable_sampler",
            "non_blocking",
            "gradient_accumulation_kwargs",
            "use_configured_state",
        ),
        "kinds": ("dict", "str"),
        "nullable": True,
    },
    "adam_beta1": {
        "default": 0.9,
        "help": "The exponential decay rate for the first moment estimates (momentum) in Adam-based "
        "optimizers.",
        "kinds": ("float",),
        "nullable": False,
    },
    "adam_beta2": {
        "default": 0.999,
        "help": "The exponential decay rate for the second moment estimates (variance) in Adam-based "
        "optimizers.",
        "kinds": ("float",),
        "nullable": False,
    },
    "adam_epsilon": {
        "default": 1e-08,
        "help": "Epsilon value for numerical stability in Adam-based optimizers.",
        "kinds": ("float",),
        "nullable": False,
    },
    "auto_find_batch_size": {
        "default": False,
        "help": "Whether to find a training batch size that will fit into memory "
        "automatically through exponential decay, avoiding CUDA Out-of-Memory "
        "errors. The evaluation batch size is not adjusted.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "average_tokens_across_devices": {
        "default": True,
        "help": "Whether or not to average tokens across devices. If enabled, "
        "will use all_reduce to synchronize num_tokens_in_batch for "
        "precise loss calculation. Reference: "
        "https://github.com/huggingface/transformers/issues/34242",
        "kinds": ("bool",),
        "nullable": False,
    },
    "batch_eval_metrics": {
        "default": False,
        "help": "Break eval metrics calculation into batches to save memory.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "bf16": {
        "default": False,
        "help": "Enable bfloat16 (BF16) mixed precision training. Generally preferred over FP16 due to "
        "better numerical stability.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "bf16_full_eval": {
        "default": False,
        "help": "Use full BF16 precision for evaluation (not just mixed precision). Faster and saves memory.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "data_seed": {
        "default": None,
        "help": "Random seed to be used with data samplers. If not set, uses the same seed as `seed`.",
        "kinds": ("int",),
        "nullable": True,
    },
    "dataloader_drop_last": {
        "default": False,
        "help": "Drop the last incomplete batch if it is not divisible by the batch size.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "dataloader_in_order": {
        "default": True,
        "help": "If True (default), the data loader yields batches in the order workers "
        "were dispatched. Set to False to yield batches as soon as they are ready, "
        "reducing tail latency for IterableDataset streaming workloads. Requires "
        "PyTorch >= 2.6.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "dataloader_multiprocessing_context": {
        "default": None,
        "help": "The multiprocessing start method to use for data loading "
        "workers ('fork', 'spawn', or 'forkserver'). Defaults to "
        "PyTorch's default, except on MPS with "
        "dataloader_num_workers > 1, where it defaults to 'fork'. "
        "Use 'spawn' when streaming from sources whose objects are "
        "not fork-safe (e.g. HDFS via pyarrow). Under 'spawn', any "
        "custom collate_fn / dataset code must be importable at "
        "module level (no lambdas/closures).",
        "kinds": ("str",),
        "nullable": True,
    },
    "dataloader_num_workers": {
        "default": 0,
        "help": "Number of subprocesses to use for data loading (PyTorch only). 0 means "
        "that the data will be loaded in the main process.",
        "kinds": ("int",),
        "nullable": False,
    },
    "dataloader_persistent_workers": {
        "default": False,
        "help": "If True, the data loader will not shut down the worker processes "
        "after a dataset has been consumed once. This allows to maintain "
        "the workers Dataset instances alive. Can potentially speed up "
        "training, but will increase RAM usage.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "dataloader_pin_memory": {
        "default": True,
        "help": "Whether or not to pin memory for DataLoader.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "dataloader_prefetch_factor": {
        "default": None,
        "help": "Number of batches loaded in advance by each worker. 2 means there "
        "will be a total of 2 * num_workers batches prefetched across all "
        "workers.",
        "kinds": ("int",),
        "nullable": True,
    },
    "ddp_backend": {
        "default": None,
        "help": "The backend to use for distributed training. Must be one of 'nccl', 'mpi', 'xccl', "
        "'gloo', 'hccl'.",
        "kinds": ("str",),
        "nullable": True,
    },
    "ddp_broadcast_buffers": {
        "default": None,
        "help": "When using distributed training, the value of the flag "
        "`broadcast_buffers` passed to `DistributedDataParallel`.",
        "kinds": ("bool",),
        "nullable": True,
    },
    "ddp_bucket_cap_mb": {
        "default": None,
        "help": "When using distributed training, the value of the flag `bucket_cap_mb` "
        "passed to `DistributedDataParallel`.",
        "kinds": ("int",),
        "nullable": True,
    },
    "ddp_find_unused_parameters": {
        "default": None,
        "help": "When using distributed training, the value of the flag "
        "`find_unused_parameters` passed to `DistributedDataParallel`.",
        "kinds": ("bool",),
        "nullable": True,
    },
    "ddp_static_graph": {
        "default": None,
        "help": "When using distributed training, the value of the flag `static_graph` passed "
        "to `DistributedDataParallel`.",
        "kinds": ("bool",),
        "nullable": True,
    },
    "ddp_timeout": {
        "default": 1800,
        "help": "The timeout for `torch.distributed.init_process_group` calls (in seconds).",
        "kinds": ("int",),
        "nullable": False,
    },
    "debug": {
        "default": "",
        "help": "Enable one or more debug features. Options: 'underflow_overflow' (detect overflow in "
        "model I/O), 'tpu_metrics_debug' (print TPU metrics).",
        "item_choices": ("underflow_overflow", "tpu_metrics_debug"),
        "kinds": ("list", "str"),
        "nullable": False,
        "str_items": True,
    },
    "deepspeed": {
        "default": None,
        "help": "Enable DeepSpeed integration. Value is a path to a JSON config file or a dict.",
        "kinds": ("dict", "str"),
        "nullable": True,
    },
    "disable_tqdm": {
        "default": None,
        "help": "Disable tqdm progress bars. Defaults to True if log_level is warning or lower.",
        "kinds": ("bool",),
        "nullable": True,
    },
    "do_eval": {
        "default": False,
        "help": "Whether to run evaluation. Not directly used by Trainer; intended for "
        "training/evaluation scripts.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "do_predict": {
        "default": False,
        "help": "Whether to run predictions on the test set. Not directly used by Trainer; intended "
        "for training/evaluation scripts.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "do_train": {
        "default": False,
        "help": "Whether to run training. Not directly used by Trainer; intended for "
        "training/evaluation scripts.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "enable_jit_checkpoint": {
        "default": False,
        "help": "Enable JIT checkpointing on SIGTERM signal for graceful termination on "
        "preemptible workloads. Configure your orchestrator's graceful shutdown "
        "period accordingly.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "eval_accumulation_steps": {
        "default": None,
        "help": "Number of predictions steps to accumulate the output tensors for, "
        "before moving the results to the CPU. If unset, predictions are "
        "accumulated on the accelerator before being moved to the CPU.",
        "kinds": ("int",),
        "nullable": True,
    },
    "eval_delay": {
        "default": 0,
        "help": "Number of epochs or steps to wait for before the first evaluation can be performed, "
        "depending on the eval_strategy.",
        "kinds": ("float",),
        "nullable": False,
    },
    "eval_do_concat_batches": {
        "default": True,
        "help": "Whether to recursively concat inputs/losses/labels/predictions across "
        "batches. If `False`, will instead store them as lists, with each batch "
        "kept separate.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "eval_on_start": {
        "default": False,
        "help": "Whether to run through the entire `evaluation` step at the very beginning of "
        "training as a sanity check.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "eval_steps": {
        "default": None,
        "help": "Number of update steps between evaluations if `eval_strategy='steps'`. Defaults to "
        "`logging_steps` if not set. Should be an integer or a float in range `[0,1)`. If "
        "smaller than 1, will be interpreted as ratio of total training steps.",
        "kinds": ("float",),
        "nullable": True,
    },
    "eval_strategy": {
        "choices": ("no", "steps", "epoch"),
        "default": "no",
        "help": "When to run evaluation. Options: 'no', 'steps', 'epoch'.",
        "kinds": ("str",),
        "nullable": False,
    },
    "eval_use_gather_object": {
        "default": False,
        "help": "Whether to run recursively gather object in a nested "
        "list/tuple/dictionary of objects from all devices.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "fp16": {
        "default": False,
        "help": "Enable float16 (FP16) mixed precision training. Consider using BF16 instead if your "
        "hardware supports it.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "fp16_full_eval": {
        "default": False,
        "help": "Use full FP16 precision for evaluation (not just mixed precision). Faster and saves memory.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "fsdp": {
        "default": None,
        "help": "Enable PyTorch Fully Sharded Data Parallel (FSDP) for distributed training. Pass `--fsdp` "
        "(or `fsdp=True`) to turn FSDP on.",
        "kinds": ("str",),
        "nullable": True,
    },
    "fsdp_config": {
        "default": None,
        "help": "Tuning for FSDP (used only when `fsdp` is enabled). Either a path to a JSON config "
        "file (e.g., `fsdp_config.json`) or an already loaded dict.",
        "kinds": ("dict", "str"),
        "nullable": True,
    },
    "full_determinism": {
        "default": False,
        "help": "Whether to call enable_full_determinism instead of set_seed for "
        "reproducibility in distributed training. Important: this will negatively "
        "impact the performance, so only use it for debugging.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "gradient_accumulation_steps": {
        "default": 1,
        "help": "Number of update steps to accumulate gradients before performing a "
        "backward/update pass. Effective batch size = "
        "per_device_train_batch_size * num_devices * "
        "gradient_accumulation_steps.",
        "kinds": ("int",),
        "nullable": False,
    },
    "gradient_checkpointing": {
        "default": False,
        "help": "Enable gradient checkpointing to trade compute for memory. Reduces "
        "memory at the cost of ~20%% slower training.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "gradient_checkpointing_kwargs": {
        "default": None,
        "help": "Keyword arguments passed to `gradient_checkpointing_enable()`. "
        "`every_n_layers` checkpoints only every n-th decoder layer "
        "instead of all of them; `1` is the usual all-or-nothing "
        "behavior, and larger values give some memory back to speed. "
        "`offload` holds the saved activations in pinned host memory, "
        "which frees device memory and makes the step slower. Any other "
        "key is forwarded to `torch.utils.checkpoint.checkpoint`.",
        "kinds": ("dict", "str"),
        "nullable": True,
    },
    "greater_is_better": {
        "default": None,
        "help": "Whether higher metric values are better. Defaults based on `metric_for_best_model`.",
        "kinds": ("bool",),
        "nullable": True,
    },
    "hub_always_push": {
        "default": False,
        "help": "Unless `True`, the Trainer will skip pushes if the previous one wasn't finished yet.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "hub_model_id": {
        "default": None,
        "help": "The name of the repository to keep in sync with the local `output_dir`.",
        "kinds": ("str",),
        "nullable": True,
    },
    "hub_private_repo": {
        "default": None,
        "help": "Whether to make the repo private. If `None` (default), the repo will be "
        "public unless the organization's default is private. This value is ignored if "
        "the repo already exists. If reporting to Trackio Spaces created or synced "
        "(including on Hub push when `trackio_space_id` is None) use the same logic "
        "for whether the Space is private.",
        "kinds": ("bool",),
        "nullable": True,
    },
    "hub_revision": {
        "default": None,
        "help": "The revision to use when pushing to the Hub. Can be a branch name, a tag, or a commit hash.",
        "kinds": ("str",),
        "nullable": True,
    },
    "hub_strategy": {
        "choices": ("end", "every_save", "checkpoint", "all_checkpoints"),
        "default": "every_save",
        "help": "Defines what and when to push to Hub. Options: 'end', 'every_save', 'checkpoint', "
        "'all_checkpoints'.",
        "kinds": ("str",),
        "nullable": False,
    },
    "hub_token": {
        "default": None,
        "help": "The token to use to push the model to the Hub. Defaults to the token from `hf auth login`.",
        "kinds": ("str",),
        "nullable": True,
    },
    "ignore_data_skip": {
        "default": False,
        "help": "When resuming training, skip fast-forwarding through the dataset to reach the "
        "previous state. If True, training starts from the beginning of the dataset.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "include_for_metrics": {
        "default": [],
        "help": "Include additional data in the `compute_metrics` function. Options: 'inputs', 'loss'.",
        "kinds": ("list",),
        "nullable": False,
        "str_items": True,
    },
    "include_num_input_tokens_seen": {
        "default": "no",
        "help": "Whether to track the number of input tokens seen. Must be one of "
        "[`all`, `non_padding`, `no`] or a boolean value which map to "
        "`all` or `no`",
        "kinds": ("bool", "str"),
        "nullable": False,
    },
    "label_names": {
        "default": None,
        "help": "The list of keys in your dictionary of inputs that correspond to the labels.",
        "kinds": ("list",),
        "nullable": True,
        "str_items": True,
    },
    "label_smoothing_factor": {
        "default": 0.0,
        "help": "Label smoothing factor to prevent overconfidence. Zero means no smoothing.",
        "kinds": ("float",),
        "nullable": False,
    },
    "learning_rate": {
        "default": 5e-05,
        "help": "The initial learning rate for the optimizer.",
        "kinds": ("float",),
        "nullable": False,
    },
    "length_column_name": {
        "default": "length",
        "help": "Column name for precomputed lengths. Ignored unless "
        "`train_sampling_strategy` is 'group_by_length' or 'batch_rebalance'.",
        "kinds": ("str",),
        "nullable": False,
    },
    "liger_kernel_config": {
        "default": None,
        "help": "Configuration for Liger Kernel. Passed as kwargs to "
        "`_apply_liger_kernel_to_instance()`. If None, uses default configuration.",
        "kinds": ("dict",),
        "nullable": True,
    },
    "load_best_model_at_end": {
        "default": False,
        "help": "Load the best checkpoint at the end of training. Requires `eval_strategy` to be set.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "local_rank": {
        "default": -1,
        "help": "When using torch.distributed.launch (Deprecated), it will pass `local_rank` in the "
        "script, so we need this for the parser. To get the local rank, prefer using the "
        "property `local_process_index`",
        "kinds": ("int",),
        "nullable": False,
    },
    "log_level": {
        "default": "passive",
        "help": "Logging level for the main process. Options: 'debug', 'info', 'warning', 'error', "
        "'critical', 'passive'.",
        "kinds": ("str",),
        "nullable": False,
    },
    "log_level_replica": {
        "default": "warning",
        "help": "Logging level for replica processes in distributed training. Same options as `log_level`.",
        "kinds": ("str",),
        "nullable": False,
    },
    "log_on_each_node": {
        "default": True,
        "help": "When doing a multinode distributed training, whether to log once per node or "
        "just once on the main node.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "logging_first_step": {
        "default": False,
        "help": "Whether to log the first `global_step` or not.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "logging_nan_inf_filter": {
        "default": True,
        "help": "Filter out NaN and Inf losses when logging. Does not affect gradient "
        "computation, only logging.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "logging_steps": {
        "default": 500,
        "help": "Log every X updates steps. Should be an integer or a float in range `[0,1)`. If "
        "smaller than 1, will be interpreted as ratio of total training steps.",
        "kinds": ("float",),
        "nullable": False,
    },
    "logging_strategy": {
        "choices": ("no", "steps", "epoch"),
        "default": "steps",
        "help": "The logging strategy to adopt during training. Options: 'no', 'epoch', 'steps'.",
        "kinds": ("str",),
        "nullable": False,
    },
    "lr_scheduler_kwargs": {
        "default": None,
        "help": "The extra arguments for the lr_scheduler. See the documentation of each "
        "scheduler for possible values.",
        "kinds": ("dict", "str"),
        "nullable": True,
    },
    "lr_scheduler_type": {
        "choices": (
            "linear",
            "cosine",
            "cosine_with_restarts",
            "polynomial",
            "constant",
            "constant_with_warmup",
            "inverse_sqrt",
            "reduce_lr_on_plateau",
            "cosine_with_min_lr",
            "cosine_warmup_with_min_lr",
            "warmup_stable_decay",
            "greedy",
        ),
        "default": "linear",
        "help": "The learning rate scheduler type to use. See `SchedulerType` for all possible values.",
        "kinds": ("str",),
        "nullable": False,
    },
    "max_grad_norm": {
        "default": 1.0,
        "help": "Maximum gradient norm for gradient clipping. Set to 0 to disable.",
        "kinds": ("float",),
        "nullable": False,
    },
    "max_steps": {
        "default": -1,
        "help": "Overrides `num_train_epochs`. If set to a positive number, the total number of "
        "training steps to perform. Must be set when the training dataset does not implement "
        "`__len__` (e.g. a streaming dataset).",
        "kinds": ("int",),
        "nullable": False,
    },
    "metric_for_best_model": {
        "default": None,
        "help": "Metric to use for comparing models when `load_best_model_at_end=True`. Defaults to 'loss'.",
        "kinds": ("str",),
        "nullable": True,
    },
    "neftune_noise_alpha": {
        "default": None,
        "help": "If not None, activates NEFTune noise embeddings. Can drastically improve "
        "performance for instruction fine-tuning. Typical range: [5.0, 15.0].",
        "kinds": ("float",),
        "nullable": True,
    },
    "num_train_epochs": {
        "default": 3.0,
        "help": "Total number of training epochs to perform.",
        "kinds": ("float",),
        "nullable": False,
    },
    "optim": {
        "choices": (
            "adamw_torch",
            "adamw_torch_fused",
            "adamw_torch_xla",
            "adamw_torch_npu_fused",
            "adafactor",
            "adamw_anyprecision",
            "adamw_torch_4bit",
            "adamw_torch_8bit",
            "ademamix",
            "sgd",
            "adagrad",
            "adamw_bnb_8bit",
            "adamw_8bit",
            "ademamix_8bit",
            "lion_8bit",
            "lion_32bit",
            "paged_adamw_32bit",
            "paged_adamw_8bit",
            "paged_ademamix_32bit",
            "paged_ademamix_8bit",
            "paged_lion_32bit",
            "paged_lion_8bit",
            "rmsprop",
            "rmsprop_bnb",
            "rmsprop_bnb_8bit",
            "rmsprop_bnb_32bit",
            "galore_adamw",
            "galore_adamw_8bit",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
            "lomo",
            "adalomo",
            "grokadamw",
            "schedule_free_radam",
            "schedule_free_adamw",
            "schedule_free_sgd",
            "apollo_adamw",
            "apollo_adamw_layerwise",
            "stable_adamw",
        ),
        "default": "adamw_torch_fused",
        "help": "The optimizer to use. See `OptimizerNames` for the complete list.",
        "kinds": ("str",),
        "nullable": False,
    },
    "optim_args": {
        "default": None,
        "help": "Optional arguments supplied to optimizers such as AnyPrecisionAdamW, AdEMAMix, and GaLore.",
        "kinds": ("str",),
        "nullable": True,
    },
    "optim_target_modules": {
        "default": None,
        "help": "The target modules to optimize. Currently used for the GaLore and APOLLO algorithms.",
        "kinds": ("list", "str"),
        "nullable": True,
        "str_items": True,
    },
    "output_dir": {
        "default": None,
        "help": "The output directory where the model predictions and checkpoints will be written.",
        "kinds": ("str",),
        "nullable": True,
    },
    "parallelism_config": {
        "default": None,
        "help": "Parallelism configuration for the training run. Requires Accelerate `1.10.1`.",
        "keys": (
            "dp_replicate_size",
            "dp_shard_size",
            "tp_size",
            "cp_size",
            "cp_backend",
            "sp_size",
            "sp_backend",
            "tp_handler",
            "cp_handler",
            "sp_handler",
        ),
        "kinds": ("dict",),
        "nullable": True,
    },
    "per_device_eval_batch_size": {
        "default": 8,
        "help": "The batch size per device (GPU/TPU core/CPU) for evaluation.",
        "kinds": ("int",),
        "nullable": False,
    },
    "per_device_train_batch_size": {
        "default": 8,
        "help": "The batch size per device for training.",
        "kinds": ("int",),
        "nullable": False,
    },
    "prediction_loss_only": {
        "default": False,
        "help": "When performing evaluation and generating predictions, only returns the loss.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "project": {
        "default": "huggingface",
        "help": "The name of the project to use for logging. Currently, only used by Trackio.",
        "kinds": ("str",),
        "nullable": False,
    },
    "push_to_hub": {
        "default": False,
        "help": "Whether or not to push the model to the Hub every time the model is saved.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "remove_unused_columns": {
        "default": True,
        "help": "Whether or not to automatically remove the columns unused by the model forward method.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "report_to": {
        "default": "none",
        "help": "The list of integrations to report the results and logs to. Use 'all' for all "
        "installed integrations, 'none' for no integrations.",
        "kinds": ("list", "str"),
        "nullable": True,
        "str_items": True,
    },
    "restore_callback_states_from_checkpoint": {
        "default": False,
        "help": "Whether to restore the callback states from the "
        "checkpoint. If `True`, will override callbacks passed "
        "to the `Trainer` if they exist in the checkpoint.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "resume_from_checkpoint": {
        "default": None,
        "help": "Path to a folder with a valid checkpoint for your model. Not directly "
        "used by Trainer; intended for training/evaluation scripts.",
        "kinds": ("str",),
        "nullable": True,
    },
    "run_name": {
        "default": None,
        "help": "An optional descriptor for the run. Notably used for trackio, wandb, mlflow comet and "
        "swanlab logging.",
        "kinds": ("str",),
        "nullable": True,
    },
    "save_on_each_node": {
        "default": False,
        "help": "When doing multi-node distributed training, whether to save models and "
        "checkpoints on each node, or only on the main one",
        "kinds": ("bool",),
        "nullable": False,
    },
    "save_only_model": {
        "default": False,
        "help": "Save only model weights, not optimizer/scheduler/RNG state. Prevents resuming "
        "training from checkpoint.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "save_steps": {
        "default": 500,
        "help": "Save checkpoint every X updates steps. Should be an integer or a float in range "
        "`[0,1)`. If smaller than 1, will be interpreted as ratio of total training steps.",
        "kinds": ("float",),
        "nullable": False,
    },
    "save_strategy": {
        "choices": ("no", "steps", "epoch", "best"),
        "default": "steps",
        "help": "The checkpoint save strategy to adopt during training. Options: 'no', 'epoch', "
        "'steps', 'best'.",
        "kinds": ("str",),
        "nullable": False,
    },
    "save_total_limit": {
        "default": None,
        "help": "Maximum number of checkpoints to keep. Deletes older checkpoints in "
        "`output_dir`. The best checkpoint is always retained when "
        "`load_best_model_at_end=True`.",
        "kinds": ("int",),
        "nullable": True,
    },
    "seed": {
        "default": 42,
        "help": "Random seed that will be set at the beginning of training.",
        "kinds": ("int",),
        "nullable": False,
    },
    "skip_memory_metrics": {
        "default": True,
        "help": "Whether to skip adding memory profiler reports to metrics. Skipped by "
        "default because it slows down training.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "tf32": {
        "default": None,
        "help": "Enable TF32 mode on Ampere and newer GPUs. Provides up to 8x speedup with negligible "
        "accuracy loss.",
        "kinds": ("bool",),
        "nullable": True,
    },
    "torch_compile": {
        "default": False,
        "help": "Compile the model using `torch.compile()` for faster training.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "torch_compile_backend": {
        "default": None,
        "help": "Backend for `torch.compile()`. If set, automatically enables `torch_compile`.",
        "kinds": ("str",),
        "nullable": True,
    },
    "torch_compile_mode": {
        "default": None,
        "help": "Compilation mode for `torch.compile()`. If set, automatically enables `torch_compile`.",
        "kinds": ("str",),
        "nullable": True,
    },
    "torch_empty_cache_steps": {
        "default": None,
        "help": "Number of steps to wait before calling `torch.<device>.empty_cache()`. "
        "Helps avoid CUDA OOM at a cost of ~10%% slower performance. If None, "
        "cache will not be emptied.",
        "kinds": ("int",),
        "nullable": True,
    },
    "trackio_bucket_id": {
        "default": None,
        "help": "Optional HF Bucket id when using a Trackio Space; if unset, Trackio picks a default.",
        "kinds": ("str",),
        "nullable": True,
    },
    "trackio_space_id": {
        "default": None,
        "help": "Hugging Face Space id for live Gradio-based Trackio logging (read/write "
        "Bucket access). Use 'username/reponame', 'orgname/reponame', or 'reponame' "
        "(current user's namespace). None: log only locally, no Space. Prefer "
        "trackio_static_space_id for stable post-training dashboard links. Public "
        "unless hub_private_repo=True or org default.",
        "kinds": ("str",),
        "nullable": True,
    },
    "trackio_static_space_id": {
        "default": None,
        "help": "Static read-only Trackio Space over the Bucket (stable model-card "
        "links). False: no static sync on Hub push and no freeze after "
        "training. None/str: allow static Space; for local-only logging, Hub "
        "push runs sync(static); after training, freeze runs only if "
        "trackio_space_id was set (Gradio Space). str sets explicit static "
        "Space id. Public unless hub_private_repo=True or org default.",
        "kinds": ("bool", "str"),
        "nullable": True,
    },
    "train_sampling_strategy": {
        "default": "random",
        "help": "Sampler for training: 'random' (default), 'sequential', "
        "'group_by_length', or 'batch_rebalance'.",
        "kinds": ("str",),
        "nullable": False,
    },
    "use_cache": {
        "default": False,
        "help": "Whether or not to use cache for the model For training, this is usually not needed "
        "apart from some PEFT methods that uses `past_key_values`.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "use_cpu": {
        "default": False,
        "help": "Whether or not to use cpu. If set to False, we will use the available torch device/backend.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "use_liger_kernel": {
        "default": False,
        "help": "Enable Liger Kernel optimizations. Increases throughput by ~20%% and reduces "
        "memory by ~60%%.",
        "kinds": ("bool",),
        "nullable": False,
    },
    "warmup_steps": {
        "default": 0,
        "help": "Number of steps for a linear warmup from 0 to `learning_rate`. Can be an integer "
        "(exact steps) or a float in [0, 1) (ratio of total steps).",
        "kinds": ("float",),
        "nullable": False,
    },
    "weight_decay": {
        "default": 0.0,
        "help": "Weight decay coefficient applied by the optimizer. Automatically excluded from "
        "bias and LayerNorm parameters.",
        "kinds": ("float",),
        "nullable": False,
    },
}
