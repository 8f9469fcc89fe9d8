"""The MFU formula charges the LM head only where it runs, the GPU defaults, and the draws benchmark's
layouts (issue 18: honest MFU, robust ratios, fast defaults)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from bench.packing import SHAPES, WORKLOADS, build_model
from bench.packing_draws import (
    breakdown,
    draw_samples,
    head_chunk,
    padding_free_rows,
    slow_steps,
    step_events,
    time_row,
    variant_options,
    variant_settings,
)
from trainer.config.async_grpo_config import AsyncGRPOConfig, compile_by_default
from trainer.reporting.perf import head_params, matmul_params_per_token, training_flops
from trainer.rollout.types import TrainingSequence
from trainer.step.loss import LossConfig
from trainer.step.packing import TokenBudgetBatcher, pack_row

CONFIG = Qwen3Config(**{**SHAPES["tiny"], "vocab_size": 1000})  # the bench's CPU shape


def _sample(ids: list[int], trained_from: int, group: int) -> TrainingSequence:
    mask = [0] * trained_from + [1] * (len(ids) - trained_from)
    return TrainingSequence(
        input_ids=ids,
        loss_mask=mask,
        sampler_logprobs=[0.0] * len(ids),
        advantage=1.0,
        group_id=group,
        rollout_id=f"s{len(ids)}-{ids[-1]}",
    )


def test_head_positions_are_the_rows_the_head_runs_on():
    prompt = [5, 6, 7, 8]
    row = pack_row([_sample(prompt + [9, 10], 4, 0), _sample(prompt + [11, 12, 13], 4, 0)])
    keep, _ = row.logits_to_keep()
    # The prompt's last token predicts a different first token per sample, so it is not shared.
    assert row.stats.head_positions == keep.numel() == 5
    assert row.stats.head_positions < row.num_tokens == 10


def test_training_flops_charges_the_head_for_its_positions_only():
    assert head_params(CONFIG) == 64 * 1000
    body = matmul_params_per_token(CONFIG)
    assert body == 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # q, o + k, v + MLP; no head
    everywhere = training_flops(CONFIG, 100, 500.0)
    on_ten = training_flops(CONFIG, 100, 500.0, head_positions=10)
    assert everywhere - on_ten == pytest.approx(6 * 64 * 1000 * 90)
    assert on_ten == pytest.approx(6 * body * 100 + 6 * 64 * 1000 * 10 + 3 * 4 * 2 * 4 * 16 * 500)


def test_compilation_is_on_by_default_only_for_cuda_runs():
    assert compile_by_default(use_cpu=False, cuda_available=True) is True
    assert compile_by_default(use_cpu=True, cuda_available=True) is False
    assert compile_by_default(use_cpu=False, cuda_available=False) is False


def test_draws_give_both_layouts_the_same_samples_and_a_breakdown():
    workload = WORKLOADS["3.4"].scaled(16)
    samples = draw_samples(7, workload, 2048, 1024)
    assert draw_samples(7, workload, 2048, 1024) == samples  # a draw is its seed
    tree = pack_row(samples)
    rows = padding_free_rows(samples, 1024)
    assert len(rows) >= 3 and all(r.num_tokens <= 1024 for r in rows)
    assert sum(r.num_trained_tokens for r in rows) == tree.num_trained_tokens
    assert sum(r.num_tokens for r in rows) == tree.stats.raw_tokens > 3 * tree.num_tokens
    assert all(r.num_tokens == r.stats.raw_tokens for r in rows)  # nothing shared

    model = build_model("tiny", torch.device("cpu"), checkpointing=True)
    model.set_attn_implementation("tree")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    parts = breakdown(model, tree, optimizer, torch.device("cpu"), LossConfig())
    for part in ("attention", "matmul", "elementwise", "head_and_loss", "optimizer"):
        assert parts[part] > 0, parts
    assert parts["device_total"] == pytest.approx(sum(v for k, v in parts.items() if k != "device_total"))


def test_each_timed_step_is_kept_with_the_compilations_inside_it_and_slow_ones_are_listed():
    """Issue 32 item 4: a draw timed 0.66x its twin on an identical row, and the record kept only a
    2-step median; now every timed step is kept with what happened inside it."""
    cpu = torch.device("cpu")
    before = step_events(cpu)
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))  # a graph compiled
    assert step_events(cpu)["compiles"] > before["compiles"]

    samples = draw_samples(3, WORKLOADS["3.4"].scaled(16), 2048, 1024)
    model = build_model("tiny", cpu, checkpointing=True)
    model.set_attn_implementation("tree")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    median, timed = time_row(model, pack_row(samples), optimizer, cpu, LossConfig(), 0, 3, set())
    assert len(timed) == 3 and median == sorted(t["s"] for t in timed)[1]
    assert all(t["s"] > 0 and t["compiles"] == 0 for t in timed)  # eager model, warmed by the untimed step

    steps = [{"s": 1.0, "compiles": 0}, {"s": 1.6, "compiles": 1}, {"s": 1.1, "compiles": 0}]
    record = {"seed": 9, "tree": {"steps": [steps]}, "padding_free": {"steps": [steps[:1], steps[2:]]}}
    assert slow_steps([record]) == [
        {"seed": 9, "layout": "tree", "row": 0, "x_fastest": 1.6, "s": 1.6, "compiles": 1}
    ]


def test_a_shared_prefix_shorter_than_the_minimum_is_forwarded_per_sample():
    prompt = list(range(100, 140))  # 40 tokens; the last one predicts a different token per sample
    a, b = _sample(prompt + [1, 2], 40, 0), _sample(prompt + [3, 4], 40, 0)
    assert pack_row([a, b]).num_tokens == 39 + 3 + 3  # 39 shared
    assert pack_row([a, b], min_shared_tokens=39).num_tokens == 45
    unshared = pack_row([a, b], min_shared_tokens=40)
    assert unshared.num_tokens == unshared.stats.raw_tokens == 84
    assert unshared.num_trained_tokens == 4
    # The batcher counts a row the way it will be packed: 84 tokens do not fit a 60-token budget.
    batcher = TokenBudgetBatcher(60, num_rows=1, min_shared_tokens=40)
    assert batcher.add(a) == [] and batcher.add(b) == [[[a]]]
    assert TokenBudgetBatcher(60, num_rows=1).add(a) == []


def test_the_minimum_shared_prefix_is_off_on_cpu():
    assert AsyncGRPOConfig(output_dir="unused").tree_min_shared_tokens == 0
    assert AsyncGRPOConfig(output_dir="unused", tree_min_shared_tokens=64).tree_min_shared_tokens == 64


def test_a_variants_options_follow_its_name_and_an_unknown_one_is_refused():
    """Issue 32: ``layer0.05-prof-h256`` is whole layers under a 0.05 budget, the partitioner timing
    its ops, the fused head's chunk at 256 MiB, measured beside ``layer0.02`` in one call."""
    from trainer.step import fused_head

    assert variant_settings("layer0.05-prof-h256") == variant_settings("layer0.05") == (False, True, 0.05)
    assert variant_options("layer0.05-prof-h256") == {"head_chunk_mib": 256, "profile_estimator": True}
    assert variant_options("fast")["head_chunk_mib"] is None
    assert not variant_options("default-h64")["profile_estimator"]
    with pytest.raises(SystemExit, match="option 'x' is none of h<MiB>, prof"):
        variant_options("layer0.02-x")
    before = fused_head._CHUNK_BYTES
    with head_chunk(256):
        assert fused_head._CHUNK_BYTES == 256 << 20
    assert before == fused_head._CHUNK_BYTES
