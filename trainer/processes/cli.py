"""``python -m trainer train --config RUN.yaml [--resume latest|PATH]``: one run, standalone.

This is what the control plane's worker launches. The RUN.yaml document is validated with the same run
schema as the control plane's (:func:`trainer.config.run_config.run_document_errors`, :mod:`trainer.config.run_schema`),
then AsyncGRPOConfig is built (its runtime checks) and its names are resolved (the CLI may import any
dotted path: it runs the user's own code, unlike the web).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
from pathlib import Path

from trainer.config.run_config import RunConfigError, RunSpec, read_run_file, validate_run_document
from trainer.processes.host import leave_process_group
from trainer.processes.interrupt import EXIT_INTERRUPTED, marker_write


def _log(line: str) -> None:
    logging.getLogger("trainer.plugins.hub").info("%s", line)


def build_trainer(spec: RunSpec, trainer_cls=None):
    """An :class:`~trainer.trainer.AsyncGRPOTrainer` for a validated run document."""
    from trainer.plugins.hub import resolve_sources
    from trainer.plugins.registry import load_dataset_by_name, resolve_callable, resolve_model
    from trainer.trainer import AsyncGRPOTrainer

    trainer_cls = trainer_cls or AsyncGRPOTrainer
    # Hub ids become local snapshots (the control plane's worker has done it already: its launch
    # document names the snapshot directories, which pass through unchanged).
    sources = resolve_sources(
        model=spec.model,
        dataset=spec.train_dataset,
        model_revision=spec.model_revision,
        dataset_revision=spec.dataset_revision,
        progress=_log,
        eval_dataset=spec.eval_dataset,
        eval_dataset_revision=spec.eval_dataset_revision,
    )
    model, dataset_name = sources.model, sources.dataset
    if spec.loop_cls:
        from trainer.rollout.loop import AsyncRolloutLoop

        loop_cls = resolve_callable(spec.loop_cls)
        if not (isinstance(loop_cls, type) and issubclass(loop_cls, AsyncRolloutLoop)):
            raise ValueError(f"loop_cls {spec.loop_cls!r} is not an AsyncRolloutLoop subclass")
        # The spec's way: a trainer subclass whose loop_cls is the custom loop.
        trainer_cls = type(
            f"{trainer_cls.__name__}With{loop_cls.__name__}", (trainer_cls,), {"loop_cls": loop_cls}
        )
    dataset = None
    if dataset_name:
        dataset = load_dataset_by_name(
            dataset_name, config=spec.dataset_config, split=spec.dataset_split, columns=spec.dataset_columns
        )
    eval_dataset = None
    if sources.eval_dataset:
        eval_dataset = load_dataset_by_name(
            sources.eval_dataset,
            config=spec.eval_dataset_config,
            split=spec.eval_dataset_split,
            columns=spec.dataset_columns,
            field="eval_dataset",
        )
    env = spec.environment_factory
    if isinstance(env, dict):
        env = {name: resolve_callable(path) for name, path in env.items()}
    elif env is not None:
        env = resolve_callable(env)
    peft_config = None
    if spec.peft_config:
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", **spec.peft_config)
    return trainer_cls(
        model=resolve_model(model),
        reward_funcs=[resolve_callable(p) for p in spec.reward_funcs] or None,
        args=spec.args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        tools=[resolve_callable(p) for p in spec.tools] or None,
        environment_factory=env,
    )


def train_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer train", description="Run async GRPO training.")
    parser.add_argument("--config", required=True, help="RUN.yaml (see docs/config.md)")
    parser.add_argument(
        "--resume", default=None, help="'latest' (last checkpoint in output_dir) or a checkpoint path"
    )
    parser.add_argument("--output-dir", default=None, help="override args.output_dir")
    parser.add_argument(
        "--callback",
        action="append",
        default=[],
        metavar="DOTTED.PATH",
        help="a TrainerCallback class to install (repeatable; the control plane's worker adds its reporter)",
    )
    opts = parser.parse_args(argv)
    # A rank killed by a signal (SIGABRT from a C++ library, SIGSEGV) prints every thread's Python
    # stack first: torchrun itself reports only the signal and the pid.
    faulthandler.enable(all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = validate_run_document(read_run_file(opts.config), output_dir=opts.output_dir)
    except RunConfigError as exc:
        for field, message in exc.errors.items():
            print(f"error: {opts.config}: {field}: {message}", file=sys.stderr)
        return 2
    interrupted = _train(
        spec, callbacks=opts.callback, resume=True if opts.resume == "latest" else opts.resume
    )
    # Once the trainer is out of scope (its wrapped model refers to the group). Not after a failure:
    # an NCCL group with work in flight can block its own destruction, and the traceback says enough.
    leave_process_group()
    return EXIT_INTERRUPTED if interrupted else 0


def _train(spec: RunSpec, *, callbacks: list[str], resume: str | bool | None) -> bool:
    """Build the trainer, train, save the final model (the trainer is dropped on return).

    Returns True when training stopped on an interrupt request (trainer/processes/interrupt.py): then the
    checkpoint of the last step stands for the model, and ``interrupted.json`` says which it is.
    """
    from trainer.plugins.registry import resolve_callable

    trainer = build_trainer(spec)
    for path in callbacks:
        trainer.add_callback(resolve_callable(path))
    trainer.train(resume_from_checkpoint=resume)
    step = trainer.interrupted_at
    if step is None:
        trainer.save_model()
        return False
    if trainer.is_world_process_zero():
        folder = Path(spec.args.output_dir) / f"checkpoint-{step}"
        marker_write(spec.args.output_dir, step=step, checkpoint=str(folder) if folder.is_dir() else None)
        _log(f"interrupted on request at step {step}; checkpoint: {folder}")
    return True
