"""Several vLLM servers for one run, the parts that need no server: the URL list, the combined settings
and load the rollout loop reads, the request routing, and the run document's ``resources.vllm.servers``
(its shape here; the API's checks and the claim in tests/test_resources.py). The live runs over two real
servers: tests/test_several_servers.py."""

from __future__ import annotations

import pytest

from trainer.config.resources import parse_resources, resources_errors
from trainer.config.run_schema import args_errors
from trainer.processes.server_checks import server_urls
from trainer.reporting.metrics import MetricWindow
from trainer.rollout.server_pool import VLLMServerPool, combined_load, combined_settings, server_label
from trainer.rollout.vllm_client import ServerLoad, ServerSettings, VLLMClient, VLLMRequestError

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8001"


def test_server_urls_reads_one_or_several_comma_separated():
    assert server_urls("http://localhost:8000/") == ["http://localhost:8000"]
    assert server_urls(f" {A}, {B}/ ,") == [A, B]
    assert server_urls("") == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (f"{A},{B}", None),
        (f"{A},10.0.0.2:8000", "'10.0.0.2:8000': must start with http:// or https://"),
        (f"{A},{A}/", "names a server twice"),
        (" , ", "names no server"),
    ],
)
def test_the_config_names_the_bad_url_of_a_list(value, message):
    errors = args_errors({"vllm_server_base_url": value})
    if message is None:
        assert "vllm_server_base_url" not in errors, errors
    else:
        assert message in errors["vllm_server_base_url"], errors


def _settings(**overrides) -> ServerSettings:
    base = dict(
        max_model_len=4096, kv_cache_tokens=100_000, dtype="bfloat16", logprobs_mode="processed_logprobs"
    )
    return ServerSettings(**{**base, **overrides})


def test_combined_settings_are_what_every_server_allows():
    combined = combined_settings(
        [
            _settings(return_sampling_mask=True, scale_out=True, priority_scheduling=True, max_logprobs=20),
            _settings(max_model_len=2048, kv_cache_tokens=50_000, data_parallel_size=2, max_logprobs=8),
        ],
        [A, B],
    )
    assert combined.max_model_len == 2048  # the shortest context: every request must fit any server
    assert combined.kv_cache_tokens == 150_000 and combined.data_parallel_size == 3
    assert not combined.return_sampling_mask and not combined.scale_out and not combined.priority_scheduling
    assert combined.max_logprobs == 8
    # one server without KV capacity in its /metrics: the cap starts at max_concurrent_rollouts
    assert combined_settings([_settings(), _settings(kv_cache_tokens=None)], [A, B]).kv_cache_tokens is None
    # a CPU server whose seeded requests crash makes the pool send none
    crashing = _settings(device="cpu", chunked_prefill=True)
    assert combined_settings([_settings(device="cuda"), crashing], [A, B]).seeded_requests_crash


def test_servers_that_would_train_differently_are_refused_naming_both():
    with pytest.raises(VLLMRequestError) as caught:
        combined_settings([_settings(), _settings(dtype="float32")], [A, B])
    assert A in str(caught.value) and B in str(caught.value) and "dtype" in str(caught.value)


def test_combined_load_takes_the_fullest_cache_and_sums_the_queues():
    loads = [
        ServerLoad(kv_cache_usage=0.2, running=3, waiting=0, preemptions_total=1, kv_cache_tokens=10),
        None,  # a server that did not answer this poll
        ServerLoad(kv_cache_usage=0.7, running=5, waiting=2, preemptions_total=4, kv_cache_tokens=30),
    ]
    load = combined_load(loads)
    assert (load.kv_cache_usage, load.running, load.waiting, load.preemptions_total) == (0.7, 8, 2, 5)
    assert load.kv_cache_tokens == 40
    assert combined_load([None, None]) is None


def _pool() -> VLLMServerPool:
    return VLLMServerPool([VLLMClient(url, "m") for url in (A, B, C)])


def test_requests_go_to_the_server_with_the_fewest_outstanding_round_robin_on_ties():
    pool = _pool()
    assert sorted(pool.pick() for _ in range(3)) == [0, 1, 2]  # ties: each in turn
    pool.outstanding = [4, 1, 2]
    assert {pool.pick() for _ in range(6)} == {1}


def test_a_server_over_its_kv_cap_gets_nothing_while_another_is_under():
    pool = _pool()
    pool.outstanding = [0, 5, 5]
    full = ServerLoad(kv_cache_usage=0.95, running=9, waiting=4, preemptions_total=0)
    roomy = ServerLoad(kv_cache_usage=0.3, running=5, waiting=0, preemptions_total=0)
    pool.loads = [full, roomy, roomy]
    assert {pool.pick() for _ in range(6)} == {1, 2}
    pool.loads = [full, full, full]  # all full: the fewest outstanding again
    assert {pool.pick() for _ in range(6)} == {0}


def test_the_pool_reports_each_servers_requests_and_cache():
    pool = _pool()
    pool.completed = [3, 0, 1]
    pool.loads = [ServerLoad(0.5, 1, 0, 0), None, ServerLoad(0.25, 1, 0, 0)]
    window = MetricWindow()
    pool.record_metrics(window)
    logs = window.reduce()
    label = server_label(A)
    assert label == "10.0.0.1:8000"
    assert logs[f"rollout/server/{label}/request_count"] == 3
    assert logs[f"rollout/server/{server_label(B)}/request_count"] == 0
    assert logs[f"rollout/server/{label}/kv_cache_usage_frac"] == 0.5
    assert f"rollout/server/{server_label(B)}/kv_cache_usage_frac" not in logs
    assert pool.completed == [0, 0, 0]  # counted once


def test_the_pool_sets_the_loops_switches_on_every_server():
    pool = _pool()
    pool.send_seeds = False
    pool.use_sampling_mask = True
    assert all(not c.send_seeds and c.use_sampling_mask for c in pool.clients)
    assert pool.base_url == f"{A},{B},{C}"


@pytest.mark.parametrize(
    ("block", "field", "message"),
    [
        ({"vllm": {"servers": "a"}}, "resources.vllm.servers", "must be a list"),
        ({"vllm": {"servers": []}}, "resources.vllm.servers", "must be a list"),
        ({"vllm": {"servers": ["a", "a"]}}, "resources.vllm.servers", "names a server twice"),
        ({"vllm": {"servers": ["a", "b"], "gpus": 2}}, "resources.vllm", "gpus would configure one"),
        (
            {"vllm": {"servers": ["a", "b"]}, "server": "a"},
            "resources.vllm",
            "not used with resources.server",
        ),
    ],
)
def test_resources_vllm_servers_shape_errors_name_the_field(block, field, message):
    errors = resources_errors(block)
    assert message in errors.get(field, ""), errors


def test_resources_vllm_servers_parse_to_the_named_servers_in_order():
    resources = parse_resources({"vllm": {"servers": ["b", "a"]}, "trainer": {"processes": 2}})
    assert resources.servers == ("b", "a") and resources.server == "b"
    assert resources.servers_field == "resources.vllm.servers"
    assert resources.vllm_gpus_on(gpu_host=True) == 0  # running servers: no GPU of this run's worker
    single = parse_resources({"server": "a"})
    assert single.servers == ("a",) and single.servers_field == "resources.server"
    assert parse_resources(None).servers == ()
