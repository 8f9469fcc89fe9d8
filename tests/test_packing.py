"""Tree packing: the spec's drawn layout, sharing rules, the token-budget batcher and batch metrics."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from trainer.reporting.metrics import MetricWindow
from trainer.rollout.types import TrainingSequence
from trainer.step.packing import PackedRow, TokenBudgetBatcher, batch_metrics, pack_row, row_stats

P1, P2, P3, A1, A2, B1, B2 = 11, 12, 13, 21, 22, 31, 32


def seq(
    ids, trained_from=None, *, mask=None, group=0, adv=1.0, rid="", tops=None, cands=None
) -> TrainingSequence:
    """A sample whose tokens from ``trained_from`` on are trained (or an explicit ``mask``)."""
    if mask is None:
        mask = [0] * len(ids) if trained_from is None else [int(i >= trained_from) for i in range(len(ids))]
    return TrainingSequence(
        input_ids=list(ids),
        loss_mask=list(mask),
        sampler_logprobs=[-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(mask)],
        sampler_top_logprobs=tops,
        sampling_mask=cands,
        advantage=adv,
        group_id=group,
        rollout_id=rid,
    )


def visible(row: PackedRow, q: int) -> list[int]:
    """Row indices of the keys query ``q`` attends to (ancestor-or-self in the trie)."""
    return [k for k in range(row.num_tokens) if row.tin[k] <= row.tin[q] < row.tout[k]]


def check_invariants(row: PackedRow) -> None:
    """Each sample's trained tokens read logits whose visible path is exactly the sample's history."""
    n = 0
    seen_target: dict[int, int] = {}
    for s_idx, sample in enumerate(row.samples):
        for i, trained in enumerate(sample.loss_mask):
            if not trained:
                continue
            j = int(row.logit_index[n])
            path = visible(row, j)
            assert [int(row.input_ids[k]) for k in path] == sample.input_ids[:i]
            assert [int(row.position_ids[k]) for k in path] == list(range(i))
            assert int(row.target_ids[n]) == sample.input_ids[i]
            assert int(row.sample_index[n]) == s_idx
            # a position predicts one token
            assert seen_target.setdefault(j, sample.input_ids[i]) == sample.input_ids[i]
            n += 1
    assert n == row.num_trained_tokens
    assert torch.equal(row.tin, torch.arange(row.num_tokens))


def test_spec_example_packs_to_the_drawn_layout():
    r0 = seq([P1, P2, P3, A1, A2], 3, rid="r0")
    r1 = seq([P1, P2, P3, B1, B2], 3, rid="r1")
    row = pack_row([r0, r1])

    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, P3, B1, B2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert row.segment_ids.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert row.segment_parents.tolist() == [-1, 0, 0]
    # attention (step 4 of the drawing): each segment's queries see the segment's path, causally
    assert [visible(row, q) for q in (0, 1)] == [[0], [0, 1]]
    assert [visible(row, q) for q in (2, 3, 4)] == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert [visible(row, q) for q in (5, 6, 7)] == [[0, 1, 5], [0, 1, 5, 6], [0, 1, 5, 6, 7]]
    # loss (step 5): a1 a2 at index 2 3, b1 b2 at index 5 6
    assert row.logit_index.tolist() == [2, 3, 5, 6]
    assert row.target_ids.tolist() == [A1, A2, B1, B2]
    assert row.sample_index.tolist() == [0, 0, 1, 1]
    assert row.sampler_logprobs.tolist() == pytest.approx([-0.4, -0.5, -0.4, -0.5])
    assert row.stats.raw_tokens == 10 and row.stats.forwarded_tokens == 8
    check_invariants(row)


def test_no_sharing_is_plain_padding_free_packing():
    a = seq([1, 2, 3, 4], 2)
    b = seq([5, 6, 7], 1)
    row = pack_row([a, b])
    assert row.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert row.segment_ids.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert row.tout.tolist() == [4, 4, 4, 4, 7, 7, 7]
    # block-diagonal causal attention
    assert visible(row, 3) == [0, 1, 2, 3] and visible(row, 6) == [4, 5, 6]
    assert row.logit_index.tolist() == [1, 2, 4, 5]
    check_invariants(row)


def test_untrained_fork_position_is_shared():
    # Two prompts with a common system prompt: nobody trains the token after the fork position, so
    # its logits are unused and the position itself is shared (only trained successors force a copy).
    a = seq([1, 2, 3, 40, 41, 42], 4, group=0)
    b = seq([1, 2, 3, 50, 51, 52], 4, group=1)
    row = pack_row([a, b])
    assert row.input_ids.tolist() == [1, 2, 3, 40, 41, 42, 50, 51, 52]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert row.segment_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    check_invariants(row)


def test_identical_and_prefix_samples_share_everything():
    a = seq([1, 2, 3, 4, 5], 3)
    row = pack_row([a, seq([1, 2, 3, 4, 5], 3)])
    assert row.num_tokens == 5
    assert row.logit_index.tolist() == [2, 3, 2, 3]
    check_invariants(row)
    # a sample that is a prefix of another (a turn that later continued) adds nothing either
    row = pack_row([seq([1, 2, 3, 4], 3), seq([1, 2, 3, 4, 5, 6], 3)])
    assert row.num_tokens == 6 and row.logit_index.tolist() == [2, 2, 3, 4]
    check_invariants(row)


def test_multi_turn_forks_share_several_levels():
    prompt = [1, 2, 3]
    turn1 = [60, 61]  # assistant, trained
    tool = [70, 71]  # tool result, context only
    # a: prompt turn1 tool turn2; b forks after the tool result; c is the group's other rollout;
    # d is a later sample of a that re-renders turn1 as context (not trained) and continues.
    a = seq(prompt + turn1 + tool + [80, 81], mask=[0, 0, 0, 1, 1, 0, 0, 1, 1], rid="a")
    b = seq(prompt + turn1 + tool + [90, 91, 92], mask=[0, 0, 0, 1, 1, 0, 0, 1, 1, 1], rid="b")
    c = seq(prompt + [65, 66], 3, rid="c")
    d = seq(prompt + turn1 + tool + [80, 81, 72, 95], mask=[0] * 9 + [0, 1], rid="d")
    row = pack_row([a, b, c, d])
    check_invariants(row)
    # shared: prompt[:2] | 3 (a/b/d: predicts 60) | 60 61 70 71 | ... ; c has its own copy of 3.
    assert row.input_ids.tolist() == [1, 2, 3, 60, 61, 70, 71, 80, 81, 72, 95, 71, 90, 91, 92, 3, 65, 66]
    # depth-first: 71 is copied because a trains 80 and b trains 90 after it; d shares a's whole path
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 6, 7, 8, 9, 2, 3, 4]
    assert row.stats.raw_tokens == 9 + 10 + 5 + 11


def test_random_rows_keep_every_sample_history():
    rng = random.Random(0)
    for _ in range(30):
        samples = []
        bases = [[rng.randrange(1, 6) for _ in range(rng.randrange(1, 5))] for _ in range(3)]
        for g in range(rng.randrange(1, 7)):
            ids = list(rng.choice(bases)) + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 6))]
            mask = [0] + [rng.randrange(2) for _ in ids[1:]]
            samples.append(seq(ids, mask=mask, group=g % 2))
        row = pack_row(samples)
        check_invariants(row)
        assert row.num_tokens <= sum(len(s) for s in samples)
        for k in range(row.num_tokens):
            assert k < int(row.tout[k]) <= row.num_tokens


def test_top_logprobs_and_candidate_sets_are_packed_per_trained_token():
    tops = [None, None, {5: -0.1, 6: -2.0, 7: -3.0, 8: -9.0}, {9: -0.5}]
    cands = [None, None, [5, 6, 7], None]
    row = pack_row([seq([1, 2, 5, 9], 2, tops=tops, cands=cands)], num_top_logprobs=3)
    assert row.top_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert row.top_logprobs[0].tolist() == pytest.approx([-0.1, -2.0, -3.0])
    assert row.top_logprobs[1, 0].item() == pytest.approx(-0.5)
    assert torch.isinf(row.top_logprobs[1, 1:]).all()
    assert row.candidate_ids.tolist() == [5, 6, 7]
    assert row.candidate_token.tolist() == [0, 0, 0]
    assert row.has_candidates.tolist() == [True, False]
    plain = pack_row([seq([1, 2, 3], 1)])
    assert plain.top_ids.shape == (2, 0) and plain.candidate_ids is None
    moved = row.to("cpu")
    assert torch.equal(moved.input_ids, row.input_ids) and moved.stats is row.stats


def test_bad_loss_mask_is_rejected():
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        pack_row([seq([1, 2], mask=[1, 1])])
    with pytest.raises(ValueError, match="entries"):
        pack_row([seq([1, 2], mask=[0, 1, 1])])


def group_sample(group: int, completion: list[int], prompt_len: int = 6) -> TrainingSequence:
    prompt = [100 + group] + [200 + group * 10 + i for i in range(prompt_len - 1)]
    return seq(prompt + completion, prompt_len, group=group, rid=f"g{group}-{completion[0]}")


def test_batcher_counts_shared_tokens_once():
    # A group sample adds its completion plus its own copy of the last prompt token (which predicts
    # a different trained first token): 8, then 8 + 3 = 11 unique tokens for 16 raw ones.
    batcher = TokenBudgetBatcher(token_budget=11, num_rows=1)
    assert batcher.add(group_sample(0, [1, 2])) == []
    assert batcher.add(group_sample(0, [3, 4])) == []
    closed = batcher.add(group_sample(0, [5, 6]))  # 14 > 11: the micro-batch closes
    assert len(closed) == 1 and [len(r) for r in closed[0]] == [2]
    assert row_stats(closed[0][0]).forwarded_tokens == 11
    assert [len(r) for mb in batcher.flush() for r in mb] == [1]
    assert batcher.flush() == []


def test_max_samples_per_row_caps_a_row_of_converged_completions():
    """Issue 34 item 3: identical completions share every token, so the token budget alone would put
    all of them in one row; ``max_samples_per_row`` closes the micro-batch at the cap instead."""
    same = [group_sample(0, [1, 2]) for _ in range(7)]
    uncapped = TokenBudgetBatcher(token_budget=100, num_rows=1)
    assert all(uncapped.add(s) == [] for s in same)
    assert [len(r) for mb in uncapped.flush() for r in mb] == [7]
    capped = TokenBudgetBatcher(token_budget=100, num_rows=1, max_samples_per_row=3)
    closed = [mb for s in same for mb in capped.add(s)] + capped.flush()
    assert [len(r) for mb in closed for r in mb] == [3, 3, 1]
    with pytest.raises(ValueError, match="max_samples_per_row"):
        TokenBudgetBatcher(token_budget=100, num_rows=1, max_samples_per_row=0)


def test_batcher_places_groups_on_their_rows():
    batcher = TokenBudgetBatcher(token_budget=100, num_rows=2)
    for s in [
        group_sample(0, [1, 2]),
        group_sample(1, [1, 2]),
        group_sample(0, [3, 4]),
        group_sample(1, [5, 6]),
    ]:
        assert batcher.add(s) == []
    (mb,) = batcher.flush()
    assert [s.group_id for s in mb[0]] == [0, 0] and [s.group_id for s in mb[1]] == [1, 1]


def test_batcher_spills_to_an_empty_row_then_to_a_row_it_does_not_overload():
    # group 0 fills row 0 (9 + 4 = 13 = budget); its next sample goes to the empty row 1.
    batcher = TokenBudgetBatcher(token_budget=13, num_rows=2)
    batcher.add(group_sample(0, [1, 2, 3]))
    batcher.add(group_sample(0, [4, 5, 6]))
    batcher.add(group_sample(0, [7, 8, 9]))
    (mb,) = batcher.flush()
    assert [len(r) for r in mb] == [2, 1]

    # row 0 full with a heavy group; row 1 holds a light sample of another group. A spilling
    # sample of group 0 that would not lift the maximum load goes to row 1 ...
    batcher = TokenBudgetBatcher(token_budget=13, num_rows=2)
    batcher.add(group_sample(0, [1, 2, 3]))  # row 0: 9 tokens, load 45
    batcher.add(group_sample(1, [1], prompt_len=1))  # row 1: 2 tokens, load 3
    batcher.add(group_sample(0, [4, 5, 6]))  # row 0: 13 tokens, load 45 + 30 = 75
    assert batcher.add(seq([150, 151, 152], 1, group=0)) == []  # home full; row 1 -> load 3 + 6 <= 75
    (mb,) = batcher.flush()
    assert [len(r) for r in mb] == [2, 2]

    # ... but one that would make row 1 the most loaded row closes the micro-batch instead.
    batcher = TokenBudgetBatcher(token_budget=13, num_rows=2)
    batcher.add(group_sample(0, [1, 2]))  # row 0: 8 tokens, load 36
    batcher.add(group_sample(1, [1], prompt_len=1))  # row 1: 2 tokens, load 3
    batcher.add(group_sample(0, [4, 5]))  # row 0: 11 tokens, load 36 + 21 = 57
    closed = batcher.add(seq([150 + i for i in range(11)], 1, group=0))  # fits row 1, but load 3 + 66 > 57
    assert len(closed) == 1 and [len(r) for r in closed[0]] == [2, 1]
    assert batcher.num_pending_samples == 1


def test_batcher_new_groups_fill_rows_within_budget():
    # One process: new groups keep filling the row until the budget is reached.
    batcher = TokenBudgetBatcher(token_budget=30, num_rows=1)
    out = []
    for g in range(5):
        out += batcher.add(group_sample(g, [1, 2]))  # 8 tokens each
    out += batcher.flush()
    assert [[len(r) for r in mb] for mb in out] == [[3], [2]]
    for mb in out:
        assert all(row_stats(r).forwarded_tokens <= 30 for r in mb)


def test_batcher_drops_oversize_samples(caplog):
    batcher = TokenBudgetBatcher(token_budget=5, num_rows=2)
    with caplog.at_level(logging.WARNING, logger="trainer.step.packing"):
        assert batcher.add(seq(list(range(1, 7)), 1, rid="long")) == []
    assert "token_budget=5" in caplog.text and "long" in caplog.text
    assert batcher.dropped_oversize_count == 1 and batcher.num_pending_samples == 0
    assert batcher.pop_dropped_oversize_count() == 1 and batcher.pop_dropped_oversize_count() == 0
    batcher.add(seq([1, 2, 3, 4, 5], 1))  # exactly the budget fits
    assert batcher.num_pending_samples == 1


def test_batch_metrics_on_the_spec_example():
    r0 = seq([P1, P2, P3, A1, A2], 3, group=7)
    r1 = seq([P1, P2, P3, B1, B2], 3, group=7)
    other = seq([1, 2, 3, 4], 2, group=8)
    mb1 = [pack_row([r0, r1]).stats, pack_row([other]).stats]  # 8 and 4 tokens
    mb2 = [row_stats([other]), row_stats([])]  # a process with an empty row
    metrics = batch_metrics([mb1, mb2], token_budget=16, dropped_oversize_count=2)
    s = metrics.summary()
    assert s["batch/forwarded_tokens_per_step"] == 16
    assert s["batch/trained_tokens_per_step"] == 4 + 2 + 2
    assert s["batch/samples_per_step"] == 4
    assert s["batch/groups_per_step"] == 2
    assert s["batch/microbatches_per_step"] == 2
    # trained positions: a1 a2 b1 b2 + 3 4 + 3 4 = 8 of 16 forwarded
    assert s["batch/masked_token_frac"] == pytest.approx(0.5)
    assert s["batch/packing_ratio"] == pytest.approx((10 + 4 + 4) / 16)
    assert s["batch/samples_per_row"] == pytest.approx(4 / 4)
    assert s["batch/row_tokens_mean"] == pytest.approx(16 / 4)
    assert s["batch/row_tokens_max"] == 8
    assert s["batch/row_fill_frac"] == pytest.approx((8 + 4 + 4 + 0) / 16 / 4)
    # pad to the longest row of each micro-batch: (8-4) of 16, then (4-0) of 8
    assert s["batch/pad_frac"] == pytest.approx((4 + 4) / (16 + 8))
    # attention cost: row of the example = 1+2 + (3+4+5)*2 = 27, other = 10; mb2: 10 vs 0
    assert s["batch/row_imbalance"] == pytest.approx((27 / 18.5 + 10 / 5) / 2)
    assert s["batch/dropped_oversize_count"] == 2
    assert s["sample/forwarded_tokens_max"] == 5
    assert s["sample/forwarded_tokens_mean"] == pytest.approx((5 + 5 + 4 + 4) / 4)
    assert s["sample/trained_tokens_mean"] == pytest.approx(2.0)
    assert metrics.forwarded_tokens == 16

    one = batch_metrics([[pack_row([r0, r1]).stats]], token_budget=8).summary()
    assert one["batch/packing_ratio"] == pytest.approx(10 / 8)
    assert one["batch/row_fill_frac"] == 1.0 and one["batch/pad_frac"] == 0.0

    window = MetricWindow()
    metrics.record(window)
    batch_metrics([[row_stats([other])]], token_budget=16).record(window)
    reduced = window.reduce()
    assert reduced["batch/dropped_oversize_count"] == 2  # counts are summed
    assert reduced["batch/row_tokens_max"] == 8  # maxima kept
    assert reduced["sample/forwarded_tokens_mean"] == pytest.approx((5 + 5 + 4 + 4 + 4) / 5)  # per sample
