"""Loading the policy and its tokenizer as the spec says, and the checks on them.

* ``AutoModelForImageTextToText`` for vision-language checkpoints (everything outside the text
  model frozen and excluded from weight sync), ``AutoModelForCausalLM`` otherwise;
* weights in ``args.dtype`` (``model_init_kwargs['dtype']`` wins), attention switched to tree
  attention for packed training;
* gated DeltaNet layers (Qwen3-Next, Qwen3.5) made tree-aware (:mod:`trainer.step.linear_attention`);
* refusals: attention-sink models, other non-attention layers (Mamba/SSM), LoRA on lm_head,
  ``router_aux_loss_coef`` on a dense model.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from trainer.step.attention import use_tree_attention
from trainer.step.linear_attention import install_tree_linear_attention, supports_tree_linear_attention

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "auto": "auto"}
# Layer kinds tree packing supports: attention (the tree mask reaches every attention layer).
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}
_SSM_MODEL_TYPES = {
    "mamba",
    "mamba2",
    "jamba",
    "falcon_h1",
    "falcon_mamba",
    "zamba",
    "zamba2",
    "bamba",
    "lfm2",
}


def is_vision_language(config) -> bool:
    """True for checkpoints with a vision tower (they load with the image-text auto class)."""
    return getattr(config, "vision_config", None) is not None


def load_policy(model: str | PreTrainedModel, args) -> PreTrainedModel:
    """The model to train: loaded from a name/path, or checked if given; switched to tree attention."""
    if isinstance(model, str):
        init_kwargs = dict(args.model_init_kwargs or {})
        dtype = init_kwargs.pop("dtype", init_kwargs.pop("torch_dtype", args.dtype))
        init_kwargs["dtype"] = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        config = AutoConfig.from_pretrained(model, trust_remote_code=init_kwargs["trust_remote_code"])
        if is_vision_language(config):
            from transformers import AutoModelForImageTextToText

            policy = AutoModelForImageTextToText.from_pretrained(model, **init_kwargs)
        else:
            from transformers import AutoModelForCausalLM

            policy = AutoModelForCausalLM.from_pretrained(model, **init_kwargs)
    elif isinstance(model, PreTrainedModel):
        policy = model
    else:
        raise TypeError(
            f"model must be a hub id, a local path or a PreTrainedModel, got {type(model).__name__}"
        )
    check_supported_architecture(policy)
    if is_vision_language(policy.config):
        freeze_outside_text_model(policy)
    _apply_router_aux_loss_coef(policy, args.router_aux_loss_coef)
    policy.config.use_cache = False
    use_tree_attention(policy)
    install_tree_linear_attention(policy)
    return policy


def load_tokenizer(name_or_path: str, args) -> PreTrainedTokenizerBase:
    """The processing class: left padding, pad token falling back to EOS (spec)."""
    revision = (args.model_init_kwargs or {}).get("revision")
    tokenizer = AutoTokenizer.from_pretrained(
        name_or_path, trust_remote_code=args.trust_remote_code, **({"revision": revision} if revision else {})
    )
    return prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer):
    """Set ``padding_side='left'`` and a pad token (EOS when missing) on a tokenizer or processor."""
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    inner.padding_side = "left"
    if inner.pad_token is None:
        inner.pad_token = inner.eos_token
    return tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer) -> list[int]:
    """Every token id that ends a turn: the generation config's EOS ids and the tokenizer's."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for value in eos if isinstance(eos, list) else [eos]:
        if value is not None and value not in ids:
            ids.append(int(value))
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    if inner.eos_token_id is not None and inner.eos_token_id not in ids:
        ids.append(int(inner.eos_token_id))
    return ids


def config_architecture_refusal(*, model_type: str, layer_types: set[str]) -> str | None:
    """Why tree packing cannot train a model of ``model_type`` with ``layer_types`` (what its config
    says, so the control plane asks before the model is loaded), or None; linear attention and
    attention sinks are judged on the loaded model (:func:`check_supported_architecture`)."""
    if model_type in _SSM_MODEL_TYPES:
        return (
            f"model_type={model_type!r}: state-space / Mamba layers are not supported by tree packing "
            "(only attention layers are)"
        )
    unknown = layer_types - _SUPPORTED_LAYER_TYPES - {"linear_attention"}
    if unknown:
        return f"layer types {sorted(unknown)} are not supported by tree packing; supported: attention layers"
    return None


def check_supported_architecture(model: PreTrainedModel) -> None:
    """Refuse architectures the spec rules out, naming what is unsupported."""
    config = getattr(model.config, "text_config", None) or model.config
    model_type = getattr(config, "model_type", "")
    layer_types = set(getattr(config, "layer_types", None) or [])
    if model_type in _SSM_MODEL_TYPES:
        raise ValueError(config_architecture_refusal(model_type=model_type, layer_types=layer_types))
    if "linear_attention" in layer_types and not supports_tree_linear_attention(model):
        # Run along the packed row, their convolution and recurrent state would read sibling
        # samples' tokens; only the gated DeltaNet kernels trainer.step.linear_attention wraps follow paths.
        raise ValueError(
            f"model_type={model_type!r} has 'linear_attention' layers that are not gated DeltaNet "
            "layers with transformers' causal_conv1d_fn / torch_chunk_gated_delta_rule kernels; tree "
            "packing cannot follow their state along each sample's path"
        )
    refusal = config_architecture_refusal(model_type=model_type, layer_types=layer_types)
    if refusal:
        raise ValueError(refusal)
    if any(name.endswith(".sinks") or name.endswith("_sinks") for name, _ in model.named_parameters()):
        raise ValueError(
            f"{type(model).__name__} has attention sinks, which AsyncGRPOTrainer does not support"
        )


def freeze_outside_text_model(model: PreTrainedModel) -> None:
    """Vision-language checkpoints train on text: the vision tower and projector get no gradients."""
    for name, param in model.named_parameters():
        if not is_text_parameter(name):
            param.requires_grad_(False)


def is_text_parameter(name: str) -> bool:
    """True for parameters of the language model (and lm_head) of a VLM; everything else is frozen."""
    return "language_model" in name or name.startswith("lm_head") or ".lm_head." in name


def is_mixture_of_experts(config) -> bool:
    """True for a (text) config with routed experts."""
    return any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def _apply_router_aux_loss_coef(model: PreTrainedModel, coef: float | None) -> None:
    config = getattr(model.config, "text_config", None) or model.config
    if coef is None:
        return
    if not is_mixture_of_experts(config):
        raise ValueError(
            f"router_aux_loss_coef={coef} is set but {type(model).__name__} is not a Mixture-of-Experts model; "
            "remove router_aux_loss_coef"
        )
    config.router_aux_loss_coef = coef
    config.output_router_logits = coef > 0


def wrap_peft(model: PreTrainedModel, peft_config) -> PreTrainedModel:
    """Wrap ``model`` with a PEFT adapter; adapters on ``lm_head`` are refused.

    On a vision-language checkpoint the adapter stays inside the language model (``all-linear``
    would also reach the frozen vision tower): other modules are excluded, and an explicit target
    outside the language model is refused.
    """
    from peft import get_peft_model

    targets = peft_config.target_modules
    names = [targets] if isinstance(targets, str) else list(targets or [])
    if "lm_head" in names or (isinstance(targets, str) and targets != "all-linear" and "lm_head" in targets):
        raise ValueError("peft_config.target_modules: adapters on lm_head are not supported; remove lm_head")
    if "lm_head" in (getattr(peft_config, "modules_to_save", None) or []):
        raise ValueError("peft_config.modules_to_save: lm_head is not supported; remove it")
    vlm = is_vision_language(model.config)
    if vlm and getattr(peft_config, "exclude_modules", None) is None:
        peft_config = copy.copy(peft_config)
        peft_config.exclude_modules = r"(?!.*language_model\.).*"  # full-match: every non-text module
    wrapped = get_peft_model(model, peft_config)
    outside = [n for n, _ in wrapped.named_parameters() if "lora_" in n and not is_text_parameter(n)]
    if vlm and outside:
        raise ValueError(
            f"peft_config.target_modules reaches {outside[0]} outside the language model; the vision "
            "tower of a vision-language checkpoint stays frozen: target language-model modules only"
        )
    return wrapped


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


@contextmanager
def merged_adapter(model) -> Iterator[None]:
    """Temporarily merge a PEFT adapter into the base weights (no-op for a plain model)."""
    if not _is_peft(model):
        yield
        return
    model.merge_adapter()
    try:
        yield
    finally:
        model.unmerge_adapter()


def served_parameter_name(name: str) -> str | None:
    """The base-model name vLLM knows for a (possibly PEFT-wrapped) parameter; None = not synced."""
    if "lora_" in name or ".modules_to_save." in name and ".original_module." not in name:
        return None
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def named_weights_for_sync(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every weight the server must receive; call inside :func:`merged_adapter`.

    Frozen parts of a VLM (outside the text model) are excluded. DTensor shards (FSDP2) are
    gathered into full tensors, a collective every rank must enter in the same order.
    """
    vlm = is_vision_language(getattr(model, "config", None) or model.base_model.config)
    for name, param in model.named_parameters():
        served = served_parameter_name(name)
        if served is None or (vlm and not is_text_parameter(served)):
            continue
        yield served, full_weight(param)


def full_weight(param: torch.Tensor) -> torch.Tensor:
    """``param`` detached, its DTensor shards (FSDP2) gathered: a collective every rank enters."""
    tensor = param.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def peft_adapter_config(model):
    """The active adapter's PEFT config of a PEFT-wrapped model, None for a plain model."""
    if not _is_peft(model):
        return None
    return model.peft_config[getattr(model, "active_adapter", "default")]


def adapter_state_for_sync(model) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter of a PEFT model as vLLM loads it: (PEFT-format tensors, ``adapter_config.json``).

    Keys are PEFT's saved names (``base_model.model.<module>.lora_A.weight``, no adapter name).
    DTensor shards (FSDP2) are gathered, a collective every rank must enter in the same order.
    """
    from peft.utils import get_peft_model_state_dict

    config = peft_adapter_config(model)
    full = {name: full_weight(param) for name, param in model.named_parameters() if "lora_" in name}
    tensors = get_peft_model_state_dict(model, state_dict=full, adapter_name=model.active_adapter)
    document = config.to_dict()
    document["inference_mode"] = True
    return tensors, document


# Module classes whose forward is a chain of element-wise kernels around (at most) a few GEMMs.
_POINTWISE_SUFFIXES = ("RMSNorm", "MLP")


def compile_pointwise_modules(model: torch.nn.Module, *, outside: Sequence[torch.nn.Module] = ()) -> int:
    """``torch.compile`` every norm and MLP block of ``model`` (dynamic lengths) that is not inside
    one of ``outside`` (modules compiled whole already); returns how many.

    At packed-row lengths (~16k tokens) their element-wise chains (fp32 upcast, mean of squares,
    rsqrt, scale; SiLU(gate) * up) are memory-bound passes; compiled, each chain is one or two
    kernels. Attention keeps its own compiled FlexAttention path, so nothing around the tree mask is
    traced. Repeated blocks share one graph (their parameters are graph inputs).
    """
    inside = {id(m) for whole in outside for m in whole.modules()}
    count = 0
    for module in model.modules():
        if id(module) not in inside and type(module).__name__.endswith(_POINTWISE_SUFFIXES):
            module.compile(dynamic=True)
            count += 1
    return count


def empty_row_loss(model: torch.nn.Module, device: torch.device | str) -> torch.Tensor:
    """A zero loss for a process whose row is empty, through a real forward of one token.

    Not a sum over parameters: FSDP2 all-gathers each layer's shards inside its forward and
    reduce-scatters in its backward, so a rank that skips the forward leaves the other ranks waiting
    in the collectives. Dense-mask (SDPA) tree backend: no FlexAttention length bucket to compile.
    """
    from trainer.step.attention import TreeMask

    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    tree = TreeMask(ids[0], ids[0] + 1, backend="sdpa", positions=ids[0])
    outputs = model(input_ids=ids, position_ids=ids, tree_mask=tree, use_cache=False, logits_to_keep=1)
    return outputs.logits.sum() * 0.0
