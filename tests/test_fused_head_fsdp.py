"""The fused LM head's FSDP2 path of :func:`trainer.step.fused_head.fused_lm_head`, in one process.

The real FSDP2 runs (gloo, one and two processes) are in ``tests/test_bench_fsdp.py``. Here the
model is plain and only declared FSDP2-managed, to test the choice made on the watched forward that
replaces the probe: fused after one forward when the logits are the head's output, unfused for
good when something follows the head, and the same loss and gradients as the model's own head.
"""

from __future__ import annotations

import pytest
import torch

import trainer.step.fused_head as fused_head
from tests.test_fused_head import _tiny_qwen3
from trainer.rollout.types import TrainingSequence
from trainer.step.attention import tree_forward_kwargs
from trainer.step.fused_head import fused_lm_head
from trainer.step.loss import LossConfig, packed_row_loss
from trainer.step.packing import PackedRow, pack_row

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fsdp2_managed(monkeypatch):
    monkeypatch.setattr(fused_head, "_fsdp2_managed", lambda model, head: True)


def _model():
    """A float64 two-layer Qwen3 (vocabulary 40, hidden 32) with tied embeddings, tree attention."""
    return _tiny_qwen3()


def _row() -> PackedRow:
    tops = [None, None, {4: -0.2, 5: -2.5}, {6: -0.1, 1: -3.0}]
    sample = TrainingSequence([1, 2, 4, 6], [0, 0, 1, 1], [0.0, 0.0, -0.3, -0.2], tops, advantage=1.0)
    return pack_row([sample], num_top_logprobs=2)


def _step(model: torch.nn.Module, row: PackedRow) -> tuple[str, float, dict[str, torch.Tensor]]:
    """One trainer step's forward + backward through :func:`fused_lm_head`: (head, loss, gradients)."""
    model.zero_grad(set_to_none=True)
    keep, logit_rows = row.logits_to_keep()
    with fused_lm_head(model, CPU) as head:
        out = model(**tree_forward_kwargs(row), logits_to_keep=keep)
    loss = packed_row_loss(
        out.logits,
        row,
        config=LossConfig(),
        num_trained_tokens=2,
        logit_rows=logit_rows,
        lm_head_weight=head.weight,
    ).loss
    loss.backward()
    return head.name, float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_first_forward_is_watched_then_fused_with_the_same_loss_and_gradients():
    model, row = _model(), _row()
    head, loss, grads = _step(model, row)
    assert head == "model"  # the watched forward: the model's own head
    assert getattr(model, fused_head._WATCHED) is True
    head, fused_loss, fused_grads = _step(model, row)
    assert head == "fused"
    assert fused_loss == pytest.approx(loss, rel=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-10, atol=1e-14, msg=name)


def _capped(model: torch.nn.Module, in_place: bool) -> torch.nn.Module:
    original = type(model).forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if in_place:
            out.logits.mul_(0.5)
        else:
            out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    model.forward = forward.__get__(model)
    return model


@pytest.mark.parametrize("in_place", [False, True], ids=["soft-capped", "scaled-in-place"])
def test_logits_changed_after_the_head_keep_the_model_head(in_place):
    model, row = _capped(_model(), in_place), _row()
    assert [_step(model, row)[0] for _ in range(2)] == ["model", "model"]
    assert getattr(model, fused_head._WATCHED) is False


def test_probe_verdict_from_before_wrapping_is_kept():
    model = _model()
    setattr(model, fused_head._PROBED, False)
    assert _step(model, _row())[0] == "model"
    assert getattr(model, fused_head._WATCHED, None) is None  # nothing to watch
