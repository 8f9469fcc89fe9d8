"""Every numeric field a run can set has a documented range, enforced in one place
(``trainer/config/config_ranges.py``) and reported per field (issue 17 item 5)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from rest_framework.test import APIClient

from controlplane.runs import services
from controlplane.runs.models import Run
from tests.conftest import REPO
from trainer.config.async_grpo_config import AsyncGRPOConfig, json_kinds
from trainer.config.config_ranges import FIELD_RANGES, ranges_markdown

# The values an attacker's session found accepted and stored as queued runs.
OUT_OF_RANGE = {
    "max_steps": [-5, 0, 2**62],
    "learning_rate": [1e308],
    "num_generations": [2**40],
    "per_device_train_batch_size": [2**62],
    "save_steps": [-10],
    "logging_steps": [-1],
    "num_train_epochs": [-3],
    "dataloader_num_workers": [100000],
}


def numeric_fields() -> list[str]:
    hints = typing.get_type_hints(AsyncGRPOConfig)
    names = []
    for f in dataclasses.fields(AsyncGRPOConfig):
        kinds = json_kinds(hints.get(f.name)) if f.init else None
        if kinds and (int in kinds[0] or float in kinds[0]) and bool not in kinds[0]:
            names.append(f.name)
    return names


def test_every_numeric_field_has_a_range_that_holds_its_default():
    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    missing = sorted(set(numeric_fields()) - set(FIELD_RANGES))
    assert not missing, f"give these a range in trainer/config/config_ranges.py: {missing}"
    assert not set(FIELD_RANGES) - set(fields), "a range for a field that does not exist"
    for name, bounds in FIELD_RANGES.items():
        default = fields[name].default
        if isinstance(default, int | float) and not isinstance(default, bool):
            assert bounds.contains(default), (name, default, bounds.text())


def test_the_readme_shows_the_ranges():
    readme = (REPO / "README.md").read_text()
    start, end = "<!-- ranges:start -->\n", "<!-- ranges:end -->"
    assert start in readme and end in readme
    table = readme.split(start, 1)[1].split(end, 1)[0]
    assert table == ranges_markdown(), (
        "regenerate README's range table: trainer.config.config_ranges.ranges_markdown()"
    )


@pytest.mark.django_db
def test_out_of_range_values_are_400s_naming_each_field_and_store_nothing():
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username="ranger"))
    for field, values in OUT_OF_RANGE.items():
        for value in values:
            config = {
                "model": "tiny",
                "train_dataset": "arithmetic-small",
                "reward_funcs": ["trainer.rewards.accuracy_reward"],
                "args": {field: value},
            }
            response = client.post("/api/v1/runs/", {"config": config}, format="json")
            assert response.status_code == 400, (field, value, response.content[:300])
            message = response.json()["config"][f"args.{field}"]
            assert message.startswith("must be in "), message
    assert Run.objects.count() == 0


def test_python_callers_get_the_same_ranges():
    with pytest.raises(ValueError, match=r"^dataloader_num_workers=100000: must be in \[0, 64\]"):
        AsyncGRPOConfig(output_dir="/tmp/unused", dataloader_num_workers=100000)
