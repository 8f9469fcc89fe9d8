"""The test layers hold: ``make test-fast`` (the Makefile's ``FAST_LAYER`` selection) selects no test
that starts the session's vLLM server or Chromium (docs/testing.md)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess

import pytest

from tests.conftest import COLLECTED_SUITE, PYTHON, REPO, starts_chromium
from tests.layer_report import collected_record


def _fast_layer_excludes() -> list[str]:
    """The markers ``FAST_LAYER`` leaves out (``not a and not b ...``), read from the Makefile."""
    return re.findall(r"not (\w+)", _makefile_variable("FAST_LAYER"))


def _makefile_variable(name: str) -> str:
    """The value of ``NAME := value`` in the Makefile."""
    return re.search(rf"^{name} := (.+)$", (REPO / "Makefile").read_text(), re.M).group(1)


def test_no_fast_layer_test_starts_vllm_or_a_browser(request):
    excludes = _fast_layer_excludes()
    assert set(excludes) == {"vllm", "slow", "browser", "installs", "faults"}, excludes
    leaks = [
        item.nodeid
        for item in request.session.items
        if not any(item.get_closest_marker(name) for name in excludes)
        and ("vllm_server" in item.fixturenames or starts_chromium(item))
    ]
    assert not leaks, leaks


def test_browser_and_vllm_markers_follow_what_a_test_uses(request):
    """Checked on tests known to drive each (when they are collected in this session)."""
    by_id = {item.nodeid: item for item in request.session.items}
    known = {
        "tests/test_run_form_browser.py::test_choosing_a_dataset_previews_its_columns_and_rows": "browser",
        "tests/test_vllm_smoke.py::test_token_id_prompt_returns_token_ids_and_logprobs": "vllm",
    }
    for nodeid, marker in known.items():
        if nodeid in by_id:
            assert by_id[nodeid].get_closest_marker(marker), (nodeid, marker)
    assert not by_id[request.node.nodeid].get_closest_marker("browser")


def test_make_tests_phases_run_every_test_exactly_once():
    """``make test`` runs FAST_LAYER beside ``faults``, then HEAVY_SHARED beside HEAVY_SIDE: whatever
    markers a test has, exactly one phase selects it (checked over every combination of the layer
    markers), and the heavy phases together are HEAVY_LAYER."""
    makefile = (REPO / "Makefile").read_text()
    names = ("FAST_LAYER", "HEAVY_SHARED", "HEAVY_SIDE")
    phases = [_makefile_variable(name) for name in names]
    assert all(f'-m "$({name})"' in makefile for name in names) and "-m faults" in makefile
    phases.append("faults")
    markers = ("vllm", "slow", "browser", "installs", "faults", "shared_state")
    for phase in phases:
        assert set(re.findall(r"\w+", phase)) - {"and", "or", "not"} <= set(markers), phase
    heavy = _makefile_variable("HEAVY_LAYER")
    for present in itertools.product((False, True), repeat=len(markers)):
        values = dict(zip(markers, present, strict=True))
        chosen = [p for p in phases if eval(p, {}, values)]  # noqa: S307 (the Makefile's own marker expressions)
        assert len(chosen) == 1, (values, chosen)
        in_heavy = any(eval(_makefile_variable(n), {}, values) for n in names[1:])  # noqa: S307
        assert in_heavy == eval(heavy, {}, values), values  # noqa: S307


class _Markers(dict):
    """A test's markers as the names of a ``-m`` expression: a marker it lacks reads False."""

    def __missing__(self, name: str) -> bool:
        return False


def _selected(items: list[dict], expression: str) -> list[dict]:
    """The tests ``pytest -m EXPRESSION`` selects (names are markers; and, or, not, parentheses)."""
    return [i for i in items if eval(expression, {}, _Markers(dict.fromkeys(i["markers"], True)))]  # noqa: S307


@pytest.fixture(scope="module")
def collected(request, tmp_path_factory) -> list[dict]:
    """Every test of the suite with its markers and fixtures: as this session collected them before
    ``-m`` selected (``COLLECTED_SUITE``, when it collected the whole suite, as make's sessions do), else
    from one ``--collect-only`` run as make runs pytest (tests/layer_report.py writes them)."""
    if COLLECTED_SUITE in request.config.stash:
        return [collected_record(item) for item in request.config.stash[COLLECTED_SUITE]]
    report = tmp_path_factory.mktemp("layers") / "items.jsonl"
    done = subprocess.run(
        [PYTHON, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "tests.layer_report"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "GRPO_LAYER_REPORT": str(report)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in report.read_text().splitlines()]


@pytest.mark.parametrize(
    ("selection", "present", "absent"),
    [
        (
            "HEAVY_SIDE",
            "test_dashboard_soak.py::test_page_stays_connected_through_silences",
            "test_weight_sync.py",
        ),
        ("faults", "faults/test_run_faults.py::test_trainer_and_vllm_killed", "test_worker_killed.py"),
    ],
)
def test_the_sessions_beside_the_suite_server_tests_use_nothing_machine_wide(
    collected, selection, present, absent
):
    """What ``make test`` runs beside the suite-server tests (``HEAVY_SIDE``, and the faults beside the
    fast layer, selected as make selects them) uses neither the suite's vLLM server nor a plugin
    install: the ``shared_state`` marker follows the fixtures, so a new test that trains on the
    suite's server cannot land there. The faults restart Postgres and Redis, so make gives them their
    own (tests/private_services.py)."""
    expression = selection if selection == "faults" else _makefile_variable(selection)
    chosen = _selected(collected, expression)
    ids = "\n".join(item["nodeid"] for item in chosen)
    assert present in ids and absent not in ids and "test_demo_learning.py" not in ids
    for item in chosen:
        used = {"vllm_server", "session_server", "acme_installed"} & set(item["fixtures"])
        assert not used, (item["nodeid"], used)
    if selection == "faults":
        makefile = (REPO / "Makefile").read_text()
        assert re.search(
            r"-m tests\.private_services -- \$\(PY\) -m pytest [^\n]*-m faults tests/faults", makefile
        )
        # make collects only tests/faults for them (a whole collection costs ~15 s of a loaded box)
        assert all(item["nodeid"].startswith("tests/faults/") for item in chosen), ids
