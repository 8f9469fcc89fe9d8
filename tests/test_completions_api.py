"""The completions table's API (issue 22, item 2): ``GET /api/v1/runs/<id>/completions/`` searched,
filtered by reward / group / mixed or zero-advantage groups and sorted on the server, ``?by=group``
pages of whole groups, ``completions/steps/``, the reference answer from the trainer's record to the
API row; bad parameters are 400 naming the parameter. Real Postgres, no worker.
"""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
from django.test import override_settings

from controlplane.runs import selectors
from controlplane.runs.models import CompletionSample
from controlplane.runs.services import ingest
from tests.test_run_downloads import api_for, make_run, make_user

pytestmark = pytest.mark.django_db

# Per step: four groups of G=3. Group 4s+0 mixed rewards (0, 0.5, 1), 4s+1 all 1.0 (advantage 0),
# 4s+2 all 0.0 (advantage 0), 4s+3 mixed (0.25, 0.75, 0.75); the "needle" is in one completion.
STEPS = 5


def _items(step: int) -> list[dict]:
    rewards = {0: (0.0, 0.5, 1.0), 1: (1.0, 1.0, 1.0), 2: (0.0, 0.0, 0.0), 3: (0.25, 0.75, 0.75)}
    items = []
    for g, values in rewards.items():
        mean = sum(values) / 3
        for k, reward in enumerate(values):
            items.append(
                {
                    "prompt": f"step {step} group {g}: what is {g}+{step}?",
                    "completion": "a NEEDLE here" if (step, g, k) == (3, 0, 2) else f"answer {k}",
                    "reward": reward,
                    "rewards": {"accuracy": reward, "format": 0.5},
                    "advantage": reward - mean,
                    "group_id": step * 4 + g,
                    "row_index": g,
                    "reference": str(g + step) if g != 2 else None,
                }
            )
    return items


@pytest.fixture
def alice():
    return make_user("alice")


@pytest.fixture
def run(alice):
    run = make_run(alice)
    for step in range(1, STEPS + 1):
        ingest.completion_samples_ingest(run_id=run.pk, step=step, items=_items(step))
    return run


def get(user, run, query: str = "") -> dict:
    response = api_for(user).get(f"/api/v1/runs/{run.pk}/completions/{query}")
    assert response.status_code == 200, response.content
    return response.json()


def test_reference_answer_from_the_trainer_record_to_the_api_row(alice, run):
    from trainer.rollout.groups import completion_records, reference_answer
    from trainer.rollout.scoring import GroupScore
    from trainer.rollout.types import RolloutGroup

    def group_of(row: dict) -> RolloutGroup:
        return RolloutGroup(
            prompts=[[{"role": "user", "content": "2+2?"}]] * 2,
            reward_kwargs={k: [v] * 2 for k, v in row.items() if k != "prompt"},
            completions=[[{"role": "assistant", "content": c}] for c in ("4", "5")],
            completions_ids=[[1], [2]],
            completions_sequences=[[], []],
            tool_call_counts=[0, 0],
            tool_failure_counts=[0, 0],
            model_version=0,
            group_id=7,
            row_index=3,
            env_rewards=[None, None],
            rollout_rewards=[None, None],
        )

    score = GroupScore(rewards=np.array([1.0, 0.0]), per_source={"accuracy": np.array([1.0, 0.0])}, kept=True)
    records = completion_records(
        group_of({"prompt": "2+2?", "answer": "4", "target": "x"}), score, np.array([1.0, -1.0])
    )
    assert [r["reference"] for r in records] == ["4", "4"]  # "answer" comes before "target"
    assert records[0]["rewards"] == {"accuracy": 1.0} and records[1]["advantage"] == -1.0
    assert (
        completion_records(group_of({"prompt": "2+2?", "level": 1}), score, np.zeros(2))[0]["reference"]
        is None
    )
    assert (
        reference_answer({"solution": 12}) == "12"
        and reference_answer({"ground_truth": ["a", "b"]}) == '["a", "b"]'
    )
    assert reference_answer({"answer": None, "target": "t"}) == "t"

    # Stored and served: the API row and the download carry it ("" when the row had none).
    ingest.completion_samples_ingest(run_id=run.pk, step=99, items=records)
    rows = get(alice, run, "?step=99")["results"]
    assert [r["reference"] for r in rows] == ["4", "4"] and "reference" in selectors.COMPLETION_FIELDS
    assert CompletionSample.objects.get(run=run, step=1, index=6).reference == ""  # group 2: None
    csv_rows = list(
        csv.DictReader(
            io.StringIO(
                b"".join(
                    api_for(alice)
                    .get(f"/api/v1/runs/{run.pk}/completions/?format=csv&step=99")
                    .streaming_content
                ).decode()
            )
        )
    )
    assert [r["reference"] for r in csv_rows] == ["4", "4"]


def test_search_sort_and_filters_on_samples(alice, run):
    # q: case-insensitive over prompt and completion, on the server.
    hits = get(alice, run, "?q=needle")["results"]
    assert [(h["step"], h["group_id"], h["index"]) for h in hits] == [(3, 12, 2)]
    assert get(alice, run, "?q=GROUP 3: WHAT")["count"] == 3 * STEPS
    # Sort by reward (desc: highest first, ties newest step first) and by advantage (asc).
    by_reward = get(alice, run, "?ordering=-reward&page_size=100")["results"]
    assert [r["reward"] for r in by_reward] == sorted((r["reward"] for r in by_reward), reverse=True)
    assert by_reward[0]["step"] == STEPS
    by_adv = get(alice, run, "?ordering=advantage&page_size=100")["results"]
    assert [r["advantage"] for r in by_adv] == sorted(r["advantage"] for r in by_adv)
    oldest = get(alice, run, "?ordering=step")["results"]
    assert (oldest[0]["step"], oldest[0]["index"]) == (1, 0)
    # Reward range, group id.
    ranged = get(alice, run, "?reward_min=0.4&reward_max=0.8&page_size=100")["results"]
    assert ranged and all(0.4 <= r["reward"] <= 0.8 for r in ranged)
    assert {r["index"] for r in get(alice, run, "?group_id=9")["results"]} == {3, 4, 5}
    # Whole groups in SQL: mixed (rewards not all equal), zero-advantage.
    mixed = get(alice, run, "?groups=mixed&page_size=100")["results"]
    assert {r["group_id"] % 4 for r in mixed} == {0, 3} and len(mixed) == 6 * STEPS
    zero = get(alice, run, "?groups=zero_advantage&page_size=100")["results"]
    assert {r["group_id"] % 4 for r in zero} == {1, 2}
    # The downloads take the same filters.
    body = b"".join(
        api_for(alice)
        .get(f"/api/v1/runs/{run.pk}/completions/?format=json&groups=mixed&step=2")
        .streaming_content
    )
    assert {c["group_id"] for c in json.loads(body)} == {8, 11}


def test_groups_are_paged_whole(alice, run):
    seen: list[tuple[int, int]] = []
    page = 1
    while True:
        body = get(alice, run, f"?by=group&page_size=3&page={page}")
        assert body["count"] == 4 * STEPS
        for group in body["results"]:
            seen.append((group["step"], group["group_id"]))
            stored = CompletionSample.objects.filter(run=run, step=group["step"], group_id=group["group_id"])
            assert group["size"] == len(group["rollouts"]) == stored.count() == 3  # never cut
            assert group["prompt"] == group["rollouts"][0]["prompt"]
        if not body["next"]:
            break
        page += 1
    # Newest group first, each once.
    assert seen == sorted(set(seen), reverse=True) and len(seen) == 4 * STEPS
    first = get(alice, run, "?by=group&page_size=1")["results"][0]
    assert first["reference"] == str(3 + STEPS) and first["rollouts"][0]["rewards"] == {
        "accuracy": 0.25,
        "format": 0.5,
    }
    assert first["mixed"] and first["reward_min"] == 0.25 and first["reward_max"] == 0.75


def test_group_filters_search_and_sort(alice, run):
    mixed = get(alice, run, "?by=group&groups=mixed&page_size=100")
    assert mixed["count"] == 2 * STEPS and all(g["mixed"] for g in mixed["results"])
    zero = get(alice, run, "?by=group&groups=zero_advantage&page_size=100")
    assert zero["count"] == 2 * STEPS and not any(g["mixed"] for g in zero["results"])
    # A search keeps the groups with a hit and returns them whole, the hit marked.
    hit = get(alice, run, "?by=group&q=needle")
    assert hit["count"] == 1
    group = hit["results"][0]
    assert (group["step"], group["group_id"], group["matches"]) == (3, 12, 1)
    assert [r["match"] for r in group["rollouts"]] == [False, False, True]
    # Sorted by the group's mean reward, its rollouts by reward too.
    best = get(alice, run, "?by=group&ordering=-reward&page_size=100")["results"]
    means = [g["reward_mean"] for g in best]
    assert means == sorted(means, reverse=True) and best[0]["reward_mean"] == 1.0
    assert [r["reward"] for r in best[-1]["rollouts"]] == [0.0, 0.0, 0.0]
    low_first = get(alice, run, "?by=group&ordering=reward&groups=mixed&step=1")["results"]
    assert [g["group_id"] for g in low_first] == [4, 7]
    assert [r["reward"] for r in low_first[0]["rollouts"]] == [0.0, 0.5, 1.0]
    # Reward range on groups: a group with one rollout in range is kept whole.
    ranged = get(alice, run, "?by=group&reward_min=0.5&reward_max=0.5")
    assert ranged["count"] == STEPS and all(g["matches"] == 1 and g["size"] == 3 for g in ranged["results"])
    assert get(alice, run, "?by=group&group_id=6")["results"][0]["rollouts"][0]["reward"] == 0.0
    oldest = get(alice, run, "?by=group&ordering=step")["results"][0]
    assert (oldest["step"], oldest["group_id"]) == (1, 4)


def test_steps_endpoint_lists_every_step(alice, run):
    ingest.completion_samples_ingest(run_id=run.pk, step=40, items=_items(40)[:2])
    body = api_for(alice).get(f"/api/v1/runs/{run.pk}/completions/steps/").json()
    assert body["steps"][0] == {"step": 40, "samples": 2}
    assert [s["step"] for s in body["steps"]] == [40, 5, 4, 3, 2, 1]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?ordering=loss", "ordering"),
        ("?by=prompt", "by"),
        ("?groups=uniform", "groups"),
        ("?reward_min=abc", "reward_min"),
        ("?reward_min=nan", "reward_min"),
        ("?reward_max=inf", "reward_max"),
        ("?reward_min=1&reward_max=0", "reward_min"),
        ("?group_id=1.5", "group_id"),
        ("?group_id=99999999999999999999", "group_id"),
        ("?step=-1", "step"),
        ("?by=group&page_size=101", "page_size"),
        ("?q=" + "x" * 201, "q"),
        ("?q=a%00b", "q"),
    ],
)
def test_bad_parameters_are_400_naming_them(alice, run, query, field):
    response = api_for(alice).get(f"/api/v1/runs/{run.pk}/completions/{query}")
    assert response.status_code == 400 and field in response.json(), (query, response.content)


def test_search_length_is_a_setting(alice, run):
    with override_settings(GRPO_COMPLETION_SEARCH_MAX_CHARS=5):
        bad = api_for(alice).get(f"/api/v1/runs/{run.pk}/completions/?q=needle")
        assert bad.status_code == 400 and "at most 5 characters" in bad.json()["q"][0]
    with override_settings(GRPO_COMPLETION_GROUPS_PAGE_SIZE=2):
        assert len(get(alice, run, "?by=group")["results"]) == 2


def test_another_users_run_is_not_found(alice, run):
    bob = api_for(make_user("bob"))
    for path in ("completions/?by=group", "completions/?groups=mixed&q=x", "completions/steps/"):
        assert bob.get(f"/api/v1/runs/{run.pk}/{path}").status_code == 404, path
    from rest_framework.test import APIClient

    assert APIClient().get(f"/api/v1/runs/{run.pk}/completions/steps/").status_code in (401, 403)
