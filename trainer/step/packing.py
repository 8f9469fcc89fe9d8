"""Tree packing: a row of samples as a prefix trie, laid out depth-first, and the token-budget batcher.

A row is what one process forwards in one micro-batch. Its samples are merged into a prefix trie so
that a prefix shared by several samples (a group's prompt, the turns a multi-turn fork repeats, a
system prompt common to several prompts) is forwarded once. The trie is laid out depth-first, so a
token's ancestors-or-self are exactly the keys it may attend to, and with ``tin[k] = k`` a key ``k``
is visible to a query ``q`` iff ``tin[k] <= tin[q] < tout[k]`` (``tout`` = end of ``k``'s subtree).

Sharing rule. A position's logits predict one token: the logits at row index ``j`` are read as the
prediction of at most one target id. Two samples therefore share a trie node only if the token and
its history are equal *and* they do not train different successors from it. Each node records the
``target`` its logits are trained to predict (``None`` while no sample reads them); a sample whose
next token is trained (``loss_mask[i + 1] == 1``) may only enter a node whose target is unset or
equal to that token, and sets it. In the spec's example (``r0 = p1 p2 p3 a1 a2``,
``r1 = p1 p2 p3 b1 b2`` with ``a*``/``b*`` trained), ``p3`` would have to predict both ``a1`` and
``b1``, so each rollout gets its own ``p3`` and the row is ``p1 p2 | p3 a1 a2 | p3 b1 b2`` (8 tokens).
Where the successors are not trained (two prompts that share a system prompt and then differ), the
fork position is shared, since nobody reads its logits.

Minimum shared prefix. A shared prefix shorter than ``min_shared_tokens`` is not shared: the sample
gets its own path from the root. On CUDA the tree mask is evaluated in 128-token blocks, and every
query block of a completion then visits the (partial) block holding its group's prompt besides its
own; for a short prompt that costs more than forwarding the prompt once per sample saves (on an
H200, 16-token prompts made the tree step 2-3% slower than padding-free). ``0`` shares everything.

Units: "tokens" are token positions; a row's *unique* token count (its length ``L``) counts shared
tokens once. The *attention cost* of a row is the number of (query, key) pairs its tree attention
computes, ``sum over positions of (depth + 1)``; it is the load the batcher balances and the cost
``batch/row_imbalance`` compares.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from trainer.reporting.metrics import (
    BATCH_DROPPED_OVERSIZE_COUNT,
    BATCH_FORWARDED_TOKENS_PER_STEP,
    BATCH_GROUPS_PER_STEP,
    BATCH_MASKED_TOKEN_FRAC,
    BATCH_MICROBATCHES_PER_STEP,
    BATCH_PACKING_RATIO,
    BATCH_PAD_FRAC,
    BATCH_ROW_FILL_FRAC,
    BATCH_ROW_IMBALANCE,
    BATCH_ROW_TOKENS_MAX,
    BATCH_ROW_TOKENS_MEAN,
    BATCH_SAMPLES_PER_ROW,
    BATCH_SAMPLES_PER_STEP,
    BATCH_TRAINED_TOKENS_PER_STEP,
    SAMPLE_FORWARDED_TOKENS_MAX,
    SAMPLE_FORWARDED_TOKENS_MEAN,
    SAMPLE_TRAINED_TOKENS_MEAN,
    MetricWindow,
)
from trainer.rollout.types import TrainingSequence

logger = logging.getLogger(__name__)

# A micro-batch: one row per process, each row the samples packed together.
MicroBatch = list[list[TrainingSequence]]


@dataclass(slots=True, eq=False)
class _Node:
    """One trie position: a token, its depth (= position id) and what its logits are trained on."""

    token: int
    depth: int
    parent: _Node | None
    target: int | None = None
    trained: bool = False
    children: dict[int, list[_Node]] = field(default_factory=dict)
    num_children: int = 0
    index: int = -1


def _successor_target(sample: TrainingSequence, i: int) -> int | None:
    """The token the logits at position ``i`` must predict for ``sample``, or None if untrained."""
    nxt = i + 1
    if nxt < len(sample.input_ids) and sample.loss_mask[nxt]:
        return int(sample.input_ids[nxt])
    return None


class PrefixTrie:
    """The prefix trie of one row's samples (see the module docstring for the sharing rule)."""

    def __init__(self, min_shared_tokens: int = 0) -> None:
        self.min_shared_tokens = min_shared_tokens
        self._roots: dict[int, list[_Node]] = {}
        self.nodes: list[_Node] = []
        self.attention_cost = 0
        self.paths: list[list[_Node]] = []
        self.samples: list[TrainingSequence] = []

    def __len__(self) -> int:
        return len(self.nodes)

    def _choose(self, siblings: dict[int, list[_Node]], sample: TrainingSequence, i: int) -> _Node | None:
        """The existing node that ``sample``'s token ``i`` can share, or None."""
        token = int(sample.input_ids[i])
        want = _successor_target(sample, i)
        candidates = siblings.get(token)
        if not candidates:
            return None
        if want is not None:
            exact = [n for n in candidates if n.target == want]
            if exact:
                return exact[0]
            free = [n for n in candidates if n.target is None]
            return free[0] if free else None
        # Nothing is trained from here: any node with this token fits; prefer the one whose subtree
        # continues with our next token so that the sharing goes on.
        if i + 1 < len(sample.input_ids):
            nxt = int(sample.input_ids[i + 1])
            for node in candidates:
                if nxt in node.children:
                    return node
        return candidates[0]

    def _walk(self, sample: TrainingSequence) -> list[_Node]:
        """The existing nodes ``sample`` shares, from the root (a prefix of its path)."""
        matched: list[_Node] = []
        siblings = self._roots
        for i in range(len(sample.input_ids)):
            node = self._choose(siblings, sample, i)
            if node is None:
                break
            matched.append(node)
            siblings = node.children
        if len(matched) < self.min_shared_tokens:
            return []  # too short to be worth sharing (see the module docstring)
        return matched

    def cost_of(self, sample: TrainingSequence) -> tuple[int, int]:
        """``(new_tokens, new_attention_cost)`` that inserting ``sample`` would add; no change made."""
        shared = len(self._walk(sample))
        length = len(sample.input_ids)
        # depths shared..length-1 are new; each attends to depth + 1 keys.
        new_cost = (length * (length + 1) - shared * (shared + 1)) // 2
        return length - shared, new_cost

    def insert(self, sample: TrainingSequence) -> list[_Node]:
        """Add ``sample``; returns its path (one node per token)."""
        if len(sample.loss_mask) != len(sample.input_ids):
            raise ValueError(
                f"sample {sample.rollout_id!r}: loss_mask has {len(sample.loss_mask)} entries, "
                f"input_ids {len(sample.input_ids)}"
            )
        path = self._walk(sample)
        parent = path[-1] if path else None
        for i in range(len(path), len(sample.input_ids)):
            node = _Node(token=int(sample.input_ids[i]), depth=i, parent=parent)
            siblings = parent.children if parent is not None else self._roots
            siblings.setdefault(node.token, []).append(node)
            if parent is not None:
                parent.num_children += 1
            self.nodes.append(node)
            self.attention_cost += i + 1
            path.append(node)
            parent = node
        for i, node in enumerate(path):
            want = _successor_target(sample, i)
            if want is not None:
                node.target = want
            if sample.loss_mask[i]:
                node.trained = True
        self.paths.append(path)
        self.samples.append(sample)
        return path

    def layout(self) -> list[_Node]:
        """Assign depth-first row indices (children in insertion order); returns nodes by index."""
        order: list[_Node] = []
        stack = [n for nodes in reversed(self._roots.values()) for n in reversed(nodes)]
        while stack:
            node = stack.pop()
            node.index = len(order)
            order.append(node)
            stack.extend(n for nodes in reversed(node.children.values()) for n in reversed(nodes))
        return order


@dataclass
class RowStats:
    """Counts of one packed row, the inputs of the batch metrics.

    Attributes:
        forwarded_tokens: unique tokens the row forwards (its length L).
        raw_tokens: sum of the samples' lengths (what forwarding them unpacked would cost).
        trained_tokens: sum of the samples' trained tokens (loss terms).
        trained_positions: row positions that at least one sample trains.
        head_positions: row positions whose logits the loss reads (the LM head runs on these only).
        attention_cost: (query, key) pairs of the row's tree attention, sum of (depth + 1).
        sample_tokens, sample_trained_tokens: per sample, its length and trained-token count.
        group_ids: per sample, its group.
    """

    forwarded_tokens: int = 0
    raw_tokens: int = 0
    trained_tokens: int = 0
    trained_positions: int = 0
    head_positions: int = 0
    attention_cost: int = 0
    sample_tokens: list[int] = field(default_factory=list)
    sample_trained_tokens: list[int] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)


def _trie_stats(trie: PrefixTrie) -> RowStats:
    return RowStats(
        forwarded_tokens=len(trie),
        raw_tokens=sum(len(s.input_ids) for s in trie.samples),
        trained_tokens=sum(s.num_trained_tokens for s in trie.samples),
        trained_positions=sum(1 for n in trie.nodes if n.trained),
        head_positions=sum(1 for n in trie.nodes if n.target is not None),
        attention_cost=trie.attention_cost,
        sample_tokens=[len(s.input_ids) for s in trie.samples],
        sample_trained_tokens=[s.num_trained_tokens for s in trie.samples],
        group_ids=[s.group_id for s in trie.samples],
    )


def row_stats(samples: Sequence[TrainingSequence], min_shared_tokens: int = 0) -> RowStats:
    """The :class:`RowStats` of ``samples`` packed into one row (no tensors built)."""
    trie = PrefixTrie(min_shared_tokens)
    for sample in samples:
        trie.insert(sample)
    return _trie_stats(trie)


@dataclass
class PackedRow:
    """One packed row as tensors. ``L`` = unique tokens, ``N`` = trained tokens (all samples), ``K`` =
    sampler top-logprobs kept per token, ``M`` = candidate-set entries, ``S`` = segments.

    Attributes:
        input_ids: (L,) token ids in depth-first order.
        position_ids: (L,) depth of each token in its trie path (RoPE position).
        tin, tout: (L,) entry index and end of subtree: key k is visible to query q iff
            ``tin[k] <= tin[q] < tout[k]``. Depth-first, so ``tin == arange(L)``.
        segment_ids: (L,) segment of each position (maximal unbranched chain of the trie).
        segment_parents: (S,) parent segment of each segment, -1 for a root.
        logit_index: (N,) row index whose logits predict each trained token.
        target_ids: (N,) the trained token ids.
        advantages: (N,) advantage of the token's sample.
        sampler_logprobs: (N,) sampler log-probability of each trained token (nats).
        sample_index: (N,) index of the token's sample in :attr:`samples`.
        top_ids: (N, K) sampler's most likely token ids at each trained position (0 = padding).
        top_logprobs: (N, K) their sampler log-probabilities (-inf = padding).
        candidate_ids: (M,) token ids of the top-k/top-p candidate sets, or None when no token has one.
        candidate_token: (M,) index in 0..N-1 of the trained token each candidate belongs to, or None.
        has_candidates: (N,) True where a candidate set restricts the token's distribution, or None.
        samples: the row's samples, in packing order.
        stats: the row's counts (:class:`RowStats`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    tin: torch.Tensor
    tout: torch.Tensor
    segment_ids: torch.Tensor
    segment_parents: torch.Tensor
    logit_index: torch.Tensor
    target_ids: torch.Tensor
    advantages: torch.Tensor
    sampler_logprobs: torch.Tensor
    sample_index: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    candidate_ids: torch.Tensor | None
    candidate_token: torch.Tensor | None
    has_candidates: torch.Tensor | None
    samples: list[TrainingSequence]
    stats: RowStats

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained_tokens(self) -> int:
        return int(self.target_ids.shape[0])

    def logits_to_keep(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keep, index)``: (R,) sorted row indices whose logits the loss reads, and (N,) each trained
        token's position in ``keep``. Passing ``keep`` as the model's ``logits_to_keep`` runs the LM
        head on R rows instead of L; the loss then reads ``logits[index]``."""
        keep, index = torch.unique(self.logit_index, sorted=True, return_inverse=True)
        return keep, index

    def to(self, device: torch.device | str) -> PackedRow:
        """A copy with every tensor on ``device``."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return PackedRow(**moved)


def _top_entries(top: dict[int, float] | None, k: int | None) -> list[tuple[int, float]]:
    """The ``k`` most likely entries of a sampler top-logprob dict (all of them when k is None)."""
    if not top:
        return []
    entries = sorted(((int(t), float(lp)) for t, lp in top.items()), key=lambda e: -e[1])
    return entries if k is None else entries[:k]


def pack_row(
    samples: Sequence[TrainingSequence], num_top_logprobs: int | None = None, min_shared_tokens: int = 0
) -> PackedRow:
    """Pack ``samples`` into one tree row.

    Args:
        samples: the row's samples (token alignment: see :class:`TrainingSequence`).
        num_top_logprobs: how many of the sampler's most likely tokens to keep per trained token
            (``num_sampler_logprobs``); vLLM may also report the sampled token when it is outside its
            top-K, which this cut removes. None keeps every reported entry.
        min_shared_tokens: shorter shared prefixes are not shared (see the module docstring).
    """
    trie = PrefixTrie(min_shared_tokens)
    for sample in samples:
        trie.insert(sample)
    order = trie.layout()
    length = len(order)

    # Subtree ends: walk nodes in reverse pre-order, adding each subtree size to its parent.
    size = [1] * length
    for node in reversed(order):
        if node.parent is not None:
            size[node.parent.index] += size[node.index]
    segment_ids, segment_parents = [], []
    for node in order:
        parent = node.parent
        if parent is None or parent.num_children != 1:
            segment_parents.append(segment_ids[parent.index] if parent is not None else -1)
            segment_ids.append(len(segment_parents) - 1)
        else:
            segment_ids.append(segment_ids[parent.index])

    logit_index, target_ids, advantages, sampler_lp, sample_index = [], [], [], [], []
    tops: list[list[tuple[int, float]]] = []
    cand_ids, cand_token, has_cand = [], [], []
    any_candidates = False
    for s_idx, (sample, path) in enumerate(zip(trie.samples, trie.paths, strict=True)):
        top_lists = sample.sampler_top_logprobs
        masks = sample.sampling_mask
        for i, trained in enumerate(sample.loss_mask):
            if not trained:
                continue
            if i == 0:
                raise ValueError(
                    f"sample {sample.rollout_id!r}: loss_mask[0] must be 0 (nothing predicts it)"
                )
            n = len(target_ids)
            logit_index.append(path[i - 1].index)
            target_ids.append(int(sample.input_ids[i]))
            advantages.append(float(sample.advantage))
            sampler_lp.append(float(sample.sampler_logprobs[i]))
            sample_index.append(s_idx)
            tops.append(_top_entries(top_lists[i] if top_lists is not None else None, num_top_logprobs))
            cands = masks[i] if masks is not None else None
            has_cand.append(cands is not None)
            if cands is not None:
                any_candidates = True
                cand_ids.extend(int(c) for c in cands)
                cand_token.extend([n] * len(cands))

    num_trained = len(target_ids)
    width = max((len(t) for t in tops), default=0)
    top_ids = torch.zeros((num_trained, width), dtype=torch.long)
    top_lp = torch.full((num_trained, width), float("-inf"), dtype=torch.float32)
    for n, entries in enumerate(tops):
        if entries:
            top_ids[n, : len(entries)] = torch.tensor([e[0] for e in entries], dtype=torch.long)
            top_lp[n, : len(entries)] = torch.tensor([e[1] for e in entries], dtype=torch.float32)

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    return PackedRow(
        input_ids=longs([n.token for n in order]),
        position_ids=longs([n.depth for n in order]),
        tin=torch.arange(length, dtype=torch.long),
        tout=torch.arange(length, dtype=torch.long) + longs(size),
        segment_ids=longs(segment_ids),
        segment_parents=longs(segment_parents),
        logit_index=longs(logit_index),
        target_ids=longs(target_ids),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        sampler_logprobs=torch.tensor(sampler_lp, dtype=torch.float32),
        sample_index=longs(sample_index),
        top_ids=top_ids,
        top_logprobs=top_lp,
        candidate_ids=longs(cand_ids) if any_candidates else None,
        candidate_token=longs(cand_token) if any_candidates else None,
        has_candidates=torch.tensor(has_cand, dtype=torch.bool) if any_candidates else None,
        samples=list(trie.samples),
        stats=_trie_stats(trie),
    )


class TokenBudgetBatcher:
    """Forms micro-batches of ``num_rows`` rows (one per process), each within ``token_budget`` unique tokens.

    Placement of a sample, following the spec:

    1. the row that already holds its group (its prompt), if the sample fits there;
    2. otherwise (that row is full, or no row holds the group yet) an empty row, if one is left;
    3. otherwise, for a group that already has a (full) row, another row where it fits and which does
       not raise the load of the most loaded row; for a new group, the row where it fits with the
       smallest resulting load (new groups fill the rows; the spill rule guards the balance);
    4. otherwise the micro-batch closes and the sample starts the next one.

    Load is the row's attention cost (see the module docstring). Samples longer than
    ``token_budget`` fit no row: they are dropped with a warning and counted. ``max_samples_per_row``
    (an extension beyond the spec; None = no cap): a row holding that many samples takes no more,
    however much of their prefixes they share, so a step's samples (and its generation) stay bounded.
    """

    def __init__(
        self,
        token_budget: int,
        num_rows: int,
        min_shared_tokens: int = 0,
        max_samples_per_row: int | None = None,
    ) -> None:
        if token_budget < 1 or num_rows < 1:
            raise ValueError(f"token_budget={token_budget}, num_rows={num_rows}: both must be >= 1")
        if max_samples_per_row is not None and max_samples_per_row < 1:
            raise ValueError(f"max_samples_per_row={max_samples_per_row}: must be >= 1 (or None)")
        self.max_samples_per_row = max_samples_per_row
        self.token_budget = token_budget
        self.num_rows = num_rows
        self.min_shared_tokens = min_shared_tokens
        self.dropped_oversize_count = 0
        self._unreported_dropped = 0
        self._reset()

    def _reset(self) -> None:
        self._tries = [PrefixTrie(self.min_shared_tokens) for _ in range(self.num_rows)]
        self._groups: list[set[int]] = [set() for _ in range(self.num_rows)]

    @property
    def num_pending_samples(self) -> int:
        """Samples placed in the open micro-batch."""
        return sum(len(t.samples) for t in self._tries)

    def _close(self) -> MicroBatch:
        batch = [list(t.samples) for t in self._tries]
        self._reset()
        return batch

    def _choose_row(self, sample: TrainingSequence) -> int | None:
        costs = [t.cost_of(sample) for t in self._tries]
        cap = self.max_samples_per_row
        fits = [
            len(t) + new_tokens <= self.token_budget and (cap is None or len(t.samples) < cap)
            for t, (new_tokens, _) in zip(self._tries, costs, strict=True)
        ]
        loads = [t.attention_cost for t in self._tries]
        homes = [r for r in range(self.num_rows) if sample.group_id in self._groups[r]]
        home_fits = [r for r in homes if fits[r]]
        if home_fits:
            return min(home_fits, key=lambda r: (costs[r][0], r))
        empty = [r for r in range(self.num_rows) if not self._tries[r].samples]
        if empty:
            return empty[0]
        candidates = [r for r in range(self.num_rows) if fits[r]]
        if homes:
            ceiling = max(loads)
            candidates = [r for r in candidates if loads[r] + costs[r][1] <= ceiling]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (loads[r] + costs[r][1], costs[r][0], r))

    def add(self, sample: TrainingSequence) -> list[MicroBatch]:
        """Place ``sample``; returns the micro-batches this closed (zero or one)."""
        if len(sample.input_ids) > self.token_budget:
            self.dropped_oversize_count += 1
            self._unreported_dropped += 1
            logger.warning(
                "Dropping sample %s: %d tokens exceed token_budget=%d (it fits no row).",
                sample.rollout_id or "?",
                len(sample.input_ids),
                self.token_budget,
            )
            return []
        closed: list[MicroBatch] = []
        row = self._choose_row(sample)
        if row is None:
            closed.append(self._close())
            row = 0
        self._tries[row].insert(sample)
        self._groups[row].add(sample.group_id)
        return closed

    def flush(self) -> list[MicroBatch]:
        """Close the open micro-batch; returns it (empty rows included), or nothing if it holds no sample."""
        if self.num_pending_samples == 0:
            return []
        return [self._close()]

    def pop_dropped_oversize_count(self) -> int:
        """Oversize samples dropped since the last call (for ``batch/dropped_oversize_count``)."""
        count, self._unreported_dropped = self._unreported_dropped, 0
        return count


@dataclass
class BatchMetrics:
    """The batch and sample metrics of one optimizer step.

    Attributes:
        per_step: one value per step (sums over the step, step-level ratios, maxima).
        observations: per-row, per-micro-batch or per-sample values; the logging window averages
            them over all rows / micro-batches / samples it saw, as the spec's window rules say.
        forwarded_tokens: the step's forwarded tokens, the increment of the cumulative ``num_tokens``
            (shared prefixes counted once).
    """

    per_step: dict[str, float]
    observations: dict[str, list[float]]
    forwarded_tokens: int

    def record(self, window: MetricWindow) -> None:
        """Add this step's values to a logging window."""
        for name, value in self.per_step.items():
            window.add(name, value)
        for name, values in self.observations.items():
            window.extend(name, values)

    def summary(self) -> dict[str, float]:
        """The step alone reduced: ``per_step`` plus the mean of each observation list."""
        out = dict(self.per_step)
        for name, values in self.observations.items():
            if values:
                out[name] = sum(values) / len(values)
        return out


def batch_metrics(
    micro_batches: Sequence[Sequence[RowStats]], token_budget: int, dropped_oversize_count: int = 0
) -> BatchMetrics:
    """Batch metrics of one optimizer step.

    Args:
        micro_batches: the step's micro-batches, each the :class:`RowStats` of all processes' rows
            (empty rows included: they are rows a process forwards with nothing in them).
        token_budget: the row budget (tokens), for ``batch/row_fill_frac``.
        dropped_oversize_count: samples the batcher dropped for this step.
    """
    rows = [row for mb in micro_batches for row in mb]
    forwarded = sum(r.forwarded_tokens for r in rows)
    raw = sum(r.raw_tokens for r in rows)
    trained_positions = sum(r.trained_positions for r in rows)
    sample_tokens = [n for r in rows for n in r.sample_tokens]
    sample_trained = [n for r in rows for n in r.sample_trained_tokens]
    groups = {g for r in rows for g in r.group_ids}

    padded = pad = 0
    imbalance: list[float] = []
    for mb in micro_batches:
        longest = max((r.forwarded_tokens for r in mb), default=0)
        padded += longest * len(mb)
        pad += sum(longest - r.forwarded_tokens for r in mb)
        costs = [r.attention_cost for r in mb]
        mean_cost = sum(costs) / len(costs) if costs else 0.0
        if mean_cost > 0:
            imbalance.append(max(costs) / mean_cost)

    per_step = {
        BATCH_FORWARDED_TOKENS_PER_STEP: float(forwarded),
        BATCH_TRAINED_TOKENS_PER_STEP: float(sum(r.trained_tokens for r in rows)),
        BATCH_SAMPLES_PER_STEP: float(len(sample_tokens)),
        BATCH_GROUPS_PER_STEP: float(len(groups)),
        BATCH_MICROBATCHES_PER_STEP: float(len(micro_batches)),
        BATCH_MASKED_TOKEN_FRAC: 1.0 - trained_positions / forwarded if forwarded else 0.0,
        BATCH_ROW_TOKENS_MAX: float(max((r.forwarded_tokens for r in rows), default=0)),
        BATCH_PACKING_RATIO: raw / forwarded if forwarded else 1.0,
        BATCH_PAD_FRAC: pad / padded if padded else 0.0,
        BATCH_DROPPED_OVERSIZE_COUNT: float(dropped_oversize_count),
        SAMPLE_FORWARDED_TOKENS_MAX: float(max(sample_tokens, default=0)),
    }
    observations = {
        BATCH_SAMPLES_PER_ROW: [float(len(r.sample_tokens)) for r in rows],
        BATCH_ROW_TOKENS_MEAN: [float(r.forwarded_tokens) for r in rows],
        BATCH_ROW_FILL_FRAC: [r.forwarded_tokens / token_budget for r in rows],
        BATCH_ROW_IMBALANCE: imbalance,
        SAMPLE_FORWARDED_TOKENS_MEAN: [float(n) for n in sample_tokens],
        SAMPLE_TRAINED_TOKENS_MEAN: [float(n) for n in sample_trained],
    }
    return BatchMetrics(per_step=per_step, observations=observations, forwarded_tokens=forwarded)
