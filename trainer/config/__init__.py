"""The run's configuration: what a run is asked to do, and every check on it.

- :mod:`.async_grpo_config`: ``AsyncGRPOConfig`` (``transformers.TrainingArguments`` plus the spec's
  fields; the public names are ``trainer.AsyncGRPOConfig`` and ``trainer.trainer.async_grpo_config``);
- :mod:`.run_config`: RUN.yaml, the document that describes one run, and its validation;
- :mod:`.run_schema`: the one schema of a run document's ``args``, checked without transformers, with
  :mod:`.training_args_fields` (generated from ``TrainingArguments``) and :mod:`.config_ranges` (the
  range of every numeric field);
- :mod:`.resources`: the run document's ``resources`` block (GPUs, processes, vLLM parallelism);
- :mod:`.run_lengths`: a run's token lengths before it starts and its vLLM server's ``max_model_len``.

Nothing here imports transformers except :mod:`.async_grpo_config`: the web validates documents with
the rest.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # `from trainer.config import AsyncGRPOConfig` (the module's path before it was a package) keeps
    # working, lazily: the web imports this package's other modules without transformers.
    if name == "AsyncGRPOConfig":
        from trainer.config.async_grpo_config import AsyncGRPOConfig

        return AsyncGRPOConfig
    raise AttributeError(f"module 'trainer.config' has no attribute {name!r}")
