"""The policy loss: score centering (default) or the clipped surrogate, both with masked importance sampling.

Per trained token t (``N`` of them in a micro-batch row) with advantage A, policy log-probability
``logp`` and sampler log-probability ``mu_logp``, the importance ratio is ``r = exp(logp - mu_logp)``;
``f(r) = r`` inside ``[C_min, C_max]`` and 0 outside (masked importance sampling).

Score centering: the loss's gradient is the spec's estimator

    grad L = -A * ( f(r_t) grad log pi(o_t) - sum_{v in topK} mu(v) f(r_v) grad log pi(v) )

with the inner sum over the sampler's ``num_sampler_logprobs`` most likely tokens at that position.
Using ``r grad log pi = grad r`` and ``mu(v) r_v = pi(v)``, the per-token surrogate is

    l_t = -A * ( m_t r_t - sum_v m_v pi(v) ),     m = 1[C_min <= r <= C_max] (no gradient)

whose value is the centred masked ratio (about 0 on-policy) and whose gradient is exactly the
estimator. ``mu(v)`` is *not* renormalised over the K tokens: the sum is the top-K part of the exact
expectation ``E_{v~mu}[f(r_v) grad log pi(v)]`` (the tail is the part left uncentred), and
``sampling/sampler_mass`` reports how much of ``mu`` the K tokens cover. The centring term applies
also where the sampled token itself is masked: it is the expectation of the first term over all
tokens, masked ones included (their ``f`` is 0), so dropping it would bias the estimator.

Clipped surrogate (``score_centering=False``): ``l_t = -m_t min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``.

Both are summed over the micro-batch's trained tokens and divided by the number of trained tokens of
the micro-batch summed over all processes, then by ``gradient_accumulation_steps``. The caller
all-reduces that count. Where data-parallel training averages gradients over processes (DDP, FSDP),
the caller also multiplies the loss by the number of processes so the result is the spec's sum.

Top-k / top-p: when a trained token was sampled from a candidate set, its policy log-probabilities
(of the sampled token and of the sampler's top tokens) are renormalised over that set, as the
server's processed logprobs are. The ``entropy`` metric is that of the full-vocabulary distribution
at the sampling temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from trainer.reporting.metrics import (
    CLIP_RATIO_HIGH_MAX,
    CLIP_RATIO_HIGH_MEAN,
    CLIP_RATIO_LOW_MEAN,
    CLIP_RATIO_LOW_MIN,
    CLIP_RATIO_REGION_MEAN,
    ENTROPY,
    SAMPLING_IS_RATIO_MAX,
    SAMPLING_IS_RATIO_MEAN,
    SAMPLING_IS_RATIO_MIN,
    SAMPLING_LOGP_DIFF_MAX,
    SAMPLING_LOGP_DIFF_MEAN,
    SAMPLING_MASKED_MEAN,
    SAMPLING_SAMPLER_MASS,
)
from trainer.step.fused_head import fused_head_logits


@dataclass(frozen=True)
class LossConfig:
    """The loss's hyper-parameters (spec names in :meth:`from_args`)."""

    score_centering: bool = True
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    is_clip_min: float = 0.5
    is_clip_max: float = 5.0
    temperature: float = 1.0

    @classmethod
    def from_args(cls, args) -> LossConfig:
        """From an :class:`trainer.config.async_grpo_config.AsyncGRPOConfig`."""
        eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        return cls(
            score_centering=args.score_centering,
            epsilon_low=args.epsilon,
            epsilon_high=eps_high,
            is_clip_min=args.vllm_importance_sampling_clip_min,
            is_clip_max=args.vllm_importance_sampling_clip_max,
            temperature=args.temperature,
        )


@dataclass
class TokenLogprobs:
    """The policy's view of the trained tokens.

    Attributes:
        logprobs: (N,) log pi(o_t) of each trained token (nats), differentiable.
        top_logprobs: (N, K) log pi(v) of the sampler's top-K ids, differentiable; K may be 0.
        entropy: (N,) entropy of the full-vocabulary distribution at each position (nats), no grad.
    """

    logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    entropy: torch.Tensor


@dataclass
class LossOutput:
    """``loss``: scalar to backpropagate; ``metrics``: this micro-batch's metric values (spec names)."""

    loss: torch.Tensor
    metrics: dict[str, float]


# Rows of fp32 (tempered) logits materialised at once: about this many bytes.
_CHUNK_BYTES = 1 << 30


def _chunk_rows(vocab: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * vocab))


def _grouped_logsumexp(vals: torch.Tensor, group: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) log-sum-exp of the (M,) ``vals`` of each group ``group`` (M,) in [0, n); -inf for an empty group."""
    peak = torch.full((n,), float("-inf"), device=vals.device, dtype=vals.dtype)
    peak = peak.scatter_reduce(0, group, vals.detach(), reduce="amax")
    safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.zeros_like(peak).index_add(0, group, torch.exp(vals - safe_peak[group]))
    return torch.log(total) + safe_peak


def _tempered_logsumexp(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.logsumexp(rows.float() / temperature, dim=-1)


def _rows_logsumexp(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(N,) log-sum-exp of ``logits / temperature`` (N, V), in row chunks.

    Under autograd each chunk is checkpointed: its fp32 copy is freed after the forward and rebuilt
    in the backward, so no (N, V) fp32 tensor is kept alive (the backward of a plain logsumexp would
    keep its whole input).
    """
    chunks = logits.split(_chunk_rows(logits.shape[-1]))
    if torch.is_grad_enabled() and logits.requires_grad:
        parts = [
            torch.utils.checkpoint.checkpoint(_tempered_logsumexp, c, temperature, use_reentrant=False)
            for c in chunks
        ]
    else:
        parts = [_tempered_logsumexp(c, temperature) for c in chunks]
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


@torch.no_grad()
def _entropy(logits: torch.Tensor, lse: torch.Tensor, temperature: float) -> torch.Tensor:
    """(N,) entropy of softmax(logits / temperature) given its log-sum-exp, in row chunks."""
    out = torch.empty_like(lse)
    step = _chunk_rows(logits.shape[-1])
    for start in range(0, logits.shape[0], step):
        z = logits[start : start + step].float() / temperature
        lc = lse[start : start + step]
        out[start : start + step] = lc - (torch.exp(z - lc[:, None]) * z).sum(-1)
    return out


def token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_ids: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    candidate_token: torch.Tensor | None = None,
    has_candidates: torch.Tensor | None = None,
) -> TokenLogprobs:
    """Policy log-probabilities at the trained positions.

    Args:
        logits: (N, V) the logits that predict each trained token (rows gathered from the packed
            forward, e.g. ``logits[0, row.logit_index]``; any float dtype).
        target_ids: (N,) the trained token ids.
        temperature: the sampler's temperature; logits are divided by it before normalising.
        top_ids: (N, K) the sampler's top ids per position (padding ids are harmless).
        candidate_ids, candidate_token, has_candidates: top-k/top-p candidate sets in the packed
            layout of :class:`trainer.step.packing.PackedRow` ((M,), (M,), (N,)); None = full vocabulary.

    Memory: no full log-softmax and no (N, V) fp32 copy is kept; the normaliser is a chunked,
    checkpointed log-sum-exp (about ``_CHUNK_BYTES`` of fp32 at a time) and the needed entries are
    gathered from ``logits`` directly.
    """
    full_lse = _rows_logsumexp(logits, temperature)
    n = logits.shape[0]
    if top_ids is None:
        top_ids = torch.zeros((n, 0), dtype=torch.long, device=logits.device)
    has_cand = candidate_ids is not None and candidate_ids.numel() > 0
    return _assemble(
        full_lse,
        logits.gather(1, target_ids[:, None]).squeeze(1).float() / temperature,
        logits.gather(1, top_ids).float() / temperature,
        _entropy(logits.detach(), full_lse.detach(), temperature),
        cand_vals=logits[candidate_token, candidate_ids].float() / temperature if has_cand else None,
        candidate_token=candidate_token,
        has_candidates=has_candidates,
    )


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_ids: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    candidate_token: torch.Tensor | None = None,
    has_candidates: torch.Tensor | None = None,
) -> TokenLogprobs:
    """:func:`token_logprobs` of the logits ``hidden @ weight.T``, never materialised whole.

    Args:
        hidden: (N, D) the LM head's input at the positions predicting the trained tokens.
        weight: (V, D) the LM head's weight (a bias-free linear head).
        Others: as :func:`token_logprobs`.

    The head runs in chunks fused with the reads (:mod:`trainer.step.fused_head`); values and gradients
    are those of :func:`token_logprobs` on the full logits.
    """
    n = hidden.shape[0]
    device = hidden.device
    if top_ids is None:
        top_ids = torch.zeros((n, 0), dtype=torch.long, device=device)
    k = top_ids.shape[1]
    has_cand = candidate_ids is not None and candidate_ids.numel() > 0
    rows = torch.arange(n, device=device)
    pick_row = [rows, rows.repeat_interleave(k)]
    pick_id = [target_ids, top_ids.reshape(-1)]
    if has_cand:
        pick_row.append(candidate_token)
        pick_id.append(candidate_ids)
    full_lse, picked, entropy = fused_head_logits(
        hidden, weight, torch.cat(pick_row), torch.cat(pick_id), temperature=temperature
    )
    return _assemble(
        full_lse,
        picked[:n],
        picked[n : n + n * k].view(n, k),
        entropy,
        cand_vals=picked[n + n * k :] if has_cand else None,
        candidate_token=candidate_token,
        has_candidates=has_candidates,
    )


def _assemble(
    full_lse: torch.Tensor,
    target_vals: torch.Tensor,
    top_vals: torch.Tensor,
    entropy: torch.Tensor,
    *,
    cand_vals: torch.Tensor | None,
    candidate_token: torch.Tensor | None,
    has_candidates: torch.Tensor | None,
) -> TokenLogprobs:
    """Log-probabilities from tempered logits: (N,) normaliser, (N,) targets, (N, K) top ids, (M,) candidates.

    Where a token was sampled from a candidate set (top-k/top-p), it is normalised over that set.
    """
    lse = full_lse
    if cand_vals is not None:
        cand_lse = _grouped_logsumexp(cand_vals, candidate_token, full_lse.shape[0])
        lse = torch.where(has_candidates, cand_lse, full_lse)
    return TokenLogprobs(logprobs=target_vals - lse, top_logprobs=top_vals - lse[:, None], entropy=entropy)


def _masked_ratio(log_ratio: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f(r), inside)``: r where lo <= r <= hi else 0 (differentiable inside), and the mask.

    The exponent is taken only where the ratio is kept, so an overflowing ratio outside the range
    cannot turn the zero gradient into NaN.
    """
    with torch.no_grad():
        r = torch.exp(log_ratio)
        inside = (r >= lo) & (r <= hi)
    safe = torch.where(inside, log_ratio, torch.zeros_like(log_ratio))
    return torch.where(inside, torch.exp(safe), torch.zeros_like(safe)), inside


def _per_sample_fraction(flags: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """(S,) fraction of each sample's trained tokens where ``flags`` holds, for the S samples present."""
    _, inverse, counts = torch.unique(sample_index, return_inverse=True, return_counts=True)
    hits = torch.zeros(counts.shape[0], device=flags.device).index_add(0, inverse, flags.float())
    return hits / counts


def grpo_loss(
    policy: TokenLogprobs,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    *,
    config: LossConfig,
    num_trained_tokens: float,
    gradient_accumulation_steps: int = 1,
    sampler_top_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """The micro-batch loss and its metrics.

    Args:
        policy: from :func:`token_logprobs` (N trained tokens).
        sampler_logprobs: (N,) sampler log-probability of each trained token.
        advantages: (N,) advantage of each token's sample.
        sample_index: (N,) sample of each token (for the per-completion clip fractions).
        config: the loss hyper-parameters.
        num_trained_tokens: trained tokens of this micro-batch summed over all processes.
        gradient_accumulation_steps: micro-batches per optimizer step.
        sampler_top_logprobs: (N, K) sampler log-probabilities of ``policy.top_logprobs``' ids
            (-inf = padding); required when ``config.score_centering``.
    """
    logp = policy.logprobs
    device = logp.device
    sampler_logprobs = sampler_logprobs.to(device=device, dtype=torch.float32)
    advantages = advantages.to(device=device, dtype=torch.float32)
    log_ratio = logp - sampler_logprobs
    f_t, inside = _masked_ratio(log_ratio, config.is_clip_min, config.is_clip_max)

    if config.score_centering:
        if sampler_top_logprobs is None:
            raise ValueError("score_centering needs the sampler's top logprobs (num_sampler_logprobs >= 1)")
        mu_logp = sampler_top_logprobs.to(device=device, dtype=torch.float32)
        valid = torch.isfinite(mu_logp)
        # m_v * pi(v) = mu(v) f(r_v): pi(v) = exp(log pi(v)), kept where r_v is inside the range.
        with torch.no_grad():
            r_v = torch.exp(
                torch.where(valid, policy.top_logprobs - mu_logp, torch.full_like(mu_logp, math.inf))
            )
            keep_v = valid & (r_v >= config.is_clip_min) & (r_v <= config.is_clip_max)
        safe_top = torch.where(keep_v, policy.top_logprobs, torch.zeros_like(policy.top_logprobs))
        baseline = torch.where(keep_v, torch.exp(safe_top), torch.zeros_like(safe_top)).sum(-1)
        per_token = -advantages * (f_t - baseline)
    else:
        r = f_t  # 0 where masked; the mask below removes those terms entirely
        clipped = torch.clamp(r, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
        per_token = -torch.where(
            inside, torch.minimum(r * advantages, clipped * advantages), torch.zeros_like(r)
        )

    denom = max(float(num_trained_tokens), 1.0) * gradient_accumulation_steps
    loss = per_token.sum() / denom
    metrics = _metrics(
        policy, sampler_logprobs, advantages, sample_index, log_ratio, inside, config, sampler_top_logprobs
    )
    return LossOutput(loss=loss, metrics=metrics)


@torch.no_grad()
def _metrics(
    policy: TokenLogprobs,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    log_ratio: torch.Tensor,
    inside: torch.Tensor,
    config: LossConfig,
    sampler_top_logprobs: torch.Tensor | None,
) -> dict[str, float]:
    """The spec's sampling/*, entropy and clip_ratio/* values of one micro-batch (empty if N = 0)."""
    if log_ratio.numel() == 0:
        return {}
    diff = (policy.logprobs.detach() - sampler_logprobs).abs()
    ratio = torch.exp(log_ratio.detach())
    low = ratio < 1.0 - config.epsilon_low
    high = ratio > 1.0 + config.epsilon_high
    if not config.score_centering:
        # The clipped objective only clips where the clip binds: low side for A < 0, high for A > 0.
        low = low & (advantages < 0)
        high = high & (advantages > 0)
    sample_index = sample_index.to(ratio.device)
    values = {
        SAMPLING_LOGP_DIFF_MEAN: diff.mean(),
        SAMPLING_LOGP_DIFF_MAX: diff.max(),
        SAMPLING_IS_RATIO_MIN: ratio.min(),
        SAMPLING_IS_RATIO_MEAN: ratio.mean(),
        SAMPLING_IS_RATIO_MAX: ratio.max(),
        SAMPLING_MASKED_MEAN: (~inside).float().mean(),
        ENTROPY: policy.entropy.mean(),
        CLIP_RATIO_REGION_MEAN: (low | high).float().mean(),
        CLIP_RATIO_LOW_MEAN: low.float().mean(),
        CLIP_RATIO_LOW_MIN: _per_sample_fraction(low, sample_index).min(),
        CLIP_RATIO_HIGH_MEAN: high.float().mean(),
        CLIP_RATIO_HIGH_MAX: _per_sample_fraction(high, sample_index).max(),
    }
    if config.score_centering and sampler_top_logprobs is not None:
        mu = torch.exp(sampler_top_logprobs.to(ratio.device).float())  # exp(-inf) = 0 for padding
        values[SAMPLING_SAMPLER_MASS] = mu.sum(-1).mean()
    # one device-to-host transfer for all of them
    host = torch.stack([v.float() for v in values.values()]).tolist()
    return dict(zip(values, host, strict=True))


def packed_row_loss(
    logits: torch.Tensor,
    row,
    *,
    config: LossConfig,
    num_trained_tokens: float,
    gradient_accumulation_steps: int = 1,
    logit_rows: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
) -> LossOutput:
    """:func:`grpo_loss` of one :class:`trainer.step.packing.PackedRow` from the row's logits.

    Args:
        logits: (L, V) or (1, L, V) logits of the packed forward, or (R, V) / (1, R, V) when the
            forward kept only some rows (``logits_to_keep``).
        row: the packed row (tensors on the logits' device or CPU).
        logit_rows: (N,) row of ``logits`` predicting each trained token; default ``row.logit_index``
            (pass the second value of :meth:`PackedRow.logits_to_keep` with kept logits).
        lm_head_weight: (V, D) when given, ``logits`` are the LM head's *inputs* (hidden states,
            (..., D)) and the head runs fused with the loss (:func:`token_logprobs_from_hidden`).
    """
    if logits.dim() == 3:
        logits = logits[0]
    device = logits.device
    index = row.logit_index if logit_rows is None else logit_rows
    rows = logits[index.to(device)]
    cand = row.candidate_ids is not None
    head = token_logprobs if lm_head_weight is None else _with_weight(lm_head_weight)
    policy = head(
        rows,
        row.target_ids.to(device),
        temperature=config.temperature,
        top_ids=row.top_ids.to(device) if config.score_centering else None,
        candidate_ids=row.candidate_ids.to(device) if cand else None,
        candidate_token=row.candidate_token.to(device) if cand else None,
        has_candidates=row.has_candidates.to(device) if cand else None,
    )
    return grpo_loss(
        policy,
        row.sampler_logprobs,
        row.advantages,
        row.sample_index,
        config=config,
        num_trained_tokens=num_trained_tokens,
        gradient_accumulation_steps=gradient_accumulation_steps,
        sampler_top_logprobs=row.top_logprobs if config.score_centering else None,
    )


def _with_weight(weight: torch.Tensor):
    """:func:`token_logprobs_from_hidden` with the head's weight bound (same call shape as token_logprobs)."""

    def head(hidden: torch.Tensor, target_ids: torch.Tensor, **kwargs) -> TokenLogprobs:
        return token_logprobs_from_hidden(hidden, weight, target_ids, **kwargs)

    return head
