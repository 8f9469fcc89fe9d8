"""``trainer/`` keeps its rooms (issue 33 item 1): every module lives in a sub-package by concern.

Flat at the top of ``trainer/`` are only the package itself, its command line and the public
dotted names that run documents and the spec's imports use (``trainer.rewards.accuracy_reward``,
``trainer.builtin_tools.add``). A new module goes into the room of its concern (docs/architecture.md,
"Where each concern lives"); a new room is a package with a docstring that says what it holds.
Read from the file tree (nothing imported).
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO

TRAINER = REPO / "trainer"
# The only modules allowed flat in trainer/, each with the reason it is there.
FLAT_MODULES = {
    "__init__.py": "the public API (AsyncGRPOTrainer, AsyncGRPOConfig, ...)",
    "__main__.py": "python -m trainer tiny|serve|train",
    "rewards.py": "public dotted names: trainer.rewards.<fn> (the spec's import, run documents)",
    "builtin_tools.py": "public dotted names: trainer.builtin_tools.add/subtract/multiply (run documents)",
}
# Folders of trainer/ that are data, not rooms.
DATA_FOLDERS = {"tiny_model", "__pycache__"}
ROOMS = {
    "config",
    "plugins",
    "processes",
    "reporting",
    "rollout",
    "step",
    "tasks",
    "tiny",
    "trainer",
    "weight_sync",
}


def flat_modules(package: Path) -> set[str]:
    """The Python modules directly in ``package`` (not in a sub-package)."""
    return {p.name for p in package.iterdir() if p.is_file() and p.suffix == ".py"}


def rooms_without_init(package: Path) -> set[str]:
    """Sub-folders of ``package`` (data folders aside) that are not packages."""
    return {
        p.name
        for p in package.iterdir()
        if p.is_dir() and p.name not in DATA_FOLDERS and not (p / "__init__.py").is_file()
    }


def test_trainer_has_no_flat_module_outside_the_allow_list():
    extra = flat_modules(TRAINER) - set(FLAT_MODULES)
    assert not extra, (
        f"flat modules in trainer/: {sorted(extra)}; move each into the room of its concern "
        f"({', '.join(sorted(ROOMS))}; docs/architecture.md)"
    )
    assert set(FLAT_MODULES) <= flat_modules(TRAINER)


def test_every_room_is_a_package_with_a_docstring():
    assert not rooms_without_init(TRAINER)
    rooms = {p.name for p in TRAINER.iterdir() if p.is_dir() and p.name not in DATA_FOLDERS}
    assert rooms == ROOMS, (
        f"a new room of trainer/: give it a line in docs/architecture.md and in ROOMS ({__file__})"
    )
    for room in sorted(ROOMS):
        assert (TRAINER / room / "__init__.py").read_text().lstrip().startswith('"""'), room
    # The shipped build of the tiny model stays where the package data and trainer/tiny/build.py expect it.
    assert (TRAINER / "tiny_model" / "tiny_build.json").is_file()


def test_a_planted_flat_module_is_caught(tmp_path):
    package = tmp_path / "trainer"
    package.mkdir()
    for name in FLAT_MODULES:
        (package / name).write_text("")
    (package / "step").mkdir()
    (package / "step" / "__init__.py").write_text('"""A room."""\n')
    assert flat_modules(package) - set(FLAT_MODULES) == set()
    (package / "helpers.py").write_text("")
    assert flat_modules(package) - set(FLAT_MODULES) == {"helpers.py"}
    (package / "loose").mkdir()
    (package / "loose" / "thing.py").write_text("")
    assert rooms_without_init(package) == {"loose"}
