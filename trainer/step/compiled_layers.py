"""Each decoder layer compiled whole, tree attention inside, recomputation chosen by the compiler.

Hugging Face's gradient checkpointing recomputes every layer's whole forward in the backward (on
the Qwen3-1.7B shape at 16k-token rows: ~22% of the step, docs/benchmarks.md). Here each decoder
layer is one ``torch.compile`` region (norms, projections, RoPE, FlexAttention with the tree's
block mask, the MLP, the residual adds) and AOTAutograd's min-cut partitioner decides which of the
layer's intermediates the backward keeps and which it recomputes, under
``torch._functorch.config.activation_memory_budget``: the fraction of the activations the
partitioner would keep unconstrained (1.0) that it may keep (0.0 = recompute all it can). Cheap
element-wise work is recomputed first, GEMM and attention outputs kept last, where HF's checkpoint
recomputes everything.

The tree mask cannot be built inside the region: its ``BlockMask`` is made once per forward, before
the first layer, by a forward pre-hook on the model (:func:`_build_block_masks`), and the layers
read it (``TreeMask.flex_masks``); its length bucket (``TreeMask.padded_len``) is a Python int, so a
region compiles once per bucket while the row length stays dynamic inside it.

Layers that are not plain attention layers (gated DeltaNet's custom kernels, mixture-of-experts
routing) keep the norm/MLP compilation of :func:`trainer.step.modeling.compile_pointwise_modules`:
:func:`layer_compile_refusal`.
"""

from __future__ import annotations

import torch

from trainer.step.attention import TreeMask, raise_recompile_limit
from trainer.step.modeling import compile_pointwise_modules, is_mixture_of_experts

_LAYER_SUFFIX = "DecoderLayer"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (modules whose class name ends in ``DecoderLayer``), in order."""
    return [m for m in model.modules() if type(m).__name__.endswith(_LAYER_SUFFIX)]


def layer_compile_refusal(model: torch.nn.Module) -> str | None:
    """Why the layers of ``model`` cannot be compiled whole (None when they can)."""
    layers = decoder_layers(model)
    if not layers:
        return f"{type(model).__name__} has no *{_LAYER_SUFFIX} modules"
    config = getattr(model.config, "text_config", None) or model.config
    layer_types = set(getattr(config, "layer_types", None) or [])
    if "linear_attention" in layer_types:
        return "linear-attention layers run custom kernels the compiler does not trace"
    if is_mixture_of_experts(config):
        return "mixture-of-experts layers route tokens by data-dependent shapes (not measured whole)"
    return None


def attention_windows(model: torch.nn.Module) -> set[int | None]:
    """The sliding windows the model's attention layers pass to the attention function (None =
    full attention): one block mask is built per window."""
    windows: set[int | None] = set()
    for layer in decoder_layers(model):
        attn = getattr(layer, "self_attn", None)
        windows.add(getattr(attn, "sliding_window", None) if attn is not None else None)
    return windows or {None}


def layer_memory_budget(model: torch.nn.Module, args, *, on_cuda: bool) -> float | None:
    """The activation memory budget to compile ``model``'s layers whole under, or None to keep the
    norm/MLP compilation: ``args.activation_memory_budget`` with ``gradient_checkpointing``, 1.0
    without; None off CUDA (the dense-mask path has nothing to gain), under FSDP (its per-layer
    hooks are not traced here), for a PEFT-wrapped model (not measured) and for layers the compiler
    cannot take whole (:func:`layer_compile_refusal`)."""
    if not on_cuda or getattr(args, "fsdp", None) or hasattr(model, "peft_config"):
        return None
    if layer_compile_refusal(model) is not None:
        return None
    return float(args.activation_memory_budget) if args.gradient_checkpointing else 1.0


def checkpointing_left_to_the_compiler(model: torch.nn.Module) -> int:
    """Switch Hugging Face gradient checkpointing off on ``model``'s compiled layers (transformers'
    ``Trainer.train`` switches it on from ``gradient_checkpointing``); returns how many. The compiled
    region's partitioner already recomputes under the budget; HF's checkpoint around it would run
    the whole layer's forward a second time."""
    count = 0
    for layer in decoder_layers(model):
        if getattr(layer, "gradient_checkpointing", False):
            layer.gradient_checkpointing = False
            count += 1
    return count


def compile_decoder_layers(model: torch.nn.Module, *, memory_budget: float) -> int:
    """Compile each decoder layer of ``model`` whole (dynamic lengths), the norms outside them too;
    the backward keeps at most ``memory_budget`` (0-1] of the activations an unconstrained
    partitioner would keep. Returns the number of layers compiled.

    Call on a model switched to tree attention, without Hugging Face gradient checkpointing (it
    would recompute each compiled layer whole, the cost this replaces).
    """
    if not 0.0 < memory_budget <= 1.0:
        raise ValueError(f"memory_budget={memory_budget}: expected a fraction in (0, 1]")
    refusal = layer_compile_refusal(model)
    if refusal:
        raise ValueError(f"cannot compile the decoder layers whole: {refusal}")
    import torch._functorch.config as functorch_config

    raise_recompile_limit()
    # Process-wide: every region compiled from here on (the layers, and FlexAttention's own graph,
    # which the regions contain) partitions under it.
    functorch_config.activation_memory_budget = memory_budget
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    compile_pointwise_modules(model, outside=layers)  # the final norm (and any block outside them)
    windows = attention_windows(model)
    model.register_forward_pre_hook(
        lambda module, args, kwargs: _build_block_masks(kwargs, windows), with_kwargs=True
    )
    return len(layers)


def _build_block_masks(kwargs: dict, windows: set[int | None]) -> None:
    """Forward pre-hook: the row's block masks, built once before the compiled layers read them."""
    tree_mask = kwargs.get("tree_mask")
    if not isinstance(tree_mask, TreeMask):
        return None
    device = tree_mask.tin.device
    if tree_mask.backend == "flex" or (tree_mask.backend == "auto" and device.type == "cuda"):
        tree_mask.prepare_flex(device, windows)
    return None
