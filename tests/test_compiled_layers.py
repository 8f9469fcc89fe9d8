"""Decoder layers compiled whole (trainer.step.compiled_layers, issue 32): which runs get them, that the
compiled layers compute what the model computes, and that Hugging Face's checkpointing is switched
off on them. The FlexAttention path (CUDA: the block mask built before the first layer) is measured
on the GPU by ``python -m bench.compiled_layers`` (loss and gradients against the uncompiled model,
docs/benchmarks.md "Decoder layers compiled whole"); here the CPU's dense-mask path runs the same
compiled regions."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.config.async_grpo_config import AsyncGRPOConfig
from trainer.rollout.types import TrainingSequence
from trainer.step.attention import use_tree_attention
from trainer.step.compiled_layers import (
    checkpointing_left_to_the_compiler,
    compile_decoder_layers,
    decoder_layers,
    layer_memory_budget,
)
from trainer.step.loss import LossConfig, packed_row_loss
from trainer.step.packing import pack_row


def tiny_qwen3(layers: int = 2) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        use_cache=False,
    )
    model = Qwen3ForCausalLM(config).float()
    use_tree_attention(model)
    return model.train()


def tree_row(seed: int = 0):
    """A packed row of two groups (shared prompts, 3 completions each)."""
    rng = random.Random(seed)
    samples = []
    for group in range(2):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(5, 12))]
        for _ in range(3):
            completion = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 9))]
            ids = prompt + completion
            samples.append(
                TrainingSequence(
                    input_ids=ids,
                    loss_mask=[0] * len(prompt) + [1] * len(completion),
                    sampler_logprobs=[0.0] * len(prompt) + [-4.0] * len(completion),
                    advantage=rng.uniform(-1, 1),
                    group_id=group,
                )
            )
    return pack_row(samples, 0)


def loss_and_grads(model, row) -> tuple[float, dict[str, torch.Tensor]]:
    from trainer.step.attention import tree_forward_kwargs

    keep, logit_rows = row.logits_to_keep()
    out = model(**tree_forward_kwargs(row, "cpu"), logits_to_keep=keep)
    loss = packed_row_loss(
        out.logits,
        row,
        config=LossConfig(),
        num_trained_tokens=float(row.num_trained_tokens),
        logit_rows=logit_rows,
    ).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def args(**kw):
    base = {"gradient_checkpointing": True, "activation_memory_budget": 0.02, "fsdp": ""}
    return SimpleNamespace(**{**base, **kw})


def test_which_runs_compile_their_layers_whole_and_under_which_budget():
    model = tiny_qwen3()
    assert layer_memory_budget(model, args(), on_cuda=True) == 0.02
    assert layer_memory_budget(model, args(activation_memory_budget=0.3), on_cuda=True) == 0.3
    assert layer_memory_budget(model, args(gradient_checkpointing=False), on_cuda=True) == 1.0
    assert layer_memory_budget(model, args(), on_cuda=False) is None  # CPU: the norm/MLP blocks
    assert layer_memory_budget(model, args(fsdp="full_shard"), on_cuda=True) is None
    model.config.num_experts = 8  # a mixture-of-experts config: its routing is not compiled whole
    assert layer_memory_budget(model, args(), on_cuda=True) is None
    del model.config.num_experts
    model.peft_config = {"default": object()}  # what PEFT's wrapper carries
    assert layer_memory_budget(model, args(), on_cuda=True) is None


def test_the_budget_is_a_share_of_the_activations_named_in_the_config(tmp_path):
    assert AsyncGRPOConfig(output_dir=str(tmp_path)).activation_memory_budget == 0.02
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="activation_memory_budget"):
            AsyncGRPOConfig(output_dir=str(tmp_path), activation_memory_budget=bad)
    with pytest.raises(ValueError, match="memory_budget"):
        compile_decoder_layers(tiny_qwen3(), memory_budget=0.0)


def test_compiled_layers_compute_the_models_loss_and_gradients_and_take_over_checkpointing():
    row = tree_row()
    reference = tiny_qwen3()
    ref_loss, ref_grads = loss_and_grads(reference, row)

    model = tiny_qwen3()
    assert compile_decoder_layers(model, memory_budget=0.02) == 2
    # transformers' Trainer.train switches HF checkpointing on; the trainer's callback switches it
    # off again on the compiled layers (their recomputation is the compiler's)
    model.gradient_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
    assert checkpointing_left_to_the_compiler(model) == 2
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))

    for seed in (0, 1):  # a second row of another length: the same compiled regions (dynamic)
        row = tree_row(seed)
        ref_loss, ref_grads = loss_and_grads(reference, row)
        loss, grads = loss_and_grads(model, row)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
