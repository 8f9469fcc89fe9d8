"""FSDP2 check on two GPUs: the LoRA adapter the trainer publishes (``adapter_state_for_sync``,
DTensor shards gathered) equals the unsharded adapter, key for key and bit for bit.

Run from the repository root on a two-GPU machine::

    PYTHONPATH=$PWD python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/fsdp_adapter_gather.py
"""

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.step.modeling import adapter_state_for_sync

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
torch.manual_seed(0)
config = Qwen3Config(
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
)
model = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
with torch.no_grad():
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.05)
model = model.cuda()
reference, doc = adapter_state_for_sync(model)
reference = {k: v.clone() for k, v in reference.items()}
for layer in model.base_model.model.model.layers:
    fully_shard(layer)
fully_shard(model)
sharded = sum(1 for _, p in model.named_parameters() if hasattr(p, "full_tensor"))
gathered, doc2 = adapter_state_for_sync(model)
worst = max((gathered[k].float() - reference[k].float()).abs().max().item() for k in reference)
print(
    f"rank {rank}: dtensor params {sharded}, adapter tensors {len(gathered)} (ref {len(reference)}), "
    f"same keys {set(gathered) == set(reference)}, max diff {worst}, shapes ok "
    f"{all(gathered[k].shape == reference[k].shape for k in reference)}, r={doc2['r']}",
    flush=True,
)
dist.destroy_process_group()
