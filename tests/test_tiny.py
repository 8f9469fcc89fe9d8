"""The embedded tiny model (``python -m trainer tiny``): build report, loading, chat template, tasks.

Pure transformers (the vLLM smoke test serves the same build). The build is cached under
``~/.cache/grpo/tiny/<source hash>`` by the session fixture ``tiny_model_dir``, so only the first run pays
for it (~2 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import re

import pytest

from trainer.builtin_tools import ARITHMETIC_TOOLS, add, multiply, subtract
from trainer.rewards import accuracy_reward
from trainer.tasks.arithmetic import LEVELS, Problem, arithmetic_rows, problem_split
from trainer.tiny.build import BUILD_REPORT, read_build_report, source_hash
from trainer.tiny.chat_template import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    assistant_message_from_text,
    format_tool_call,
    parse_tool_calls,
)

BOXED = re.compile(r"^\\boxed\{-?\d+\}$")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def tool_conversation() -> list[dict]:
    """System, user, two parallel tool calls, two tool results, reasoning, follow-up turn."""
    return [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 3 + 4 and 5 × 6?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}},
                {"type": "function", "function": {"name": "multiply", "arguments": {"a": 5, "b": 6}}},
            ],
        },
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "tool", "name": "multiply", "content": "30"},
        {"role": "assistant", "reasoning_content": "7 then 30", "content": "\\boxed{7} and \\boxed{30}"},
        {"role": "user", "content": "And 9 - 2?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"type": "function", "function": {"name": "subtract", "arguments": {"a": 9, "b": 2}}}
            ],
        },
        {"role": "tool", "name": "subtract", "content": "7"},
        {"role": "assistant", "content": "\\boxed{7}"},
    ]


def test_build_report_is_current_and_in_band(tiny_model_dir):
    report = read_build_report(tiny_model_dir)
    assert report is not None, f"no {BUILD_REPORT} in {tiny_model_dir}"
    assert report["source_hash"] == source_hash()
    assert report["seed"] == 0
    # RL needs room to improve and mixed groups: the warm start stops part-way on purpose.
    assert 0.2 <= report["eval_accuracy_sampled"] <= 0.6, report
    assert report["group_mixed_frac"] >= 0.25, report  # most groups of 8 must carry signal
    assert report["tool_call_rate"] > 0.0, report
    assert report["num_parameters"] < 2_000_000


def test_build_is_cached(tiny_model_dir):
    from trainer.tiny.build import build_tiny

    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    report = build_tiny(tiny_model_dir)  # same sources and seed: returns the stored report
    assert report == json.loads((tiny_model_dir / BUILD_REPORT).read_text())
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_loads_with_transformers(tiny_model_dir, tokenizer, model):
    assert model.config.model_type == "qwen3"
    assert model.config.head_dim == 64
    assert model.config.max_position_embeddings >= 2048
    assert next(model.parameters()).dtype.is_floating_point
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.padding_side == "left"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.vocab_size >= len(tokenizer)
    for token in (
        "<|im_start|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
    ):
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, (token, ids)
    # Markup must survive skip_special_tokens (vLLM's default detokenization) or tool calls vanish.
    text = format_tool_call("add", {"a": 1, "b": 2})
    assert (
        tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True) == text
    )
    assert (tiny_model_dir / "model.safetensors").exists()


def test_digits_are_single_tokens(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("What is 407 × 38?", add_special_tokens=False))
    assert [t for t in tokens if any(ch.isdigit() for ch in t)] == ["4", "0", "7", "3", "8"]


def test_chat_template_is_prefix_preserving(tokenizer):
    messages = tool_conversation()
    tools = list(ARITHMETIC_TOOLS)
    for k in range(1, len(messages)):
        shorter = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False)
        longer = tokenizer.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False)
        assert longer.startswith(shorter), f"rendering changed when message {k} was added"
        if messages[k]["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(
                messages[:k], tools=tools, tokenize=False, add_generation_prompt=True
            )
            assert longer.startswith(prompt)
            # Token level too: prompt ids + generated ids == ids of the re-rendered conversation.
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
            assert tokenizer.encode(longer, add_special_tokens=False)[: len(prompt_ids)] == prompt_ids


def test_tools_render_into_prompt(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        tools=[add, subtract, multiply],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.startswith("<|im_start|>system\n")
    for tool in (add, subtract, multiply):
        assert f'"name": "{tool.__name__}"' in prompt
    assert '"description": "The first integer."' in prompt  # from the Google-style docstring
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert plain == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


def test_parse_tool_calls_round_trips(tokenizer):
    messages = tool_conversation()
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        prompt = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        rendered = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        generated = rendered[len(prompt) :].removesuffix("<|im_end|>\n")
        calls = parse_tool_calls(generated)
        assert calls == [c["function"] for c in message["tool_calls"]]
        rebuilt = assistant_message_from_text(generated)
        assert rebuilt["content"] == message["content"]
        again = tokenizer.apply_chat_template([*messages[:k], rebuilt], tokenize=False)
        assert again == rendered


def test_parse_tool_calls_is_tolerant():
    good = format_tool_call("add", {"a": 1, "b": 2})
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls(good + "\n" + good) == [{"name": "add", "arguments": {"a": 1, "b": 2}}] * 2
    bad_json = parse_tool_calls(
        f'{TOOL_CALL_START}\n{{"name": "add", "arguments": {{"a": 1,}}\n{TOOL_CALL_END}'
    )
    assert len(bad_json) == 1 and "error" in bad_json[0]
    string_args = parse_tool_calls(
        f'{TOOL_CALL_START}{{"name": "add", "arguments": "{{\\"a\\": 1}}"}}{TOOL_CALL_END}'
    )
    assert string_args == [{"name": "add", "arguments": {"a": 1}}]
    no_name = parse_tool_calls(f'{TOOL_CALL_START}{{"arguments": {{}}}}{TOOL_CALL_END}')
    assert no_name[0]["name"] is None and "error" in no_name[0]
    unterminated = parse_tool_calls(good + f'\n{TOOL_CALL_START}\n{{"name": "add"')
    assert unterminated[0] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert "error" in unterminated[1]
    assert assistant_message_from_text("\\boxed{3}") == {"role": "assistant", "content": "\\boxed{3}"}


def test_greedy_answers_in_boxed_format(tokenizer, model):
    import torch

    rows = arithmetic_rows(8, seed=0, split="eval")
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=16, do_sample=False)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert all(BOXED.match(c) for c in completions), completions
    # Every generation stopped on <|im_end|> rather than running to the token limit.
    assert all(tokenizer.eos_token_id in row.tolist() for row in out[:, batch["input_ids"].shape[1] :])


def test_arithmetic_rows_are_deterministic_and_split():
    train = arithmetic_rows(400, seed=3)
    assert train == arithmetic_rows(400, seed=3)
    assert train != arithmetic_rows(400, seed=4)
    evaluation = arithmetic_rows(400, seed=3, split="eval")
    assert {r["prompt"][0]["content"] for r in train}.isdisjoint(
        {r["prompt"][0]["content"] for r in evaluation}
    )
    assert {r["level"] for r in train} == set(range(len(LEVELS)))  # easy and hard prompts both present
    for row in train[:50]:
        assert row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1
        assert accuracy_reward([f"\\boxed{{{row['solution']}}}"], [row["solution"]]) == [1.0]
    assert problem_split(Problem(12, "+", 7, 3)) == problem_split(Problem(12, "+", 7, 3))
    with pytest.raises(ValueError):
        arithmetic_rows(1, split="test")


def test_shipped_build_is_current():
    """The package ships the build of its own sources; edit tiny/build.py & co. and this says how to redo it."""
    from trainer.tiny.build import PREBUILT_DIR

    report = read_build_report(PREBUILT_DIR)
    assert report is not None and report["source_hash"] == source_hash() and report["seed"] == 0, (
        "trainer/tiny_model/ is not the build of the current sources; rebuild it with "
        "`GRPO_TINY_PREBUILT=0 python -m trainer tiny trainer/tiny_model --force`"
    )


def _same_files(a, b) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def test_cli_copies_the_shipped_build_into_a_new_outdir(tmp_path):
    """``python -m trainer tiny OUTDIR`` on a fresh OUTDIR copies the shipped build (no training)."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from trainer.tiny.build import PREBUILT_DIR

    out = tmp_path / "model"
    env = {**os.environ, "GRPO_CACHE_DIR": str(tmp_path / "empty-cache")}
    # A build from scratch takes minutes on 2 cores; a copy takes well under a second.
    subprocess.run(
        [sys.executable, "-m", "trainer", "tiny", str(out)], cwd=REPO, env=env, check=True, timeout=120
    )
    assert _same_files(out, PREBUILT_DIR)


def test_cli_copies_a_cached_build_when_the_shipped_one_is_off(tmp_path):
    """The issue's case: the cache holds this build, a new OUTDIR gets a copy instead of a rebuild."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import REPO
    from trainer.tiny.build import PREBUILT_DIR, PREBUILT_ENV

    cache = tmp_path / "cache"
    cached = cache / "tiny" / source_hash()[:16]
    shutil.copytree(PREBUILT_DIR, cached)
    env = {**os.environ, "GRPO_CACHE_DIR": str(cache), PREBUILT_ENV: "0"}
    for name in ("a", "b"):
        subprocess.run(
            [sys.executable, "-m", "trainer", "tiny", str(tmp_path / name)],
            cwd=REPO,
            env=env,
            check=True,
            timeout=120,
        )
        assert _same_files(tmp_path / name, cached)


def test_a_short_build_from_scratch_saves_and_reloads(tmp_path):
    """The build pipeline itself (the suite otherwise copies the shipped build): tokenizer, model,
    a few warm-start steps that lower the loss, save, and a reload equal to what was saved."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.tiny.build import build_model, build_tokenizer, warm_start

    tokenizer = build_tokenizer(seed=0)
    model = build_model(tokenizer, seed=0)
    stats = warm_start(model, tokenizer, seed=0, steps=16)
    assert stats["arith_loss_last"] < stats["arith_loss_first"], stats
    tokenizer.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    saved, loaded = model.state_dict(), again.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
