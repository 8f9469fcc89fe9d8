"""Architectures beyond dense attention: MoE (aux loss, packed = unpacked), gated DeltaNet hybrids
(packed = unpacked, gradients included) and the refusals that guard tree packing."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from trainer.rollout.types import TrainingSequence
from trainer.step.attention import sequence_forward_kwargs, tree_forward_kwargs
from trainer.step.linear_attention import CONV_FUNCTION, DELTA_RULE_FUNCTION, linear_attention_modules
from trainer.step.modeling import check_supported_architecture, load_policy
from trainer.step.packing import pack_row

SMALL = dict(vocab_size=48, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _args(**overrides) -> SimpleNamespace:
    base = dict(model_init_kwargs=None, dtype="float32", trust_remote_code=False, router_aux_loss_coef=None)
    return SimpleNamespace(**(base | overrides))


def _samples() -> list[TrainingSequence]:
    """Two completions of one prompt [1, 2, 3]; the trie shares the prompt."""
    return [
        TrainingSequence([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1], [0.0] * 6, [None] * 6, advantage=1.0),
        TrainingSequence([1, 2, 3, 7, 8], [0, 0, 0, 1, 1], [0.0] * 5, [None] * 5, advantage=-1.0),
    ]


def _packed_vs_unpacked(model, samples: list[TrainingSequence] | None = None) -> float:
    """Max |logit| difference, at every trained position, between the packed row and each sample alone."""
    samples = samples or _samples()
    row = pack_row(samples, num_top_logprobs=0)
    worst = 0.0
    with torch.no_grad():
        packed = model(**tree_forward_kwargs(row)).logits[0]
        for sample_id, sample in enumerate(samples):
            alone = model(**sequence_forward_kwargs(sample.input_ids)).logits[0]
            rows = row.logit_index[row.sample_index == sample_id]
            predicting = [i - 1 for i, m in enumerate(sample.loss_mask) if m]
            assert len(rows) == len(predicting) > 0
            worst = max(worst, float((packed[rows] - alone[predicting]).abs().max()))
    return worst


def test_moe_aux_loss_is_produced_and_packing_is_exact():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        **SMALL,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        decoder_sparse_step=1,
    )
    model = load_policy(Qwen3MoeForCausalLM(config).float(), _args(router_aux_loss_coef=0.02))
    assert model.config.router_aux_loss_coef == 0.02 and model.config.output_router_logits
    model.eval()
    row = pack_row(_samples(), num_top_logprobs=0)
    out = model(**tree_forward_kwargs(row))
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss) and out.aux_loss > 0
    # routing is per token, so packing must not change any sample's logits
    assert _packed_vs_unpacked(model) < 1e-5


def test_dense_model_packing_is_exact_and_refuses_router_aux_loss_coef():
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL, intermediate_size=64, num_hidden_layers=2)).float()
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01 .* not a Mixture-of-Experts"):
        load_policy(model, _args(router_aux_loss_coef=0.01))
    model = load_policy(model, _args())
    model.eval()
    assert _packed_vs_unpacked(model) < 1e-5


def _hybrid_config(cls, **extra):
    return cls(
        **SMALL,
        intermediate_size=64,
        num_hidden_layers=3,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        **extra,
    )


def _branching_samples(seed: int = 0) -> list[TrainingSequence]:
    """Four samples, two tries: prompt P (70) → A (75) → {B (40), C (3)} and P → D (90), longer
    than the delta rule's 64-token chunks, plus prompt E (30) → F (20) of another group (trained on
    everything after the prompt). Segments of one depth differ in length, so batched waves pad."""
    g = torch.Generator().manual_seed(seed)
    part = lambda n: torch.randint(1, SMALL["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    p, a, b, c, d, e, f = part(70), part(75), part(40), part(3), part(90), part(30), part(20)
    out = []
    for prompt, ids in ((p, p + a + b), (p, p + a + c), (p, p + d), (e, e + f)):
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        out.append(TrainingSequence(ids, mask, [0.0] * len(ids), [None] * len(ids), advantage=1.0))
    return out


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_gated_deltanet_hybrids_pack_exactly(family):
    """Conv taps and recurrent state follow each sample's path: packed logits equal unpacked ones,
    and the gradient of a packed loss equals the sum of the per-sample gradients."""
    torch.manual_seed(0)
    if family == "qwen3_next":
        config = _hybrid_config(
            Qwen3NextConfig,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        )
        model = Qwen3NextForCausalLM(config).float()
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        model = Qwen3_5ForCausalLM(_hybrid_config(Qwen3_5TextConfig)).float()
    with torch.no_grad():  # slow decay (random init decays to ~0 in a token): the state must carry
        for layer in linear_attention_modules(model):
            layer.A_log.fill_(math.log(0.05))
    model = load_policy(model, _args())
    model.eval()
    samples = _branching_samples()
    assert _packed_vs_unpacked(model, samples) < 1e-5
    # either kernel run along the row instead of the paths is measurably wrong
    modeling = sys.modules[type(model).__module__]
    for name in (CONV_FUNCTION, DELTA_RULE_FUNCTION):
        wrapped = getattr(modeling, name)
        setattr(modeling, name, wrapped.tree_original)
        try:
            assert _packed_vs_unpacked(model, samples) > 1e-3, name
        finally:
            setattr(modeling, name, wrapped)
    # gradients: packed row vs samples alone, on the sum of trained-token logprobs
    row = pack_row(samples, num_top_logprobs=0)
    model.zero_grad()
    logits = model(**tree_forward_kwargs(row)).logits[0]
    _trained_logprob_sum_packed(logits, row, samples).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for sample in samples:
        alone = model(**sequence_forward_kwargs(sample.input_ids)).logits[0]
        _trained_logprob_sum_alone(alone, sample).backward()
    for name, grad in packed.items():
        torch.testing.assert_close(
            grad, dict(model.named_parameters())[name].grad, atol=1e-5, rtol=1e-4, msg=name
        )


def _trained_logprob_sum_packed(logits, row, samples) -> torch.Tensor:
    total = logits.new_zeros(())
    for sample_id, sample in enumerate(samples):
        rows = row.logit_index[row.sample_index == sample_id]
        targets = torch.tensor([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
        total = total + logits[rows].log_softmax(-1).gather(-1, targets[:, None]).sum()
    return total


def _trained_logprob_sum_alone(logits, sample) -> torch.Tensor:
    predicting = [i - 1 for i, m in enumerate(sample.loss_mask) if m]
    targets = torch.tensor([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
    return logits[predicting].log_softmax(-1).gather(-1, targets[:, None]).sum()


def _windowed_model(family: str, window: int = 16):
    """A random-init 3-layer ``family`` model (``bench.architectures``) on eager attention, with a
    ``window``-token sliding window (on every layer, or on every other) and Gemma 2's softcaps."""
    from bench.architectures import random_causal_lm

    # initializer_range 0.2: scores reach Gemma 2's cap of 1.0 (at 0.02 they stay in its linear range)
    overrides = {"attn_logit_softcapping": 1.0, "initializer_range": 0.2} if family == "gemma2" else {}
    model = random_causal_lm(
        family, vocab_size=SMALL["vocab_size"], hidden_size=32, heads=4, layers=3, window=window, **overrides
    )
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "phi3"])
def test_sliding_window_and_softcap_layers_pack_exactly(family):
    """Sliding-window layers see only the last W positions of each path (and Gemma 2's softcap is
    applied): tree-packed logits equal the model's own eager attention on each sample alone."""
    samples = _branching_samples()
    model = _windowed_model(family)
    with torch.no_grad():
        reference = [model(input_ids=torch.tensor([s.input_ids])).logits[0] for s in samples]
        unwindowed = _windowed_model(family, window=4096)(input_ids=torch.tensor([samples[0].input_ids]))
    assert float((unwindowed.logits[0] - reference[0]).abs().max()) > 1e-3  # the window bites
    model = load_policy(model, _args())
    row = pack_row(samples, num_top_logprobs=0)
    with torch.no_grad():
        packed = model(**tree_forward_kwargs(row)).logits[0]
    for sample_id, sample in enumerate(samples):
        rows = row.logit_index[row.sample_index == sample_id]
        predicting = [i - 1 for i, m in enumerate(sample.loss_mask) if m]
        torch.testing.assert_close(packed[rows], reference[sample_id][predicting], atol=1e-5, rtol=1e-4)


def test_linear_attention_without_the_known_kernels_is_refused():
    """A 'linear_attention' layer kind whose kernels the tree wrapper does not know is refused."""
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL, intermediate_size=64, num_hidden_layers=2)).float()
    model.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        check_supported_architecture(model)


def _tiny_vlm_dir(tmp_path) -> str:
    """A random-init Qwen3-VL checkpoint (tiny text model, one-block vision tower) saved to disk."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(
            **SMALL,
            intermediate_size=64,
            num_hidden_layers=2,
            rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=32,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=1,
            deepstack_visual_indexes=[0],
        ),
    )
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(tmp_path / "vlm")
    return str(tmp_path / "vlm")


def test_vision_language_checkpoint_trains_its_text_model_only(tmp_path):
    from trainer.step.modeling import named_weights_for_sync

    model = load_policy(_tiny_vlm_dir(tmp_path), _args())
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"  # the image-text auto class
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".visual." in n or n.startswith("model.visual") for n in frozen)
    assert trainable and all("language_model" in n or n.startswith("lm_head") for n in trainable)
    synced = [name for name, _ in named_weights_for_sync(model)]
    assert synced and not any("visual" in n for n in synced)
    model.eval()
    assert _packed_vs_unpacked(model) < 1e-5


def test_lora_on_a_vision_language_checkpoint_stays_in_the_language_model(tmp_path):
    from peft import LoraConfig

    from trainer.step.modeling import wrap_peft

    model = wrap_peft(
        load_policy(_tiny_vlm_dir(tmp_path), _args()), LoraConfig(r=4, target_modules="all-linear")
    )
    adapters = [n for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and all("language_model" in n for n in adapters)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    # an exclusion list of the user's own that lets an adapter reach the vision tower is refused
    vision_too = LoraConfig(r=4, target_modules=["qkv", "q_proj"], exclude_modules=[])
    with pytest.raises(ValueError, match="outside the language model"):
        wrap_peft(load_policy(_tiny_vlm_dir(tmp_path), _args()), vision_too)


def test_prompts_with_images_are_refused(tmp_path):
    from datasets import Dataset

    from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
    from trainer.rewards import accuracy_reward
    from trainer.tiny.chat_template import check_text_only

    check_text_only([{"role": "user", "content": "plain text"}], "row 0")
    check_text_only([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "row 0")
    # as an Arrow-backed dataset returns parts: every key present, None where unused
    check_text_only([{"role": "user", "content": [{"type": "text", "text": "hi", "image": None}]}], "row 0")
    image_prompt = [
        {
            "role": "user",
            "content": [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "What is it?"}],
        }
    ]
    with pytest.raises(ValueError, match="row 3: message 0 has a 'image' content part.*text only"):
        check_text_only(image_prompt, "row 3")
    text_prompt = [{"role": "user", "content": [{"type": "text", "text": "2 + 2?"}]}]
    rows = [{"prompt": text_prompt, "answer": "4"}] * 2 + [{"prompt": image_prompt, "answer": "cat"}]
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url="http://127.0.0.1:9", use_cpu=True
    )
    with pytest.raises(ValueError, match="train_dataset row 2, column 'prompt'"):
        AsyncGRPOTrainer(
            _tiny_vlm_dir(tmp_path),
            reward_funcs=accuracy_reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
        )
