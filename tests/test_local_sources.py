"""A local model or dataset folder named from the web stays inside its allowed root (issue 29 item 2):
every link in it, at any depth and through linked folders, must resolve inside the roots, when the
run is created (``run_document_validate``) and again when the worker launches it
(``local_sources_errors``: a link added since creation). The walk is bounded by
``GRPO_LOCAL_SOURCE_MAX_ENTRIES``, which also ends link cycles. Real files and links in a temporary
folder; the API case is in tests/test_bad_input.py (``dataset-dir-holds-escape``)."""

from __future__ import annotations

import pytest

from controlplane.runs.validation import local_sources_errors, run_document_validate
from trainer.config.run_config import RunConfigError

ROW = '{"prompt": "1+1", "solution": "2"}\n'


def document(dataset: str) -> dict:
    return {
        "model": "tiny",
        "train_dataset": dataset,
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {"max_steps": 1, "max_completion_length": 16},
    }


def refusal(doc: dict) -> str | None:
    try:
        run_document_validate(document=doc)
    except RunConfigError as exc:
        return exc.errors.get("train_dataset")
    return None


@pytest.fixture
def root(settings, tmp_path):
    """An allowed dataset root with a folder of jsonl files, and a secret outside it."""
    allowed, outside = tmp_path / "datasets", tmp_path / "outside"
    (allowed / "data").mkdir(parents=True)
    (allowed / "shared").mkdir()
    outside.mkdir()
    (allowed / "data" / "train.jsonl").write_text(ROW)
    (allowed / "shared" / "extra.jsonl").write_text(ROW)
    (outside / "secret.jsonl").write_text('{"prompt": "secret"}\n')
    settings.GRPO_ALLOWED_DATASET_ROOTS = [str(allowed)]
    return allowed, outside


@pytest.mark.django_db
def test_links_that_stay_inside_the_roots_are_accepted(root):
    allowed, _ = root
    (allowed / "data" / "more.jsonl").symlink_to(allowed / "shared" / "extra.jsonl")
    (allowed / "data" / "shared").symlink_to(allowed / "shared")
    assert refusal(document(str(allowed / "data"))) is None
    assert local_sources_errors(document=document(str(allowed / "data"))) == {}


@pytest.mark.django_db
@pytest.mark.parametrize("depth", ["top", "nested", "through a linked folder"])
def test_a_link_out_of_the_roots_anywhere_in_the_folder_is_refused_naming_it(root, depth):
    allowed, outside = root
    if depth == "top":
        link = allowed / "data" / "leak.jsonl"
    elif depth == "nested":
        (allowed / "data" / "a" / "b").mkdir(parents=True)
        link = allowed / "data" / "a" / "b" / "leak.jsonl"
    else:  # data/shared -> ../shared (inside), and shared/leak.jsonl -> outside
        (allowed / "data" / "shared").symlink_to(allowed / "shared")
        link = allowed / "shared" / "leak.jsonl"
    link.symlink_to(outside / "secret.jsonl")
    message = refusal(document(str(allowed / "data")))
    assert message and "leak.jsonl" in message and "outside the allowed dataset roots" in message, message
    assert "GRPO_ALLOWED_DATASET_ROOTS" in message and "remove the link" in message


@pytest.mark.django_db
def test_the_worker_refuses_a_link_added_after_the_run_was_accepted(root):
    allowed, outside = root
    doc = document(str(allowed / "data"))
    assert refusal(doc) is None  # accepted at creation
    (allowed / "data" / "later.jsonl").symlink_to(outside / "secret.jsonl")
    errors = local_sources_errors(document=doc)
    assert set(errors) == {"train_dataset"} and "later.jsonl" in errors["train_dataset"]
    # Registered names, hub ids and paths outside every root are not the worker's to judge again.
    assert local_sources_errors(document={**doc, "train_dataset": "arithmetic"}) == {}
    assert local_sources_errors(document={**doc, "train_dataset": str(outside)}) == {}


@pytest.mark.django_db
def test_a_folder_of_more_entries_than_the_setting_or_a_link_cycle_is_refused(root, settings):
    allowed, _ = root
    settings.GRPO_LOCAL_SOURCE_MAX_ENTRIES = 5
    for i in range(6):
        (allowed / "data" / f"part{i}.jsonl").write_text(ROW)
    message = refusal(document(str(allowed / "data")))
    assert message and "more than 5" in message and "GRPO_LOCAL_SOURCE_MAX_ENTRIES" in message
    # shared/loop/loop/...: each level adds 2 entries until the kernel's 40-link limit (ELOOP) ends
    # the walk, ~80 in all; the bound stops it first.
    settings.GRPO_LOCAL_SOURCE_MAX_ENTRIES = 50
    (allowed / "shared" / "loop").symlink_to(allowed / "shared")
    message = refusal(document(str(allowed / "shared")))
    assert message and "more than 50" in message
