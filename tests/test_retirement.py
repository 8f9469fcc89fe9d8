"""Retiring saturated prompts (``retire_saturated_prompts``, issue 34 item 2): the rule, what the
trainer keeps in ``rollout_state.json`` and the config field. The live loop skipping retired rows is
``tests/test_rollout_live.py::test_saturated_prompts_are_retired_and_skipped_from_then_on``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.processes.rollout_state import read_retired_rows, read_rollout_state, write_rollout_state
from trainer.reporting.metrics import ROLLOUT_RETIRED_FRACTION, ROLLOUT_RETIRED_PROMPTS, MetricWindow
from trainer.rollout.retirement import PromptRetirement, is_saturated, prompt_key
from trainer.rollout.types import GroupResult

SAME = np.array([1.0, 1.0, 1.0, 1.0])
VARIED = np.array([0.0, 1.0, 0.0, 1.0])


def test_saturation_needs_two_scored_rollouts_with_one_reward():
    assert is_saturated(SAME) and is_saturated(np.array([0.5, math.nan, 0.5]))
    assert not is_saturated(VARIED)
    assert not is_saturated(np.array([1.0, math.nan, math.nan]))  # one scored rollout says nothing


def row(text: str, **extra) -> dict:
    return {"prompt": [{"role": "user", "content": text}], **extra}


def test_a_prompt_retires_after_n_saturated_groups_in_a_row_and_a_varied_one_resets_the_count():
    rule = PromptRetirement(3, num_rows=10)
    q = row("2+2?")
    assert not rule.skips(prompt_key(q)) and not rule.skips(prompt_key(row("3+3?")))
    assert [rule.record(4, prompt_key(q), SAME), rule.record(4, prompt_key(q), SAME)] == [False, False]
    assert rule.record(4, prompt_key(q), VARIED) is False  # the run is broken: start again
    assert [rule.record(4, prompt_key(q), SAME) for _ in range(3)] == [False, False, True]
    assert rule.record(4, prompt_key(q), SAME) is False  # retired once
    assert rule.skips(prompt_key(q)) and not rule.skips(prompt_key(row("3+3?")))
    window = MetricWindow()
    rule.record_metrics(window)
    assert window.reduce()[ROLLOUT_RETIRED_PROMPTS] == 1
    assert window.reduce()[ROLLOUT_RETIRED_FRACTION] == pytest.approx(0.5)  # of the 2 prompts seen


def test_rows_that_ask_the_same_prompt_count_and_retire_together():
    """The demo's rows repeat a few dozen problems: its groups saturate per problem, not per row."""
    rule = PromptRetirement(2, num_rows=6)
    same = [row("7*6?", answer="42", level=1), row("7*6?", answer="42", level=1), row("7*6?")]
    assert (
        rule.record(0, prompt_key(same[0]), SAME) is False
        and rule.record(1, prompt_key(same[1]), SAME) is True
    )
    assert all(rule.skips(prompt_key(r)) for r in same)  # every row of the prompt, whatever its other columns
    assert not rule.skips(prompt_key(row("7*7?"))) and not rule.skips(
        prompt_key({"prompt": "7*6? "})
    )  # another text
    # Without a prompt column (an environment builds it), the whole row is the prompt.
    assert prompt_key({"task": 1}) == prompt_key({"task": 1}) != prompt_key({"task": 2})
    assert rule.retired == {prompt_key(same[0]): 1}  # the row that retired it, for rollout_state.json


def test_when_every_prompt_is_retired_they_all_come_back_once():
    rule = PromptRetirement(1, num_rows=3)
    rows = [row("a"), row("b"), row("a")]
    assert not any(rule.skips(prompt_key(r)) for r in rows)  # a whole pass: the dataset holds two prompts
    assert rule.record(0, prompt_key(rows[0]), SAME) and rule.record(1, prompt_key(rows[1]), SAME)
    assert rule.skips(prompt_key(rows[0])) is False  # all retired: nothing could train, so all return
    assert rule.retired == {} and rule.take_restored() and not rule.take_restored()
    assert rule.record(0, prompt_key(rows[0]), SAME)  # counted again from zero


def test_before_a_whole_pass_unseen_rows_may_still_train():
    rule = PromptRetirement(1, num_rows=3)
    assert not rule.skips(prompt_key(row("a"))) and rule.record(0, prompt_key(row("a")), SAME)
    assert rule.skips(prompt_key(row("a")))  # the one prompt seen is retired, but rows 1 and 2 are unseen
    assert not rule.take_restored()


def test_off_by_default():
    rule = PromptRetirement(None, num_rows=4, retired=[(1, row("a"))])
    assert not rule.enabled and rule.retired == {}
    off = rule.key_of(row("a"))  # what the dispatcher passes while retirement is off
    assert not any(rule.record(0, off, SAME) for _ in range(5)) and not rule.skips(off)
    window = MetricWindow()
    rule.record_metrics(window)
    assert not window  # nothing logged when off


def test_a_resume_keeps_the_retired_prompts(tmp_path):
    write_rollout_state(tmp_path, 37, list(range(10)), {"num_tokens": 5.0}, retired_rows={7, 2})
    assert read_rollout_state(tmp_path) == 37 and read_retired_rows(tmp_path) == [2, 7]
    assert read_retired_rows(tmp_path / "missing") == []
    dataset = [row(f"q{i % 5}") for i in range(10)]  # rows 2 and 7 ask the same prompt
    rule = PromptRetirement(2, num_rows=10, retired=[(r, dataset[r]) for r in read_retired_rows(tmp_path)])
    assert (
        len(rule.retired) == 1 and rule.skips(prompt_key(dataset[2])) and rule.skips(prompt_key(dataset[7]))
    )
    assert not rule.skips(prompt_key(dataset[3]))


def test_the_trainer_feed_keeps_what_the_results_retire_and_restore():
    from trainer.rollout.flow import StalenessPolicy
    from trainer.step.feed import RolloutFeed

    feed = RolloutFeed(
        next_group=None,
        model_version=lambda: 0,
        token_budget=None,
        num_rows=1,
        staleness=StalenessPolicy(max_staleness=1),
        num_top_logprobs=None,
        start_position=0,
        window=MetricWindow(),
    )
    feed._receive(GroupResult(position=0, row_index=3, group_id=0, kind="dropped", retired=True))
    feed._receive(GroupResult(position=1, row_index=5, group_id=1, kind="dropped", retired=True))
    assert feed.retired_rows == {3, 5}
    feed._receive(GroupResult(position=2, row_index=0, group_id=-1, kind="filtered", restored_all=True))
    assert feed.retired_rows == set()


def test_the_field_is_an_optional_positive_integer_of_the_run_document():
    from trainer.config.async_grpo_config import AsyncGRPOConfig
    from trainer.config.run_config import run_document_errors

    def errors(value) -> dict[str, str]:
        doc = {
            "model": "tiny",
            "train_dataset": "arithmetic",
            "reward_funcs": ["trainer.rewards.accuracy_reward"],
        }
        return run_document_errors({**doc, "args": {"retire_saturated_prompts": value}})

    assert AsyncGRPOConfig(output_dir="x", use_cpu=True).retire_saturated_prompts is None
    assert errors(3) == {} and errors(None) == {}
    assert "args.retire_saturated_prompts" in errors(0)
    assert "args.retire_saturated_prompts" in errors("often")
