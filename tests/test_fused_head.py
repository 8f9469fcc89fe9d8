"""The LM head fused with the loss: same values and gradients as the unfused path, and its guards."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import trainer.step.fused_head as fused_head
from trainer.rollout.types import TrainingSequence
from trainer.step.attention import tree_forward_kwargs, use_tree_attention
from trainer.step.fused_head import fused_head_weight, lm_head_bypassed
from trainer.step.loss import LossConfig, packed_row_loss, token_logprobs, token_logprobs_from_hidden
from trainer.step.packing import pack_row


def _both(chunk_bytes: int | None, monkeypatch, dtype=torch.float64, candidates: bool = True):
    """Run the fused and the unfused path on the same hidden states; return values and gradients."""
    if chunk_bytes is not None:
        monkeypatch.setattr(fused_head, "_CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(7)
    n, d, v, k = 9, 6, 13, 3
    hidden = torch.randn(n, d, generator=gen, dtype=dtype)
    weight = torch.randn(v, d, generator=gen, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    top_ids = torch.randint(0, v, (n, k), generator=gen)
    kwargs = {"temperature": 0.7, "top_ids": top_ids}
    if candidates:
        # rows 1 and 4 were sampled from candidate sets (top-k/top-p); others from the full vocabulary
        kwargs |= {
            "candidate_ids": torch.tensor([3, 5, int(targets[1]), 0, 2, int(targets[4])]),
            "candidate_token": torch.tensor([1, 1, 1, 4, 4, 4]),
            "has_candidates": torch.tensor([i in (1, 4) for i in range(n)]),
        }
    coef = torch.randn(n, k, generator=gen, dtype=torch.float32)
    results = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        if fused:
            policy = token_logprobs_from_hidden(h, w, targets, **kwargs)
        else:
            policy = token_logprobs(h @ w.T, targets, **kwargs)
        (policy.logprobs.sum() * 1.5 + (policy.top_logprobs * coef).sum()).backward()
        results.append((policy.logprobs, policy.top_logprobs, policy.entropy, h.grad, w.grad))
    return results


@pytest.mark.parametrize("chunk_bytes", [None, 2 * 13 * 4], ids=["one-chunk", "chunks-of-two-rows"])
def test_fused_matches_unfused_values_and_gradients(chunk_bytes, monkeypatch):
    unfused, fused = _both(chunk_bytes, monkeypatch)
    if chunk_bytes is not None:
        assert fused_head._chunk_rows(13, 8) == 1  # float64: one row per chunk, 9 chunks
        assert fused_head._chunk_columns(9, 8) == 1  # the backward: one vocabulary id per chunk, 13
    names = ["logprobs", "top_logprobs", "entropy", "grad hidden", "grad weight"]
    for name, a, b in zip(names, unfused, fused, strict=True):
        torch.testing.assert_close(b.double(), a.double(), rtol=1e-5, atol=1e-6, msg=name)
    # the candidate rows really were renormalised over their sets: they differ from full-vocab values
    assert (fused[0][[1, 4]] > unfused[0][[0, 2]].min()).all()
    assert fused[3].abs().sum() > 0 and fused[4].abs().sum() > 0


def test_fused_matches_unfused_in_bfloat16(monkeypatch):
    unfused, fused = _both(2 * 13 * 2, monkeypatch, dtype=torch.bfloat16, candidates=False)
    for a, b in zip(unfused[:3], fused[:3], strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(unfused[3:], fused[3:], strict=True):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a.float(), rtol=5e-2, atol=5e-2)


def _tiny_qwen3(**overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **({"tie_word_embeddings": True} | overrides),
    )
    model = Qwen3ForCausalLM(config).double()
    use_tree_attention(model)
    return model


def _row():
    tops = [None, None, {4: -0.2, 5: -2.5}, {6: -0.1, 1: -3.0}, {7: -0.4, 2: -1.0}]
    samples = [
        TrainingSequence([1, 2, 4, 6, 9], [0, 0, 1, 1, 1], [0.0, 0.0, -0.3, -0.2, -1.0], tops, advantage=1.0),
        TrainingSequence(
            [1, 2, 5, 3],
            [0, 0, 1, 1],
            [0.0, 0.0, -1.9, -0.7],
            [None, None, {5: -1.9, 4: -0.3}, {3: -0.7}],
            advantage=-1.0,
        ),
    ]
    return pack_row(samples, num_top_logprobs=2)


def test_packed_row_loss_through_the_bypassed_head_matches_the_model_head():
    """What the trainer does (bypassed head + fused loss) equals the model's own logits path."""
    model = _tiny_qwen3()
    row = _row()
    keep, logit_rows = row.logits_to_keep()
    config = LossConfig(temperature=0.8)
    grads, losses = [], []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        weight = fused_head_weight(model, torch.device("cpu")) if fused else None
        if fused:
            assert weight is model.lm_head.weight
            with lm_head_bypassed(model):
                out = model(**tree_forward_kwargs(row), logits_to_keep=keep)
            assert out.logits.shape[-1] == 32  # hidden states, not logits
        else:
            out = model(**tree_forward_kwargs(row), logits_to_keep=keep)
            assert out.logits.shape[-1] == 40
        loss = packed_row_loss(
            out.logits, row, config=config, num_trained_tokens=5, logit_rows=logit_rows, lm_head_weight=weight
        )
        loss.loss.backward()
        losses.append(loss)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert losses[1].loss.item() == pytest.approx(losses[0].loss.item(), rel=1e-6, abs=1e-9)
    assert losses[1].metrics == pytest.approx(losses[0].metrics, rel=1e-6, abs=1e-9)
    for name, g in grads[0].items():
        torch.testing.assert_close(
            grads[1][name], g, rtol=1e-5, atol=1e-8, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert model.get_output_embeddings().forward.__func__ is torch.nn.Linear.forward  # restored


def test_heads_the_fused_path_must_not_take(monkeypatch):
    cpu = torch.device("cpu")
    # logits soft-capped after the head: the probe forward sees the difference
    capped = _tiny_qwen3()
    original = type(capped).forward

    def capped_forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    monkeypatch.setattr(type(capped), "forward", capped_forward)
    assert fused_head_weight(capped, cpu) is None
    monkeypatch.undo()
    # a head with a bias
    biased = _tiny_qwen3(tie_word_embeddings=False)
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(40, dtype=torch.float64))
    assert fused_head_weight(biased, cpu) is None
    # the switch
    plain = _tiny_qwen3()
    monkeypatch.setenv("GRPO_FUSED_LM_HEAD", "0")
    assert fused_head_weight(plain, cpu) is None
    monkeypatch.delenv("GRPO_FUSED_LM_HEAD")
    assert fused_head_weight(plain, cpu) is plain.lm_head.weight
    assert plain.training  # the probe restores train mode


def test_the_chunk_setting_names_itself_when_it_is_not_a_size():
    """GRPO_FUSED_HEAD_CHUNK_MIB: MiB of logits per chunk, default 1024; a bad value names the
    variable and its default instead of a bare int() error or a zero-row chunk."""
    assert fused_head.chunk_bytes_setting({}) == 1 << 30
    assert fused_head.chunk_bytes_setting({"GRPO_FUSED_HEAD_CHUNK_MIB": "256"}) == 256 << 20
    for bad in ("0", "-4", "1.5", "big"):
        with pytest.raises(ValueError, match="GRPO_FUSED_HEAD_CHUNK_MIB=.*default 1024"):
            fused_head.chunk_bytes_setting({"GRPO_FUSED_HEAD_CHUNK_MIB": bad})


def test_the_backward_makes_no_weight_sized_tensor_but_the_gradient(monkeypatch):
    """Issue 32: the head's backward held, beside the weight gradient, an fp32 (V, D) accumulator and a
    (V, D) partial per chunk (1.7 GiB at Qwen3's vocabulary: the step's peak). Chunked over the
    vocabulary, each chunk writes its slice of the gradient in place: the only (V, D)-sized tensor the
    backward makes is the gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, d, v = 40, 32, 64  # a chunk's logits (40 x 16) and the hidden states are smaller than (V, D)
    monkeypatch.setattr(fused_head, "_CHUNK_BYTES", n * 16 * 4)  # 16 vocabulary ids per chunk: 4 chunks
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, d, generator=gen).requires_grad_(True)
    weight = torch.randn(v, d, generator=gen).requires_grad_(True)
    pick_row = torch.arange(n).repeat_interleave(2)
    pick_id = torch.randint(0, v, (2 * n,), generator=gen)
    lse, picked, _ = fused_head.fused_head_logits(hidden, weight, pick_row, pick_id, temperature=0.9)

    class WeightSized(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made: dict[int, tuple[str, torch.dtype]] = {}  # by storage: views are not new

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() >= v * d:
                    self.made.setdefault(t.untyped_storage().data_ptr(), (str(func), t.dtype))
            return out

    with WeightSized() as mode:
        (lse.sum() + (picked * torch.linspace(-1, 1, 2 * n)).sum()).backward()
    assert len(mode.made) == 1, mode.made  # the gradient (torch.empty), its 4 slices written in place
    # and the values: as the logits' own autograd gives them
    h2, w2 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    z = (h2 @ w2.T) / 0.9
    (torch.logsumexp(z, -1).sum() + (z[pick_row, pick_id] * torch.linspace(-1, 1, 2 * n)).sum()).backward()
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-4, atol=1e-5)
