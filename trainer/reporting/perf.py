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
    """Parameters a forwarded token multiplies through in one forward, LM head excluded (active
    experts only), or None if unsupported. The head is :func:`head_params`: it runs only on the
    positions whose logits the loss reads."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    c = _text_config(config)
    h, layers = c.hidden_size, c.num_hidden_layers
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
    return float(layers * (attn + mlp))


def head_params(config) -> float | None:
    """Parameters of the LM head (hidden × vocab) one head position multiplies through, or None."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    c = _text_config(config)
    return float(c.hidden_size * c.vocab_size)


def attention_flops_per_pair(config) -> float | None:
    """Forward FLOPs of one (query, visible key) pair over all layers: QK^T plus AV."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    c = _text_config(config)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return float(4 * c.num_hidden_layers * c.num_attention_heads * head_dim)


def training_flops(
    config, forwarded_tokens: int, attention_pairs: float, head_positions: int | None = None
) -> float | None:
    """FLOPs of forward + backward (3× forward): the body over ``forwarded_tokens``, attention over
    ``attention_pairs`` (query, visible key) pairs, the LM head over ``head_positions`` (the rows
    it runs on: ``logits_to_keep``; every forwarded token when None, as for a full-logits forward).
    """
    params = matmul_params_per_token(config)
    head = head_params(config)
    pair = attention_flops_per_pair(config)
    if params is None or pair is None or head is None:
        return None
    head_rows = forwarded_tokens if head_positions is None else head_positions
    return 3.0 * (2.0 * params * forwarded_tokens + 2.0 * head * head_rows + pair * attention_pairs)
