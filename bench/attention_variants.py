"""Tree attention's layer variants on the FlexAttention path: sliding windows and softcapping.

For one packed row (groups of a shared prompt and branching completions), with Gemma-like
attention shapes (8 query heads, 4 KV heads, head dim 256), this checks that the CUDA FlexAttention
path (block mask with the window, ``score_mod`` for the softcap) gives the same output and input
gradients as the exact dense-mask path (SDPA, or explicit matmul + softmax with a softcap), and times
forward + backward of each variant. Run on a GPU:

    python -m bench.attention_variants --out bench/results/attention-variants-h200.json

Reported per variant (``full``, ``window``, ``softcap``, ``window+softcap``) and dtype: the largest
absolute difference of output and of the query/key/value gradients between the two paths, and the
median milliseconds of the flex path (a window also skips whole key blocks, so it should be faster).
Then, per model family (random-init Gemma 2 with a softcap, Gemma 3, Mistral; windows of 64 tokens),
the largest difference between the tree-packed logits on the flex path and the model's own eager
attention on each sample alone (fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from trainer.rollout.types import TrainingSequence
from trainer.step.attention import TreeMask, tree_attention_forward
from trainer.step.packing import pack_row

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 256
VARIANTS = {
    "full": (None, None),
    "window": (512, None),
    "softcap": (None, 50.0),
    "window+softcap": (512, 50.0),
}


def branching_row(groups: int, prompt: int, completions: int, length: int, seed: int):
    """One packed row: ``groups`` prompts of ``prompt`` tokens, each with ``completions`` completions
    of ``length`` tokens that share their first half in pairs (a two-level trie)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(1, 32000, (n,), generator=g).tolist()  # noqa: E731
    samples = []
    for _ in range(groups):
        p = ids(prompt)
        for _ in range(completions // 2):
            shared = ids(length // 2)
            for _ in range(2):
                seq = p + shared + ids(length - length // 2)
                mask = [0] * prompt + [1] * (len(seq) - prompt)
                samples.append(
                    TrainingSequence(seq, mask, [0.0] * len(seq), [None] * len(seq), advantage=1.0)
                )
    return pack_row(samples, num_top_logprobs=0)


def _attend(q, k, v, mask: TreeMask, window, softcap):
    out, _ = tree_attention_forward(
        torch.nn.Module(), q, k, v, None, tree_mask=mask, sliding_window=window, softcap=softcap
    )
    return out


def compare(row, device: torch.device, dtype: torch.dtype, window, softcap, reps: int) -> dict[str, Any]:
    """Max |flex - dense| of the output and input gradients; median flex forward + backward ms."""
    torch.manual_seed(0)
    n = row.num_tokens
    leaves = [torch.randn(1, h, n, HEAD_DIM, device=device, dtype=dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]
    grad_out = torch.randn(1, n, HEADS, HEAD_DIM, device=device, dtype=dtype)
    results = {}
    for backend in ("sdpa", "flex"):
        mask = TreeMask(
            row.tin.to(device), row.tout.to(device), backend=backend, positions=row.position_ids.to(device)
        )
        q, k, v = (x.clone().requires_grad_(True) for x in leaves)
        out = _attend(q, k, v, mask, window, softcap)
        out.backward(grad_out)
        results[backend] = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
        if backend == "flex":
            times = []
            for _ in range(reps):
                q, k, v = (x.clone().requires_grad_(True) for x in leaves)
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                _attend(q, k, v, mask, window, softcap).backward(grad_out)
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
    names = ("out", "grad_q", "grad_k", "grad_v")
    diffs = {
        name: float((a - b).abs().max())
        for name, a, b in zip(names, results["sdpa"], results["flex"], strict=True)
    }
    scale = {name: float(a.abs().max()) for name, a in zip(names, results["sdpa"], strict=True)}
    return {"max_abs_diff": diffs, "max_abs": scale, "flex_ms": 1e3 * statistics.median(times)}


def model_check(family: str, device: torch.device) -> float:
    """Max |packed flex logits - eager per-sample logits| of a random-init ``family`` model (fp32)."""
    from bench.architectures import random_causal_lm
    from trainer.step.attention import tree_forward_kwargs, use_tree_attention

    # initializer_range 0.2: scores reach Gemma 2's cap of 1.0 (at 0.02 they stay in its linear range)
    overrides = {"attn_logit_softcapping": 1.0, "initializer_range": 0.2} if family == "gemma2" else {}
    model = random_causal_lm(family, vocab_size=512, heads=4, layers=3, window=64, **overrides)
    model = model.to(device)
    model.set_attn_implementation("eager")
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, 512, (n,), generator=g).tolist()  # noqa: E731
    p, a = ids(100), ids(150)
    seqs = [p + a + ids(120), p + a + ids(30), p + ids(200)]
    samples = [
        TrainingSequence(s, [0] * 100 + [1] * (len(s) - 100), [0.0] * len(s), [None] * len(s), advantage=1.0)
        for s in seqs
    ]
    with torch.no_grad():
        reference = [model(input_ids=torch.tensor([s], device=device)).logits[0] for s in seqs]
        use_tree_attention(model)
        row = pack_row(samples, num_top_logprobs=0)
        packed = model(**tree_forward_kwargs(row, device, backend="flex")).logits[0]
    worst = 0.0
    for sample_id, sample in enumerate(samples):
        rows = row.logit_index[row.sample_index == sample_id].to(device)
        predicting = [i - 1 for i, m in enumerate(sample.loss_mask) if m]
        worst = max(worst, float((packed[rows] - reference[sample_id][predicting]).abs().max()))
    return worst


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    row = branching_row(groups=2, prompt=400, completions=4, length=1200, seed=0)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "row_tokens": row.num_tokens,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "results": [],
    }
    for dtype in (torch.float32, torch.bfloat16):
        for name, (window, softcap) in VARIANTS.items():
            result = compare(row, device, dtype, window, softcap, args.reps)
            result |= {
                "variant": name,
                "dtype": str(dtype).removeprefix("torch."),
                "window": window,
                "softcap": softcap,
            }
            report["results"].append(result)
            print(json.dumps(result), flush=True)
    report["models_max_abs_logit_diff"] = {}
    for family in ("gemma2", "gemma3", "mistral"):
        report["models_max_abs_logit_diff"][family] = model_check(family, device)
        print(family, report["models_max_abs_logit_diff"][family], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
