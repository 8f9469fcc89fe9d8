"""The policy loss against hand-computed values and the spec's gradient formula."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.rollout.types import TrainingSequence
from trainer.step.loss import LossConfig, TokenLogprobs, grpo_loss, packed_row_loss, token_logprobs
from trainer.step.packing import pack_row

CLIPPED = LossConfig(
    score_centering=False, epsilon_low=0.2, epsilon_high=0.28, is_clip_min=0.5, is_clip_max=5.0
)
CENTERED = LossConfig(
    score_centering=True, epsilon_low=0.2, epsilon_high=0.28, is_clip_min=0.5, is_clip_max=5.0
)


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_clipped_surrogate_hand_values():
    ratios = [1.5, 1.0, 0.7, 0.3, 0.9]
    sampler = torch.tensor([-1.0, -0.5, -2.0, -0.2, -1.5])
    logp = leaf((sampler + torch.log(torch.tensor(ratios))).tolist())
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5])
    sample = torch.tensor([0, 0, 2, 2, 5])  # samples 1, 3, 4 have no trained token here
    policy = TokenLogprobs(logprobs=logp, top_logprobs=torch.zeros(5, 0), entropy=torch.full((5,), 0.7))
    out = grpo_loss(
        policy, sampler, adv, sample, config=CLIPPED, num_trained_tokens=10, gradient_accumulation_steps=2
    )
    # t0: clipped high, -1.28; t1: -1; t2: A<0 and r<0.8, -min(-0.35, -0.4) = 0.4; t3: r<0.5 masked; t4: 0.45
    assert out.loss.item() == pytest.approx((-1.28 - 1.0 + 0.4 + 0.0 + 0.45) / 20, abs=1e-6)
    out.loss.backward()
    # d/dlogp of -r A is -r A where neither the clip nor the IS mask binds, else 0
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -1.0, 0.0, 0.0, 0.45]) / 20)

    m = out.metrics
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.3, rel=1e-5)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(1.5, rel=1e-5)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(ratios) / 5, rel=1e-5)
    assert m["sampling/masked_mean"] == pytest.approx(1 / 5)
    diffs = [abs(math.log(r)) for r in ratios]
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(diffs) / 5, rel=1e-5)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(max(diffs), rel=1e-5)
    assert m["entropy"] == pytest.approx(0.7)
    # clipped objective: low = r < 0.8 with A < 0 (t2, t3), high = r > 1.28 with A > 0 (t0)
    assert m["clip_ratio/low_mean"] == pytest.approx(2 / 5)
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert m["clip_ratio/region_mean"] == pytest.approx(3 / 5)
    assert m["clip_ratio/low_min"] == pytest.approx(0.0)  # samples 0 and 2 have no low-clipped token
    assert m["clip_ratio/high_max"] == pytest.approx(1 / 2)  # sample 0: one of two
    assert "sampling/sampler_mass" not in m


def test_score_centering_hand_values():
    # Uniform policy over 4 tokens: pi = 0.25 everywhere. Sampled token 0 with mu = 0.25 (r = 1).
    # Sampler top-3: mu(0) = 0.5 (r = 0.5, kept: the bounds are inclusive), mu(1) = 0.25 (r = 1),
    # mu(2) = 0.04 (r = 6.25 > 5: f = 0). Centring baseline = pi(0) + pi(1) = 0.5.
    logits = torch.zeros(1, 4, requires_grad=True)
    top_ids = torch.tensor([[0, 1, 2]])
    policy = token_logprobs(logits, torch.tensor([0]), top_ids=top_ids)
    sampler_top = torch.log(torch.tensor([[0.5, 0.25, 0.04]]))
    out = grpo_loss(
        policy,
        torch.log(torch.tensor([0.25])),
        torch.tensor([2.0]),
        torch.tensor([0]),
        config=CENTERED,
        num_trained_tokens=4,
        sampler_top_logprobs=sampler_top,
    )
    assert out.loss.item() == pytest.approx(-2.0 * (1.0 - 0.5) / 4)
    m = out.metrics
    assert m["sampling/sampler_mass"] == pytest.approx(0.79)
    assert m["entropy"] == pytest.approx(math.log(4))
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0)
    assert m["sampling/masked_mean"] == 0.0
    # score centering has no clip: clip_ratio counts ratios outside [1 - 0.2, 1 + 0.28], here none
    assert m["clip_ratio/region_mean"] == 0.0


def expected_centered_grad(logits, targets, sampler_lp, adv, top_ids, top_mu_lp, temperature, lo, hi, denom):
    """The spec's estimator written out: -A (f(r_t) dlogpi(o_t) - sum_v mu(v) f(r_v) dlogpi(v)) / denom,
    with d log pi(v) / d logits = (onehot(v) - softmax(logits / T)) / T."""
    grad = torch.zeros_like(logits)
    p = torch.softmax(logits / temperature, dim=-1)
    eye = torch.eye(logits.shape[1])

    def f(r: float) -> float:
        return r if lo <= r <= hi else 0.0

    for t in range(logits.shape[0]):
        dlogpi = (eye - p[t]) / temperature  # row v: d log pi(v) / d logits[t]
        r_t = float(p[t, targets[t]] / math.exp(sampler_lp[t]))
        g = f(r_t) * dlogpi[targets[t]]
        for v, mu_lp in zip(top_ids[t], top_mu_lp[t], strict=True):
            if mu_lp == -math.inf:
                continue  # padding
            mu = math.exp(mu_lp)
            g = g - mu * f(float(p[t, v]) / mu) * dlogpi[v]
        grad[t] = -adv[t] * g / denom
    return grad


def test_score_centering_gradient_equals_the_spec_formula():
    torch.manual_seed(0)
    vocab, temperature = 7, 0.7
    logits = torch.randn(4, vocab, requires_grad=True)
    targets = [1, 3, 0, 6]
    top_ids = [[1, 2, 4], [3, 0, 5], [2, 0, 1], [6, 5, 0]]
    with torch.no_grad():
        p = torch.softmax(logits / temperature, dim=-1)
    # sampler probabilities: near the policy for most ids, far for a few (ratio outside [0.5, 5]);
    # tokens 1 and 2 have their sampled token masked (the centring term stays); token 3 has a padded slot.
    mu_scale = [[1.1, 0.9, 1.0], [0.15, 1.2, 0.8], [1.0, 1.3, 0.9], [1.05, 0.7, 1.0]]
    top_mu_lp = [
        [math.log(float(p[t, v]) * s) for v, s in zip(ids, mu_scale[t], strict=True)]
        for t, ids in enumerate(top_ids)
    ]
    top_mu_lp[3][2] = -math.inf
    sampler_lp = [top_mu_lp[0][0], top_mu_lp[1][0], math.log(float(p[2, 0]) * 12.0), top_mu_lp[3][0]]
    adv = [1.5, 1.5, -0.7, 0.4]

    policy = token_logprobs(
        logits,
        torch.tensor(targets),
        temperature=temperature,
        top_ids=torch.tensor([[*ids] for ids in top_ids]),
    )
    out = grpo_loss(
        policy,
        torch.tensor(sampler_lp),
        torch.tensor(adv),
        torch.tensor([0, 0, 1, 2]),
        config=CENTERED,
        num_trained_tokens=6,
        gradient_accumulation_steps=3,
        sampler_top_logprobs=torch.tensor(top_mu_lp),
    )
    out.loss.backward()
    expected = expected_centered_grad(
        logits.detach(), targets, sampler_lp, adv, top_ids, top_mu_lp, temperature, 0.5, 5.0, denom=6 * 3
    )
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-7)
    # masked: token 1 (r = 1 / 0.15 > 5) and token 2 (r = 1 / 12 < 0.5)
    assert out.metrics["sampling/masked_mean"] == pytest.approx(2 / 4)
    mass = [sum(math.exp(x) for x in row if x > -math.inf) for row in top_mu_lp]
    assert out.metrics["sampling/sampler_mass"] == pytest.approx(sum(mass) / 4, rel=1e-5)


def test_candidate_sets_renormalise_logprobs():
    torch.manual_seed(1)
    logits = torch.randn(2, 6, requires_grad=True)
    targets = torch.tensor([2, 4])
    top_ids = torch.tensor([[2, 3], [4, 0]])
    # token 0 was sampled from {1, 2, 3}; token 1 from the full vocabulary
    policy = token_logprobs(
        logits,
        targets,
        temperature=2.0,
        top_ids=top_ids,
        candidate_ids=torch.tensor([1, 2, 3]),
        candidate_token=torch.tensor([0, 0, 0]),
        has_candidates=torch.tensor([True, False]),
    )
    z = logits.detach() / 2.0
    restricted = z[0, [1, 2, 3]].log_softmax(-1)
    full = z[1].log_softmax(-1)
    torch.testing.assert_close(policy.logprobs.detach(), torch.stack([restricted[1], full[4]]))
    torch.testing.assert_close(policy.top_logprobs.detach(), torch.stack([restricted[1:], full[[4, 0]]]))
    # entropy is the full-vocabulary one at the sampling temperature
    full_entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(policy.entropy, full_entropy)
    policy.logprobs[0].backward()
    assert logits.grad[0, [0, 4, 5]].abs().max() == 0  # outside the candidate set: no gradient
    assert logits.grad[0, [1, 2, 3]].abs().min() > 0


def test_normalisation_by_global_trained_tokens_and_accumulation():
    # Two processes each holding part of a micro-batch: with the global count, the summed losses
    # (what gradient all-reduce adds up) equal one process holding all tokens.
    sampler = torch.tensor([-1.0, -0.7, -0.3, -2.0, -1.2])
    logp = sampler + torch.tensor([0.1, -0.05, 0.0, 0.2, -0.1])
    adv = torch.tensor([1.0, 1.0, -1.0, 0.5, 0.5])
    idx = torch.tensor([0, 0, 1, 2, 2])

    def loss(sl: slice, num: int, ga: int) -> torch.Tensor:
        lp = logp[sl].clone().requires_grad_(True)
        policy = TokenLogprobs(lp, torch.zeros(lp.shape[0], 0), torch.zeros(lp.shape[0]))
        return grpo_loss(
            policy,
            sampler[sl],
            adv[sl],
            idx[sl],
            config=CLIPPED,
            num_trained_tokens=num,
            gradient_accumulation_steps=ga,
        ).loss

    whole = loss(slice(0, 5), 5, 1)
    split = loss(slice(0, 2), 5, 1) + loss(slice(2, 5), 5, 1)
    assert split.item() == pytest.approx(whole.item())
    per_token = -(torch.exp(logp - sampler) * adv)  # no clip binds here
    assert whole.item() == pytest.approx(per_token.sum().item() / 5)
    assert loss(slice(0, 5), 5, 4).item() == pytest.approx(whole.item() / 4)


def test_masked_ratios_overflow_without_nan():
    logp = leaf([0.0, -1.0])
    sampler = torch.tensor([-500.0, -1.0])  # ratio e^500 overflows to inf
    for config in (CLIPPED, CENTERED):
        logp.grad = None
        policy = TokenLogprobs(logp, torch.zeros(2, 1), torch.zeros(2))
        top = torch.tensor([[-500.0], [-1.0]])
        out = grpo_loss(
            policy,
            sampler,
            torch.tensor([1.0, 1.0]),
            torch.tensor([0, 1]),
            config=config,
            num_trained_tokens=2,
            sampler_top_logprobs=top,
        )
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
        assert logp.grad[0] == 0  # the out-of-range token carries no gradient
        assert out.metrics["sampling/masked_mean"] == 0.5


def test_packed_row_loss_end_to_end():
    tops = [None, None, {4: -0.2, 5: -2.5}, {6: -0.1, 1: -3.0}]
    samples = [
        TrainingSequence([1, 2, 4, 6], [0, 0, 1, 1], [0.0, 0.0, -0.3, -0.2], tops, advantage=1.0),
        TrainingSequence(
            [1, 2, 5], [0, 0, 1], [0.0, 0.0, -1.9], [None, None, {5: -1.9, 4: -0.3}], advantage=-1.0
        ),
    ]
    row = pack_row(samples, num_top_logprobs=2)
    torch.manual_seed(2)
    logits = torch.randn(1, row.num_tokens, 8, requires_grad=True)
    config = LossConfig(temperature=0.9)
    out = packed_row_loss(logits, row, config=config, num_trained_tokens=3)
    # the same thing assembled by hand from the row's gather indices
    rows = logits[0, row.logit_index]
    policy = token_logprobs(rows, row.target_ids, temperature=0.9, top_ids=row.top_ids)
    ref = grpo_loss(
        policy,
        row.sampler_logprobs,
        row.advantages,
        row.sample_index,
        config=config,
        num_trained_tokens=3,
        sampler_top_logprobs=row.top_logprobs,
    )
    assert row.logit_index.tolist() == [1, 2, 4]  # 2 is copied: it predicts 4 for one and 5 for the other
    assert out.loss.item() == pytest.approx(ref.loss.item())
    assert out.metrics == pytest.approx(ref.metrics)
    out.loss.backward()
    assert logits.grad[0, row.logit_index].abs().sum() > 0
    assert logits.grad[0, 3].abs().sum() == 0  # the last token predicts nothing trained


def test_from_args_and_missing_top_logprobs():
    from trainer.config.async_grpo_config import AsyncGRPOConfig

    args = AsyncGRPOConfig(
        output_dir="/tmp/unused", epsilon=0.1, epsilon_high=0.3, temperature=0.8, use_cpu=True, bf16=False
    )
    cfg = LossConfig.from_args(args)
    assert (cfg.epsilon_low, cfg.epsilon_high, cfg.temperature, cfg.is_clip_min, cfg.is_clip_max) == (
        0.1,
        0.3,
        0.8,
        0.5,
        5.0,
    )
    policy = TokenLogprobs(leaf([0.0]), torch.zeros(1, 0), torch.zeros(1))
    with pytest.raises(ValueError, match="top logprobs"):
        grpo_loss(
            policy,
            torch.zeros(1),
            torch.ones(1),
            torch.zeros(1, dtype=torch.long),
            config=CENTERED,
            num_trained_tokens=1,
        )


def test_chunked_normaliser_matches_one_chunk(monkeypatch):
    import trainer.step.loss as loss_module

    torch.manual_seed(4)
    logits = torch.randn(7, 11, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    top_ids = torch.randint(0, 11, (7, 3))

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits.grad = None
        policy = token_logprobs(logits, targets, temperature=1.3, top_ids=top_ids)
        (policy.logprobs.sum() + 0.5 * policy.top_logprobs.sum()).backward()
        return policy.logprobs.detach(), policy.entropy, logits.grad.clone()

    whole = run()
    monkeypatch.setattr(loss_module, "_CHUNK_BYTES", 4 * 11 * 2)  # two rows per chunk: 4 chunks
    assert loss_module._chunk_rows(11) == 2
    chunked = run()
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b)
    ref = (logits.detach() / 1.3).log_softmax(-1)
    torch.testing.assert_close(whole[0], ref.gather(1, targets[:, None]).squeeze(1))
