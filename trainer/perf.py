"""FLOPs estimates and model FLOPs utilisation (MFU) for the ``perf/*_mfu`` metrics.

Logged only where both are known (spec): the training device's peak compute at the training
precision, and a FLOPs formula for the architecture (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3-VL text).
"""

from __future__ import annotations

import torch

SUPPORTED_MODEL_TYPES = frozenset(
    {"llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "mistral"}
)

# Dense peak FLOP/s per device by (name fragment, precision); sparsity not counted.
_PEAK_FLOPS = {
    ("H200", "bf16"): 989.4e12,
    ("H200", "fp16"): 989.4e12,
    ("H200", "fp32"): 66.9e12,
    ("H100", "bf16"): 989.4e12,
    ("H100", "fp16"): 989.4e12,
    ("H100", "fp32"): 66.9e12,
    ("A100", "bf16"): 312e12,
    ("A100", "fp16"): 312e12,
    ("A100", "fp32"): 19.5e12,
    ("B200", "bf16"): 2250e12,
    ("B200", "fp16"): 2250e12,
    ("B200", "fp32"): 80e12,
    ("L40S", "bf16"): 362e12,
    ("L40S", "fp16"): 362e12,
    ("L40S", "fp32"): 91.6e12,
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak dense FLOP/s of ``device`` at ``precision`` (bf16, fp16, fp32), or None when unknown (CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for (fragment, prec), value in _PEAK_FLOPS.items():
        if fragment in name and prec == precision:
            return value
    return None


def _text_config(config):
    return getattr(config, "text_config", None) or config


def matmul_params_per_token(config) -> float | None:
    """Parameters a token multiplies through in one forward (active experts only), or None if unsupported."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    c = _text_config(config)
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o + k, v
    num_experts = getattr(c, "num_experts", None)
    if num_experts:
        top_k = c.num_experts_per_tok
        moe_inter = getattr(c, "moe_intermediate_size", c.intermediate_size)
        mlp = 3 * h * moe_inter * top_k + h * num_experts
    else:
        mlp = 3 * h * c.intermediate_size
    return float(layers * (attn + mlp) + h * vocab)


def attention_flops_per_pair(config) -> float | None:
    """Forward FLOPs of one (query, visible key) pair over all layers: QK^T plus AV."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    c = _text_config(config)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return float(4 * c.num_hidden_layers * c.num_attention_heads * head_dim)


def training_flops(config, forwarded_tokens: int, attention_pairs: float) -> float | None:
    """FLOPs of forward + backward (3× forward) over ``forwarded_tokens`` and ``attention_pairs``."""
    params = matmul_params_per_token(config)
    pair = attention_flops_per_pair(config)
    if params is None or pair is None:
        return None
    return 3.0 * (2.0 * params * forwarded_tokens + pair * attention_pairs)
