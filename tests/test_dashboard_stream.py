"""The run stream ``/ws/runs/<id>/`` through the real ASGI application (auth middleware, URL router,
consumer) and the real Redis channel layer, driven by Channels' ``WebsocketCommunicator``.

Producers are the real ingest services: what the supervisor's tailer calls is what reaches the socket.
These tests commit (``transaction=True``) because the consumer reads the run from its own thread and
the services publish on commit.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.asgi import application
from controlplane.runs import services
from controlplane.runs.consumers import CLOSE_NOT_FOUND, CLOSE_UNAUTHENTICATED
from controlplane.runs.models import Run, RunEventKind, RunStatus
from controlplane.runs.services import ingest
from tests.conftest import run_async

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = [(b"origin", b"http://localhost")]


def make_user(name: str):
    return get_user_model().objects.create_user(username=name, password=None)


def make_run(owner, *, max_steps: int = 30) -> Run:
    config = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {"max_steps": max_steps},
    }
    # Stored directly (not run_create): a committed run_create would enqueue a supervisor task.
    return Run.objects.create(owner=owner, name="stream test", config=config, config_sha256="0" * 64)


async def open_socket(path: str, headers: list | None = None) -> tuple[WebsocketCommunicator, dict | int]:
    """Connect; returns the communicator and the first message, or the close code."""
    comm = WebsocketCommunicator(application, path, headers=ORIGIN + (headers or []))
    connected, _ = await comm.connect(timeout=10)
    assert connected  # the handshake is accepted; refusals are close codes a client can read
    first = await comm.receive_output(timeout=10)
    if first["type"] == "websocket.close":
        return comm, first["code"]
    return comm, json.loads(first["text"])


def test_anonymous_and_bad_token_sockets_are_closed_4401():
    run = make_run(make_user("alice"))

    async def scenario():
        _, code = await open_socket(f"/ws/runs/{run.pk}/")
        assert code == CLOSE_UNAUTHENTICATED
        _, code = await open_socket(f"/ws/runs/{run.pk}/?token=not-a-token")
        assert code == CLOSE_UNAUTHENTICATED

    run_async(scenario())


def test_token_auth_sees_own_run_status_and_not_others():
    alice, bob = make_user("alice"), make_user("bob")
    run = make_run(alice, max_steps=12)
    ingest.metric_points_ingest(run_id=run.pk, step=3, values={"reward": 0.25})
    alice_token = services.token_issue(username="alice")
    bob_token = services.token_issue(username="bob")

    async def scenario():
        comm, first = await open_socket(f"/ws/runs/{run.pk}/?token={alice_token}")
        assert first["type"] == "status"
        assert first["status"] == "queued" and first["run_id"] == run.pk
        assert first["step"] == 3 and first["max_steps"] == 12
        await comm.disconnect()
        _, code = await open_socket(f"/ws/runs/{run.pk}/?token={bob_token}")
        assert code == CLOSE_NOT_FOUND
        _, code = await open_socket(f"/ws/runs/{run.pk + 1000}/?token={alice_token}")
        assert code == CLOSE_NOT_FOUND

    run_async(scenario())
    assert bob.is_active


def test_session_cookie_authenticates_a_browser_socket():
    alice = make_user("alice")
    run = make_run(alice)
    client = Client()
    client.force_login(alice)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def scenario():
        comm, first = await open_socket(f"/ws/runs/{run.pk}/", headers=[(b"cookie", cookie)])
        assert first == {**first, "type": "status", "status": "queued"}
        await comm.disconnect()

    run_async(scenario())


def test_messages_arrive_in_order_one_per_step_with_every_metric():
    alice = make_user("alice")
    run = make_run(alice)
    token = services.token_issue(username="alice")
    names = [f"ns{i % 5}/metric_{i}" for i in range(50)]
    steps = 20

    async def scenario():
        comm, first = await open_socket(f"/ws/runs/{run.pk}/?token={token}")
        assert first["type"] == "status"

        def produce():
            for step in range(1, steps + 1):
                ingest.metric_points_ingest(
                    run_id=run.pk, step=step, values={n: step + i / 100 for i, n in enumerate(names)}
                )
            ingest.completion_samples_ingest(
                run_id=run.pk,
                step=steps,
                items=[{"prompt": "1+1=", "completion": "2", "reward": 1.0, "advantage": 0.5, "group_id": 7}],
            )
            services.run_event_create(run_id=run.pk, kind=RunEventKind.LOG, message="trainer: step 20")
            services.run_stop(run=Run.objects.get(pk=run.pk))  # queued -> stopped

        await database_sync_to_async(produce)()
        received = []
        while not received or received[-1]["type"] != "status":
            received.append(await comm.receive_json_from(timeout=10))
            assert len(received) < 40, [m["type"] for m in received]
        kinds = [m["type"] for m in received]
        # Batching: one message per logging step carrying all 50 metrics, never one per metric.
        assert kinds[:steps] == ["metrics"] * steps
        assert [m["step"] for m in received[:steps]] == list(range(1, steps + 1))
        assert all(len(m["values"]) == len(names) for m in received[:steps])
        assert received[4]["values"]["ns1/metric_1"] == pytest.approx(5.01)
        # Ordering: what was produced later arrives later.
        assert kinds[steps] == "completions" and received[steps]["step"] == steps
        item = received[steps]["items"][0]
        assert item["completion"] == "2" and item["group_id"] == 7 and item["advantage"] == 0.5
        assert kinds[steps + 1] == "event" and received[steps + 1]["kind"] == "log"
        assert received[-1]["status"] == RunStatus.STOPPED
        assert await comm.receive_nothing(timeout=0.3)
        await comm.disconnect()

    run_async(scenario())


def test_a_socket_gets_nothing_from_other_runs_and_ping_is_answered():
    alice = make_user("alice")
    watched, other = make_run(alice), make_run(alice)
    token = services.token_issue(username="alice")

    async def scenario():
        comm, _ = await open_socket(f"/ws/runs/{watched.pk}/?token={token}")
        await database_sync_to_async(ingest.metric_points_ingest)(
            run_id=other.pk, step=1, values={"reward": 1.0}
        )
        await comm.send_json_to({"type": "ping"})
        assert await comm.receive_json_from(timeout=10) == {"type": "pong"}
        assert await comm.receive_nothing(timeout=0.3)
        await comm.disconnect()

    run_async(scenario())


def test_foreign_origin_is_refused_and_a_script_without_origin_is_let_in():
    alice = make_user("alice")
    run = make_run(alice)
    token = services.token_issue(username="alice")

    async def scenario():
        foreign = WebsocketCommunicator(
            application, f"/ws/runs/{run.pk}/?token={token}", headers=[(b"origin", b"http://evil.example")]
        )
        connected, _ = await foreign.connect(timeout=10)
        assert not connected  # refused at the handshake
        script = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/?token={token}")
        connected, _ = await script.connect(timeout=10)
        assert connected
        assert (await script.receive_json_from(timeout=10))["type"] == "status"
        await script.disconnect()

    run_async(scenario())


def test_output_tailer_batches_a_fast_run_into_few_messages(tmp_path):
    """The supervisor's producer: 30 steps appended to metrics.jsonl within ~100 ms reach the
    channel layer as a few batch messages (one per poll, every INGEST_POLL_S), and the socket still
    gets one message per step."""
    import threading

    from controlplane.runs.models import MetricPoint
    from trainer.reporting.sinks import JsonlSink
    from worker.tailer import INGEST_POLL_S, RunOutputTailer

    alice = make_user("alice")
    run = make_run(alice)
    token = services.token_issue(username="alice")
    layer_messages: list[dict] = []

    async def scenario():
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        spy = await layer.new_channel()
        await layer.group_add(services.run_group(run.pk), spy)
        comm, _ = await open_socket(f"/ws/runs/{run.pk}/?token={token}")

        def write():  # the trainer's side: a real file, appended as it logs
            sink = JsonlSink(tmp_path)
            for step in range(1, 31):
                sink.metrics(step, {"reward": step / 100, "loss": 0.5})
                time.sleep(0.003)
            sink.close()

        def produce():
            tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
            writer = threading.Thread(target=write)
            writer.start()
            while writer.is_alive():
                tailer.poll(now=time.monotonic())
                time.sleep(INGEST_POLL_S)
            tailer.drain()

        started = time.monotonic()
        await database_sync_to_async(produce)()
        elapsed = time.monotonic() - started
        steps = [(await comm.receive_json_from(timeout=10))["step"] for _ in range(30)]
        assert steps == list(range(1, 31))  # one socket message per step, in order
        while True:
            try:
                layer_messages.append(await asyncio.wait_for(layer.receive(spy), timeout=0.5))
            except TimeoutError:
                break
        await comm.disconnect()
        return elapsed

    elapsed = run_async(scenario())
    assert MetricPoint.objects.filter(run=run, name="reward").count() == 30
    # ~30 steps over `elapsed` seconds with a poll every INGEST_POLL_S (plus the final drain).
    assert 1 <= len(layer_messages) <= elapsed / INGEST_POLL_S + 2, (len(layer_messages), elapsed)
    assert any(m["type"] == "run.metrics.batch" and len(m["steps"]) > 1 for m in layer_messages)


def test_a_saved_checkpoint_reaches_the_socket_once_committed(tmp_path):
    """Issue 28 item 6: a checkpoint the tailer stores (``run_output_ingest``, the supervisor's one
    transaction) is published after the commit and forwarded as a ``checkpoint`` message, after
    its "checkpoint saved" event; nothing is published for a transaction that rolls back."""
    from django.db import transaction

    alice = make_user("alice")
    run = make_run(alice)
    token = services.token_issue(username="alice")
    folder = str(tmp_path / "checkpoint-50")

    async def scenario():
        comm, first = await open_socket(f"/ws/runs/{run.pk}/?token={token}")
        assert first["type"] == "status"

        def rolled_back():
            with transaction.atomic():
                ingest.checkpoint_record(run_id=run.pk, step=40, path=str(tmp_path / "checkpoint-40"))
                transaction.set_rollback(True)

        await database_sync_to_async(rolled_back)()
        assert await comm.receive_nothing(timeout=0.3)
        await database_sync_to_async(ingest.run_output_ingest)(
            run_id=run.pk, checkpoints=[(50, folder)], cursors={}
        )
        event = await comm.receive_json_from(timeout=10)
        assert event["type"] == "event" and event["message"] == f"checkpoint saved at step 50: {folder}"
        message = await comm.receive_json_from(timeout=10)
        assert message == {**message, "type": "checkpoint", "step": 50, "path": folder}
        assert message["created_at"]
        assert await comm.receive_nothing(timeout=0.3)
        await comm.disconnect()

    run_async(scenario())
