"""A pytest plugin for tests/test_layers.py: with ``GRPO_LAYER_REPORT=<file>``, a collection writes
every collected test's markers (those the conftest gives from fixtures included) and fixtures
(transitively) as JSON lines, so one ``--collect-only`` serves every selection the test checks."""

from __future__ import annotations

import json
import os

import pytest


def collected_record(item: pytest.Item) -> dict:
    """What tests/test_layers.py reads of one test: its nodeid, markers and (transitive) fixtures."""
    markers = sorted({mark.name for mark in item.iter_markers()})
    return {"nodeid": item.nodeid, "markers": markers, "fixtures": sorted(getattr(item, "fixturenames", ()))}


def pytest_collection_finish(session: pytest.Session) -> None:
    path = os.environ.get("GRPO_LAYER_REPORT")
    if not path:
        return
    with open(path, "w") as out:
        for item in session.items:
            out.write(json.dumps(collected_record(item)) + "\n")
