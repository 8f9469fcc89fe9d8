"""AsyncGRPOConfig: the spec's fields, defaults, changed TrainingArguments defaults and refusals;
RUN.yaml validation (field-named errors, nothing imported)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config.async_grpo_config import AsyncGRPOConfig, config_reference_markdown
from trainer.config.run_config import RunConfigError, validate_run_document

SPEC_DEFAULTS = {
    "dtype": "float32",
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "num_generations": 8,
    "max_completion_length": 2048,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "chat_template_kwargs": None,
    "max_tool_calling_iterations": None,
    "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_timeout": 1800.0,
    "epsilon": 0.2,
    "score_centering": True,
    "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": 5.0,
    "num_sampler_logprobs": 8,
    "token_budget": None,
    "max_concurrent_rollouts": 512,
    "max_staleness": 4,
    "weight_sync_steps": 1,
    "rollout_worker_timeout": 300.0,
    "log_completions": False,
    "num_completions_to_print": None,
    "model_init_kwargs": None,
    # changed TrainingArguments defaults
    "logging_steps": 1,
    "gradient_checkpointing": True,
    "learning_rate": 1e-6,
    "ignore_data_skip": True,
    "remove_unused_columns": False,
    "per_device_train_batch_size": 8,
    "num_train_epochs": 3.0,
    "max_steps": -1,
}


def test_spec_defaults(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path))
    for name, value in SPEC_DEFAULTS.items():
        assert getattr(args, name) == value, name
    assert (
        str(
            args.lr_scheduler_type.value
            if hasattr(args.lr_scheduler_type, "value")
            else args.lr_scheduler_type
        )
        == "constant"
    )
    assert args.epsilon_high == args.epsilon  # None -> epsilon
    assert args.report_to == [] or args.report_to == "none"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "deepspeed"),
        ({"use_liger_kernel": True}, "use_liger_kernel"),
        ({"ignore_data_skip": False}, "ignore_data_skip"),
        ({"remove_unused_columns": True}, "remove_unused_columns"),
        ({"top_p": 0.9}, "top_k"),
        ({"min_p": 0.1}, "min_p"),
        ({"num_generations": 1}, "num_generations"),
        ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.0}, "clip_min"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"weight_sync_steps": 0}, "weight_sync_steps"),
        ({"score_centering": True, "num_sampler_logprobs": 0}, "num_sampler_logprobs"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_refused_combinations_name_the_option(tmp_path, kwargs, names):
    with pytest.raises(ValueError, match=names):
        AsyncGRPOConfig(output_dir=str(tmp_path), **kwargs)


def test_context_parallelism_is_refused(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match="cp_size"):
        AsyncGRPOConfig(output_dir=str(tmp_path), parallelism_config=ParallelismConfig(cp_size=2))


def test_json_string_kwargs_are_parsed(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), chat_template_kwargs='{"enable_thinking": false}')
    assert args.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match="model_init_kwargs"):
        AsyncGRPOConfig(output_dir=str(tmp_path), model_init_kwargs="{not json")


def test_config_reference_doc_is_current():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    assert doc.endswith(config_reference_markdown()), "regenerate docs/config.md (see its header)"


def test_run_document_valid():
    spec = validate_run_document(
        {
            "model": "tiny",
            "train_dataset": "arithmetic",
            "reward_funcs": ["trainer.rewards.accuracy_reward"],
            "args": {"num_generations": 4, "max_steps": 3, "learning_rate": 1e-5},
        },
        output_dir="/tmp/run-x",
    )
    assert spec.args.num_generations == 4 and spec.args.output_dir == "/tmp/run-x"


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"train_dataset": "arithmetic", "reward_funcs": ["a.b"]}, "model"),
        ({"model": "tiny", "train_dataset": "arithmetic", "reward_funcs": ["a.b"], "bogus": 1}, "bogus"),
        ({"model": "tiny", "train_dataset": "arithmetic", "reward_funcs": ["not a path"]}, "reward_funcs[0]"),
        ({"model": "tiny", "train_dataset": "arithmetic"}, "reward_funcs"),
        ({"model": "tiny", "reward_funcs": ["a.b"]}, "train_dataset"),
        (
            {"model": "tiny", "train_dataset": "arithmetic", "reward_funcs": ["a.b"], "args": {"lr": 1}},
            "args.lr",
        ),
        (
            {
                "model": "tiny",
                "train_dataset": "arithmetic",
                "reward_funcs": ["a.b"],
                "args": {"max_steps": "9"},
            },
            "args.max_steps",
        ),
        (
            {"model": "tiny", "train_dataset": "arithmetic", "reward_funcs": ["a.b"], "args": {"top_p": 0.5}},
            "args.top_p",
        ),
        (
            {
                "model": "tiny",
                "train_dataset": "arithmetic",
                "reward_funcs": ["a.b"],
                "peft_config": {"target_modules": ["lm_head"]},
            },
            "peft_config.target_modules",
        ),
        ([1, 2], "document"),
    ],
)
def test_run_document_errors_name_the_field(doc, field):
    with pytest.raises(RunConfigError) as info:
        validate_run_document(doc)
    assert field in info.value.errors, info.value.errors
