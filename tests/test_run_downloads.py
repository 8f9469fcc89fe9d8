"""Downloads (issue 22, item 5): a run's metrics and completions as CSV or JSON attachments from
``?format=csv|json`` on their API endpoints, streamed from a server-side cursor (a large run is
never held whole), under WSGI and under ASGI; without ``format`` the JSON answers are unchanged."""

from __future__ import annotations

import csv
import io
import json
import math
import tracemalloc
import warnings

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.test import AsyncClient, Client
from rest_framework.test import APIClient

from controlplane.runs import downloads, selectors, services
from controlplane.runs.models import CompletionSample, MetricPoint, Run

pytestmark = pytest.mark.django_db


def make_user(name: str):
    return get_user_model().objects.create_user(username=name, password=None)


def api_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username=user.username))
    return client


def make_run(owner) -> Run:
    config = {"model": "tiny", "train_dataset": "arithmetic-small", "reward_funcs": ["x.y"], "args": {}}
    return Run.objects.create(owner=owner, name="r", config=config, config_sha256="0" * 64)


@pytest.fixture
def alice():
    return make_user("alice")


@pytest.fixture
def run(alice):
    """Steps 1-3 of reward, loss (missing at step 2, inf at 3) and a NaN; two completions a step."""
    run = make_run(alice)
    points = [(s, "reward", s / 4) for s in (1, 2, 3)] + [(1, "loss", 0.5), (3, "loss", math.inf)]
    points.append((2, "entropy", math.nan))
    MetricPoint.objects.bulk_create([MetricPoint(run=run, step=s, name=n, value=v) for s, n, v in points])
    CompletionSample.objects.bulk_create(
        [
            CompletionSample(
                run=run,
                step=s,
                index=i,
                prompt=f'2+{s}=?, "quoted"\nline',
                completion=f"{2 + s}",
                reward=1.0 if i == 0 else None,
                rewards={"accuracy": 1.0} if i == 0 else {},
                advantage=0.5,
                group_id=s,
                row_index=i,
            )
            for s in (1, 2, 3)
            for i in (0, 1)
        ]
    )
    return run


def body_of(response) -> str:
    assert response.streaming, "a download is streamed"
    return b"".join(response.streaming_content).decode()


def test_metrics_csv_is_a_streamed_attachment_with_one_row_per_step(alice, run):
    response = api_for(alice).get(f"/api/v1/runs/{run.pk}/metrics/?format=csv")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-metrics.csv"'
    rows = list(csv.DictReader(io.StringIO(body_of(response))))
    assert [list(r) for r in rows[:1]] == [["step", "entropy", "loss", "reward"]]
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert rows[0] == {"step": "1", "entropy": "", "loss": "0.5", "reward": "0.25"}
    assert rows[1]["loss"] == "" and rows[1]["entropy"] == "nan" and rows[2]["loss"] == "inf"
    # The endpoint's filters apply.
    response = api_for(alice).get(f"/api/v1/runs/{run.pk}/metrics/?format=csv&names=reward&since_step=1")
    assert body_of(response) == "step,reward\r\n2,0.5\r\n3,0.75\r\n"  # RFC 4180 line ends


def test_metrics_json_download_and_the_json_answer_without_format(alice, run):
    api = api_for(alice)
    response = api.get(f"/api/v1/runs/{run.pk}/metrics/?format=json")
    assert response["Content-Type"] == "application/json"
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-metrics.json"'
    assert json.loads(body_of(response)) == [
        {"step": 1, "loss": 0.5, "reward": 0.25},
        {"step": 2, "entropy": None, "reward": 0.5},
        {"step": 3, "loss": None, "reward": 0.75},
    ]
    # No format: the contract as before (series by name, not an attachment).
    plain = api.get(f"/api/v1/runs/{run.pk}/metrics/?names=reward")
    assert not plain.streaming and "Content-Disposition" not in plain
    assert plain.json() == {"series": {"reward": [{"step": s, "value": s / 4} for s in (1, 2, 3)]}}
    # Bad filters are 400 in JSON, also when a download was asked for.
    bad = api.get(f"/api/v1/runs/{run.pk}/metrics/?format=csv&since_step=-1")
    assert bad.status_code == 400 and "since_step" in bad.json()


def test_completions_csv_and_json_downloads(alice, run):
    api = api_for(alice)
    response = api.get(f"/api/v1/runs/{run.pk}/completions/?format=csv")
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-completions.csv"'
    rows = list(csv.DictReader(io.StringIO(body_of(response))))
    assert len(rows) == 6 and list(rows[0]) == list(selectors.COMPLETION_FIELDS)
    assert [(r["step"], r["index"]) for r in rows] == [(str(s), str(i)) for s in (1, 2, 3) for i in (0, 1)]
    assert rows[0]["prompt"] == '2+1=?, "quoted"\nline'  # quotes and newlines survive
    assert json.loads(rows[0]["rewards"]) == {"accuracy": 1.0} and rows[1]["reward"] == ""
    items = json.loads(body_of(api.get(f"/api/v1/runs/{run.pk}/completions/?format=json&step=2")))
    assert [(c["step"], c["index"], c["reward"]) for c in items] == [(2, 0, 1.0), (2, 1, None)]
    assert set(items[0]) == set(selectors.COMPLETION_FIELDS)
    # No format: the paginated answer as before, newest step first.
    plain = api.get(f"/api/v1/runs/{run.pk}/completions/").json()
    assert plain["count"] == 6 and plain["results"][0]["step"] == 3


def test_csv_cells_a_spreadsheet_would_run_as_formulas_are_text(alice):
    """Issue 29 item 5: a completion (model text) or a metric name (a plugin's) starting with =, +,
    -, @, a tab or a carriage return is written with a leading ' (OWASP); numbers stay numbers."""
    run = make_run(alice)
    hostile = ['=HYPERLINK("http://x")', "+1+1", "-2+3", "@SUM(A1)", "\tcmd", "\r=1", "plain"]
    CompletionSample.objects.bulk_create(
        [
            CompletionSample(run=run, step=1, index=i, prompt=text, completion=text, reward=-0.5)
            for i, text in enumerate(hostile)
        ]
    )
    MetricPoint.objects.create(run=run, step=1, name="=cmd|' /C calc'!A0", value=-1.5)
    rows = list(
        csv.DictReader(
            io.StringIO(body_of(api_for(alice).get(f"/api/v1/runs/{run.pk}/completions/?format=csv")))
        )
    )
    assert [r["completion"] for r in rows] == ["'" + t for t in hostile[:-1]] + ["plain"]
    assert [r["prompt"] for r in rows] == [r["completion"] for r in rows]
    assert {r["reward"] for r in rows} == {"-0.5"}  # a negative number is not a formula
    metrics = body_of(api_for(alice).get(f"/api/v1/runs/{run.pk}/metrics/?format=csv"))
    assert metrics == "step,'=cmd|' /C calc'!A0\r\n1,-1.5\r\n"


def test_downloads_are_for_those_who_may_see_the_run(alice, run):
    bob = api_for(make_user("bob"))
    for kind in ("metrics", "completions"):
        assert bob.get(f"/api/v1/runs/{run.pk}/{kind}/?format=csv").status_code == 404
        assert APIClient().get(f"/api/v1/runs/{run.pk}/{kind}/?format=csv").status_code in (401, 403)
    web = Client()  # the page's links: the session is enough
    web.force_login(alice)
    assert web.get(f"/api/v1/runs/{run.pk}/metrics/?format=csv").status_code == 200


def test_a_large_download_is_streamed_not_held(alice):
    """40 metrics x 2,500 steps (100,000 points): reading the CSV piece by piece peaks at a small
    fraction of the memory the same points take as one list (what a non-streamed answer builds).
    Measured: about 1.2 MB against 18 MB."""
    run = make_run(alice)
    steps, names = 2500, [f"m/{i:02d}" for i in range(40)]
    MetricPoint.objects.bulk_create(
        (MetricPoint(run=run, step=s, name=n, value=s + 0.5) for s in range(1, steps + 1) for n in names),
        batch_size=10_000,
    )
    api = api_for(alice)
    warm = make_run(alice)  # first-use imports and caches are not the download's memory
    MetricPoint.objects.create(run=warm, step=1, name="m/00", value=1.0)
    b"".join(api.get(f"/api/v1/runs/{warm.pk}/metrics/?format=csv").streaming_content)
    tracemalloc.start()
    try:
        whole = list(MetricPoint.objects.filter(run=run).values_list("step", "name", "value"))
        _, held_whole = tracemalloc.get_traced_memory()
        del whole
        tracemalloc.reset_peak()
        response = api.get(f"/api/v1/runs/{run.pk}/metrics/?format=csv")
        lines = pieces = 0
        for piece in response.streaming_content:
            pieces += 1
            lines += piece.count(b"\n")
        _, peak_streamed = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lines == steps + 1  # header + one row per step
    assert pieces > 10  # sent in pieces of about PIECE_CHARS, not one body
    assert peak_streamed < held_whole / 4, (peak_streamed, held_whole)


@pytest.mark.django_db(transaction=True)
def test_asgi_streams_the_download_without_buffering_it(alice, run):
    """Under ASGI (daphne) Django turns a synchronous iterator into a list before sending, with a
    warning; the download hands it an asynchronous one, whose pieces come from the request's thread."""
    token = services.token_issue(username="alice")

    async def fetch():
        response = await AsyncClient().get(
            f"/api/v1/runs/{run.pk}/completions/?format=json", headers={"Authorization": f"Token {token}"}
        )
        assert response.status_code == 200, response.content
        chunks = [chunk async for chunk in response.streaming_content]
        return response, b"".join(chunks)

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*must consume synchronous iterators.*")
        response, body = async_to_sync(fetch)()
    assert response.status_code == 200 and response.is_async
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-completions.json"'
    assert len(json.loads(body)) == 6


def test_json_pieces_are_valid_however_the_rows_split():
    rows = ({"step": s, "x": s / 3, "y": math.nan} for s in range(20_000))
    pieces = list(downloads.metrics_pieces(fmt="json", columns=["x", "y"], rows=rows))
    assert len(pieces) > 3 and all(len(p) < 2 * downloads.PIECE_CHARS for p in pieces)
    loaded = json.loads("".join(pieces))
    assert [r["step"] for r in loaded] == list(range(20_000)) and loaded[3] == {
        "step": 3,
        "x": 1.0,
        "y": None,
    }
    empty = "".join(downloads.metrics_pieces(fmt="json", columns=[], rows=iter(())))
    assert (
        json.loads(empty) == []
        and "".join(downloads.metrics_pieces(fmt="csv", columns=[], rows=())) == "step\r\n"
    )


# ---------------------------------------------------------------------------------- checkpoints
# Issue 28 item 6: GET /runs/<id>/checkpoints/<step>/download/, the folder as a streamed tar, for
# the run's owner only, and only a folder inside the run's output directory inside GRPO_RUNS_DIR.


@pytest.fixture
def runs_root(tmp_path, settings):
    settings.GRPO_RUNS_DIR = tmp_path / "runs"
    return settings.GRPO_RUNS_DIR


def checkpoint_of(run: Run, runs_root, step: int = 50):
    """A checkpoint folder of ``run`` in its output directory: a config, weights larger than a few
    read pieces (not a whole number of tar blocks), an empty file in a subfolder."""
    import os

    from controlplane.runs.models import Checkpoint

    output = runs_root / f"run-{run.pk}-0123abcd"
    folder = output / f"checkpoint-{step}"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "model.safetensors").write_bytes(os.urandom(2 * downloads.READ_BYTES + 7))
    (folder / "sub" / "empty.txt").write_bytes(b"")
    Run.objects.filter(pk=run.pk).update(output_dir=str(output))
    return Checkpoint.objects.create(run=run, step=step, path=str(folder)), folder


def download_url(run: Run, step: int = 50) -> str:
    return f"/runs/{run.pk}/checkpoints/{step}/download/"


def untar(body: bytes) -> dict[str, bytes | None]:
    """name -> content (None for a directory) of a tar archive."""
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
        return {m.name: tar.extractfile(m).read() if m.isfile() else None for m in tar.getmembers()}


def test_the_owner_downloads_a_checkpoint_folder_as_a_streamed_tar(alice, runs_root, tmp_path):
    run = make_run(alice)
    _, folder = checkpoint_of(run, runs_root)
    outside = tmp_path / "secret.txt"
    outside.write_text("not the run's")
    (folder / "escape.txt").symlink_to(outside)  # links are left out, whatever they point at
    (folder / "linked").symlink_to(tmp_path, target_is_directory=True)
    web = Client()
    web.force_login(alice)
    response = web.get(download_url(run))
    assert response.status_code == 200
    body = body_of_bytes(response)
    assert response["Content-Type"] == "application/x-tar"
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-checkpoint-50.tar"'
    assert int(response["Content-Length"]) == len(body) and len(body) % 10240 == 0
    top = f"run-{run.pk}-checkpoint-50"
    assert untar(body) == {
        top: None,
        f"{top}/config.json": (folder / "config.json").read_bytes(),
        f"{top}/model.safetensors": (folder / "model.safetensors").read_bytes(),
        f"{top}/sub": None,
        f"{top}/sub/empty.txt": b"",
    }
    assert response.streaming and len(list(downloads.checkpoint_tar(folder=folder, arcname="x")[1])) > 5
    assert web.head(download_url(run)).status_code == 200
    assert web.post(download_url(run)).status_code == 405


def body_of_bytes(response) -> bytes:
    assert response.streaming, "a download is streamed"
    return b"".join(response.streaming_content)


def test_a_checkpoint_download_is_the_owners_only(alice, runs_root):
    run = make_run(alice)
    checkpoint_of(run, runs_root)
    bob = make_user("bob")
    boss = get_user_model().objects.create_user(username="boss", password=None, is_staff=True)
    for other in (bob, boss):  # staff see the run's page, not its weights
        web = Client()
        web.force_login(other)
        assert web.get(download_url(run)).status_code == 404, other
    anonymous = Client().get(download_url(run))
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]
    web = Client()
    web.force_login(alice)
    assert web.get(download_url(run, step=51)).status_code == 404  # no such checkpoint
    assert web.get(download_url(run, step=10**12)).status_code == 404
    assert web.get(f"/runs/{10**12}/checkpoints/50/download/").status_code == 404


def test_a_checkpoint_downloads_over_the_api_with_the_owners_token(alice, runs_root):
    """CI fetches a checkpoint with its API token: ``GET /api/v1/runs/<id>/checkpoints/<step>/download/``
    (listed by ``.../checkpoints/``), the same tar as the page's, for the owner only."""
    run = make_run(alice)
    _, folder = checkpoint_of(run, runs_root)
    url = f"/api/v1/runs/{run.pk}/checkpoints/50/download/"
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username="alice"))
    listed = api.get(f"/api/v1/runs/{run.pk}/checkpoints/").json()
    assert [c["step"] for c in listed] == [50]
    response = api.get(url)
    assert response.status_code == 200 and response["Content-Type"] == "application/x-tar"
    files = untar(body_of_bytes(response))
    assert files[f"run-{run.pk}-checkpoint-50/config.json"] == (folder / "config.json").read_bytes()
    assert api.get(f"/api/v1/runs/{run.pk}/checkpoints/51/download/").status_code == 404
    make_user("bob")
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username="bob"))
    assert other.get(url).status_code == 404
    assert APIClient().get(url).status_code in (401, 403)


def test_a_checkpoint_download_never_leaves_the_runs_output_directory(alice, runs_root, tmp_path):
    from controlplane.runs.models import Checkpoint

    run = make_run(alice)
    checkpoint, folder = checkpoint_of(run, runs_root)
    web = Client()
    web.force_login(alice)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "id_rsa").write_text("key")
    other_run = runs_root / "run-999-ffffffff" / "checkpoint-1"
    other_run.mkdir(parents=True)
    output = folder.parent
    (output / "checkpoint-60").symlink_to(elsewhere, target_is_directory=True)
    for step, path in (
        (1, elsewhere),  # outside every run
        (2, output / ".." / "run-999-ffffffff" / "checkpoint-1"),  # another run's, through ".."
        (3, other_run),
        (4, output),  # the output directory itself (metrics, RUN.yaml, every checkpoint)
        (5, output / "checkpoint-60"),  # a link out of it
        (6, output / "checkpoint-70"),  # not on this host (a worker elsewhere)
        (7, "checkpoint-50"),  # relative: never resolved against wherever the web runs
    ):
        Checkpoint.objects.create(run=run, step=step, path=str(path))
        response = web.get(download_url(run, step))
        assert response.status_code == 404, (step, path)
        assert b"id_rsa" not in response.content
    # An output directory outside GRPO_RUNS_DIR: nothing of it is sent, its checkpoints included.
    assert web.get(download_url(run)).status_code == 200
    Run.objects.filter(pk=run.pk).update(output_dir=str(tmp_path))
    assert web.get(download_url(run)).status_code == 404
    Run.objects.filter(pk=run.pk).update(output_dir="")
    assert web.get(download_url(run)).status_code == 404
    assert checkpoint.path == str(folder)


@pytest.mark.django_db(transaction=True)
def test_asgi_streams_a_checkpoint_without_buffering_it(alice, runs_root):
    run = make_run(alice)
    _, folder = checkpoint_of(run, runs_root)

    async def fetch():
        client = AsyncClient()
        await client.aforce_login(alice)
        response = await client.get(download_url(run))
        assert response.status_code == 200
        chunks = [chunk async for chunk in response.streaming_content]
        return response, chunks

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*must consume synchronous iterators.*")
        response, chunks = async_to_sync(fetch)()
    assert response.is_async and len(chunks) > 3
    assert max(len(c) for c in chunks) <= downloads.READ_BYTES
    body = b"".join(chunks)
    assert int(response["Content-Length"]) == len(body)
    assert (
        untar(body)[f"run-{run.pk}-checkpoint-50/model.safetensors"]
        == (folder / "model.safetensors").read_bytes()
    )
