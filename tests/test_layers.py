"""The test layers hold: ``make test-fast`` (the Makefile's ``FAST_LAYER`` selection) selects no test
that starts the session's vLLM server or Chromium (docs/testing.md)."""

from __future__ import annotations

import itertools
import re

from tests.conftest import REPO, starts_chromium


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
    """``make test`` runs FAST_LAYER, then HEAVY_LAYER, then ``faults``: whatever markers a test has,
    exactly one phase selects it (checked over every combination of the layer markers)."""
    makefile = (REPO / "Makefile").read_text()
    phases = [_makefile_variable(name) for name in ("FAST_LAYER", "HEAVY_LAYER")]
    assert (
        all(f'-m "$({name})"' in makefile for name in ("FAST_LAYER", "HEAVY_LAYER"))
        and "-m faults" in makefile
    )
    phases.append("faults")
    markers = ("vllm", "slow", "browser", "installs", "faults")
    for phase in phases:
        assert set(re.findall(r"\w+", phase)) - {"and", "or", "not"} <= set(markers), phase
    for present in itertools.product((False, True), repeat=len(markers)):
        values = dict(zip(markers, present, strict=True))
        chosen = [p for p in phases if eval(p, {}, values)]  # noqa: S307 (the Makefile's own marker expressions)
        assert len(chosen) == 1, (values, chosen)
