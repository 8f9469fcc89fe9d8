"""The test layers hold: ``make test-fast`` (``-m "not vllm and not slow and not browser and not
faults"``) selects no test that starts the session's vLLM server or Chromium (docs/testing.md)."""

from __future__ import annotations

from tests.conftest import _drives_a_browser

FAST_LAYER_EXCLUDES = ("vllm", "slow", "browser", "faults")


def _in_fast_layer(item) -> bool:
    return not any(item.get_closest_marker(name) for name in FAST_LAYER_EXCLUDES)


def test_no_fast_layer_test_starts_vllm_or_a_browser(request):
    items = request.session.items
    leaks = [
        item.nodeid
        for item in items
        if _in_fast_layer(item) and ("vllm_server" in item.fixturenames or _drives_a_browser(item))
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
