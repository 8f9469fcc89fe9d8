"""``torch_compile=True``: the norm and MLP blocks are compiled, not the whole model (tree mask inside)."""

from __future__ import annotations

from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.rewards import accuracy_reward
from trainer.tasks.arithmetic import arithmetic_rows


def _compiled(module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def test_torch_compile_compiles_the_pointwise_blocks_only(tiny_model_dir, tmp_path):
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        vllm_server_base_url="http://127.0.0.1:9",  # never contacted: nothing is trained here
        torch_compile=True,
        dtype="float32",
        use_cpu=True,
        report_to="none",
    )
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=Dataset.from_list(arithmetic_rows(8, seed=0, split="train")),
    )
    blocks = [m for m in trainer.model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    assert blocks and all(_compiled(m) for m in blocks)
    others = [m for m in trainer.model.modules() if m not in blocks]
    assert not any(_compiled(m) for m in others)  # attention and the model itself stay eager
    # transformers' whole-model compile (accelerate's dynamo plugin) is off
    assert trainer.accelerator.state.dynamo_plugin.backend.value == "NO"
