"""Tree attention on a real (random-init, fp32) Qwen3: a packed row gives each sample's own logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.rollout.types import TrainingSequence
from trainer.step.attention import (
    TREE_ATTENTION,
    TreeMask,
    _pad_tree,
    padded_length,
    tree_forward_kwargs,
    tree_mask_mod,
    use_tree_attention,
)
from trainer.step.loss import LossConfig, packed_row_loss
from trainer.step.packing import pack_row

VOCAB = 128


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    model = Qwen3ForCausalLM(config).float()
    model.set_attn_implementation("sdpa")
    return model


def seq(ids: list[int], mask: list[int], group: int = 0) -> TrainingSequence:
    return TrainingSequence(input_ids=ids, loss_mask=mask, sampler_logprobs=[0.0] * len(ids), group_id=group)


def mixed_samples() -> list[TrainingSequence]:
    """A group sharing a prompt, a multi-turn fork, an identical pair and an unrelated sample."""
    g = torch.Generator().manual_seed(1)

    def rand(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    prompt, turn1, tool = rand(12), rand(5), rand(4)
    samples = [seq(prompt + c, [0] * 12 + [1] * len(c)) for c in (rand(6), rand(3), rand(8))]
    samples.append(seq(prompt + turn1 + tool + rand(4), [0] * 12 + [1] * 5 + [0] * 4 + [1] * 4))  # turn 2
    samples.append(seq(prompt + turn1 + tool + rand(6), [0] * 12 + [1] * 5 + [0] * 4 + [1] * 6))  # fork
    samples.append(seq(samples[0].input_ids, samples[0].loss_mask))  # duplicate rollout
    samples.append(seq(rand(9), [0] * 4 + [1] * 5, group=1))  # shares nothing
    return samples


def alone_logprobs(model, samples: list[TrainingSequence]) -> torch.Tensor:
    """Trained-token logprobs of each sample forwarded on its own with standard attention."""
    model.set_attn_implementation("sdpa")
    out = []
    for s in samples:
        ids = torch.tensor([s.input_ids])
        logp = model(input_ids=ids, use_cache=False).logits[0].log_softmax(-1)
        idx = torch.tensor([i for i, m in enumerate(s.loss_mask) if m])
        out.append(logp[idx - 1, ids[0, idx]])
    return torch.cat(out)


def packed_logprobs(model, samples: list[TrainingSequence]) -> torch.Tensor:
    row = pack_row(samples)
    use_tree_attention(model)
    logits = model(**tree_forward_kwargs(row)).logits[0]
    return logits[row.logit_index].log_softmax(-1).gather(1, row.target_ids[:, None]).squeeze(1)


def test_packed_row_matches_each_sample_alone():
    model = tiny_model().eval()
    samples = mixed_samples()
    row = pack_row(samples)
    assert row.num_tokens < sum(len(s) for s in samples)  # there is sharing to get right
    with torch.no_grad():
        expected = alone_logprobs(model, samples)
        got = packed_logprobs(model, samples)
    assert model.config._attn_implementation == TREE_ATTENTION
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_spec_example_matches_alone():
    model = tiny_model(seed=3).eval()
    samples = [seq([5, 6, 7, 20, 21], [0, 0, 0, 1, 1]), seq([5, 6, 7, 30, 31], [0, 0, 0, 1, 1])]
    with torch.no_grad():
        torch.testing.assert_close(
            packed_logprobs(model, samples), alone_logprobs(model, samples), rtol=0, atol=1e-5
        )


def grads_of(model, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradients_match_unpacked(checkpointing: bool):
    model = tiny_model(seed=1)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    samples = mixed_samples()
    weights = torch.linspace(-1.0, 1.0, sum(s.num_trained_tokens for s in samples))

    expected = grads_of(model, lambda: (alone_logprobs(model, samples) * weights).sum())
    got = grads_of(model, lambda: (packed_logprobs(model, samples) * weights).sum())
    assert set(got) == set(expected) and len(got) == len(list(model.parameters()))
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_missing_tree_mask_is_an_error():
    model = tiny_model()
    use_tree_attention(model)
    with pytest.raises(ValueError, match="tree_mask"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_flex_mask_mod_agrees_with_dense_mask_and_buckets():
    row = pack_row(mixed_samples())
    mask = TreeMask(row.tin, row.tout)
    dense = mask.dense(torch.device("cpu"))[0, 0]
    # the dense mask is each token's trie path: row i of it holds depth(i) + 1 keys
    assert torch.equal(dense.sum(-1), row.position_ids + 1)
    # the FlexAttention mask_mod, evaluated on the whole padded grid, is the dense mask plus a
    # diagonal for the padding (which no real token sees)
    length, padded = row.num_tokens, padded_length(row.num_tokens)
    tin, tout = _pad_tree(row.tin[None], row.tout[None], padded)
    grid = tree_mask_mod(tin, tout)(0, 0, torch.arange(padded)[:, None], torch.arange(padded)[None, :])
    assert torch.equal(grid[:length, :length], dense)
    assert not grid[:length, length:].any() and not grid[length:, :length].any()
    assert torch.equal(grid[length:, length:], torch.eye(padded - length, dtype=torch.bool))
    assert [padded_length(n) for n in (1, 128, 129, 1024, 1025, 1280, 1281, 5000)] == [
        128,
        128,
        256,
        1024,
        1280,
        1280,
        1536,
        5120,
    ]
    with pytest.raises(ValueError, match="backend"):
        TreeMask(row.tin, row.tout, backend="xformers")


def test_sliding_window_masks_keep_the_last_w_positions_of_each_path():
    row = pack_row(mixed_samples())
    mask = TreeMask(row.tin, row.tout, positions=row.position_ids)
    full = mask.dense(torch.device("cpu"))[0, 0]
    windowed = mask.dense(torch.device("cpu"), window=3)[0, 0]
    assert torch.equal(windowed.sum(-1), torch.clamp(row.position_ids + 1, max=3))
    assert torch.equal(windowed & full, windowed)  # never a key off the path
    # the FlexAttention mask_mod with the same window, on the padded grid
    length, padded = row.num_tokens, padded_length(row.num_tokens)
    tin, tout = _pad_tree(row.tin[None], row.tout[None], padded)
    positions = torch.nn.functional.pad(row.position_ids[None], (0, padded - length))
    grid = tree_mask_mod(tin, tout, positions, 3)(
        0, 0, torch.arange(padded)[:, None], torch.arange(padded)[None, :]
    )
    assert torch.equal(grid[:length, :length], windowed)
    assert torch.equal(grid[length:, length:], torch.eye(padded - length, dtype=torch.bool))
    with pytest.raises(ValueError, match="position ids"):
        TreeMask(row.tin, row.tout).dense(torch.device("cpu"), window=3)


def test_logits_to_keep_gives_the_same_loss():
    model = tiny_model(seed=5)
    use_tree_attention(model)
    samples = mixed_samples()
    for s in samples:
        s.sampler_top_logprobs = [{1: -1.0, 2: -2.0} if m else None for m in s.loss_mask]
        s.sampler_logprobs = [-1.5 if m else 0.0 for m in s.loss_mask]
        s.advantage = 0.5
    row = pack_row(samples, num_top_logprobs=2)
    keep, index = row.logits_to_keep()
    assert keep.numel() < row.num_tokens and torch.equal(keep[index], row.logit_index)
    config = LossConfig(temperature=0.8)
    full = packed_row_loss(
        model(**tree_forward_kwargs(row)).logits, row, config=config, num_trained_tokens=40
    )
    kept_logits = model(**tree_forward_kwargs(row), logits_to_keep=keep).logits
    assert kept_logits.shape[1] == keep.numel()
    kept = packed_row_loss(kept_logits, row, config=config, num_trained_tokens=40, logit_rows=index)
    torch.testing.assert_close(kept.loss, full.loss)
    assert kept.metrics == pytest.approx(full.metrics)
