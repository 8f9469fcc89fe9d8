"""Control plane without a worker: validation, auth, visibility, idempotency, ingest, life-cycle
rules and database constraints, the form, the token command. Real Postgres (pytest-django).

In these (non-transactional) tests ``transaction.on_commit`` never fires, so creating a run stores
it without enqueuing a supervisor task; tests/test_runs_live.py covers launching.
"""

from __future__ import annotations

import io
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import IntegrityError, transaction
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.runs import selectors, services
from controlplane.runs.models import CompletionSample, MetricPoint, Run, RunStatus
from controlplane.runs.services import ingest

pytestmark = pytest.mark.django_db


def good_config(**args) -> dict:
    return {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        # The tiny model's server holds 1024 tokens: the default max_completion_length (2048) is refused.
        "args": {"max_steps": 4, "num_generations": 4, "max_completion_length": 128, **args},
    }


def make_user(name: str, **extra):
    return get_user_model().objects.create_user(username=name, password=None, **extra)


def api_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username=user.username))
    return client


@pytest.fixture
def alice():
    return make_user("alice")


@pytest.fixture
def bob():
    return make_user("bob")


def test_registry_lists_names_and_spec_defaults(alice):
    body = api_for(alice).get("/api/v1/registry/").json()
    assert "tiny" in body["models"] and "arithmetic" in body["datasets"]
    assert "trainer.rewards.accuracy_reward" in body["reward_funcs"]
    assert body["main_args"]["num_generations"] == 8  # the spec's default
    assert body["main_args"]["learning_rate"] == 1e-6


def test_metric_catalogue_endpoint_lists_every_declaration(alice):
    from trainer.reporting.metrics import CATALOGUE, NAMESPACES

    body = api_for(alice).get("/api/v1/metrics/catalogue/").json()
    assert body["namespaces"] == list(NAMESPACES)
    by_name = {m["name"]: m for m in body["metrics"]}
    assert list(by_name) == list(CATALOGUE)
    assert by_name["rollout/vllm_retry_count"] | {"help": ""} == {
        "name": "rollout/vllm_retry_count",
        "reduction": "sum",
        "unit": "requests",
        "help": "",
        "when": "",
        "namespace": "rollout",
        "templated": False,
        "marks": False,
    }
    assert by_name["curriculum/level"]["marks"] is True  # the run page marks its changes on the charts
    assert by_name["rollout/vllm_retry_count"]["help"] == CATALOGUE["rollout/vllm_retry_count"].help
    assert (
        by_name["rewards/{name}/mean"]["templated"]
        and by_name["rewards/{name}/mean"]["namespace"] == "rewards"
    )
    assert by_name["reward"]["namespace"] == "train"
    assert APIClient().get("/api/v1/metrics/catalogue/").status_code in (
        401,
        403,
    )  # authenticated, as reads are


def test_create_returns_201_and_the_run(alice):
    response = api_for(alice).post("/api/v1/runs/", {"config": good_config()}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert set(body) >= {"id", "status", "url"}
    assert body["status"] == "queued"
    assert body["url"].endswith(f"/api/v1/runs/{body['id']}/")
    run = Run.objects.get(pk=body["id"])
    assert run.owner == alice and run.config == good_config()
    assert run.launched_at is not None and run.celery_task_id  # launched (enqueued on commit)
    assert run.name == "tiny on arithmetic-small"


def test_create_accepts_yaml_text(alice):
    text = (
        "model: tiny\ntrain_dataset: arithmetic-small\nreward_funcs: [trainer.rewards.accuracy_reward]\n"
        "args: {max_completion_length: 128}\n"
    )
    response = api_for(alice).post("/api/v1/runs/", {"name": "from yaml", "config": text}, format="json")
    assert response.status_code == 201, response.content
    assert Run.objects.get(pk=response.json()["id"]).config["model"] == "tiny"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({**good_config(), "reward_funcs": ["os.system"]}, "reward_funcs[0]"),
        ({**good_config(), "model": "../../etc"}, "model"),
        ({**good_config(), "model": "Qwen/Qwen3-0.6B"}, "model"),
        ({**good_config(), "train_dataset": "/etc/passwd"}, "train_dataset"),
        ({**good_config(), "tools": ["subprocess.run"]}, "tools[0]"),
        (good_config(learning_rate="fast"), "args.learning_rate"),
        (good_config(num_generations=1), "args.num_generations"),
        (good_config(not_a_field=3), "args.not_a_field"),
        (good_config(output_dir="/tmp/x"), "args.output_dir"),
        (good_config(vllm_server_base_url="http://evil:1"), "args.vllm_server_base_url"),
        (good_config(trust_remote_code=True), "args.trust_remote_code"),
        (good_config(push_to_hub=True), "args.push_to_hub"),
        (good_config(report_to="wandb"), "args.report_to"),
        (
            good_config(model_init_kwargs={"trust_remote_code": True}),
            "args.model_init_kwargs.trust_remote_code",
        ),
        ({"train_dataset": "arithmetic", "reward_funcs": ["trainer.rewards.accuracy_reward"]}, "model"),
        ({**good_config(), "bogus": 1}, "bogus"),
    ],
)
def test_bad_config_is_400_naming_the_field(alice, config, field):
    response = api_for(alice).post("/api/v1/runs/", {"config": config}, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()["config"]
    assert field in errors, errors
    assert not Run.objects.exists()


def test_local_model_dir_only_under_allowed_roots(alice, settings, tmp_path):
    model_dir = tmp_path / "models" / "m"
    model_dir.mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    settings.GRPO_ALLOWED_MODEL_ROOTS = [str(tmp_path / "models")]
    client = api_for(alice)
    ok = client.post("/api/v1/runs/", {"config": {**good_config(), "model": str(model_dir)}}, format="json")
    assert ok.status_code == 201, ok.content
    for bad in (str(outside), str(tmp_path / "models" / ".." / "elsewhere"), "models/m"):
        response = client.post("/api/v1/runs/", {"config": {**good_config(), "model": bad}}, format="json")
        assert response.status_code == 400 and "model" in response.json()["config"], (bad, response.content)


def test_unauthenticated_requests_are_refused(alice):
    run, _ = services.run_create(owner=alice, config=good_config(), launch=False)
    anonymous = APIClient()
    assert anonymous.post("/api/v1/runs/", {"config": good_config()}, format="json").status_code == 401
    assert anonymous.get("/api/v1/runs/").status_code == 401
    assert anonymous.get(f"/api/v1/runs/{run.pk}/").status_code == 401
    assert anonymous.post(f"/api/v1/runs/{run.pk}/stop/").status_code == 401
    wrong = APIClient()
    wrong.credentials(HTTP_AUTHORIZATION="Token " + "0" * 40)
    assert wrong.get("/api/v1/runs/").status_code == 401


def test_users_see_only_their_runs_and_staff_see_all(alice, bob):
    run, _ = services.run_create(owner=alice, config=good_config(), launch=False)
    ingest.metric_points_ingest(run_id=run.pk, step=1, values={"reward": 0.5})
    as_bob = api_for(bob)
    for path in ("", "metrics/", "completions/", "events/", "checkpoints/"):
        assert as_bob.get(f"/api/v1/runs/{run.pk}/{path}").status_code == 404, path
    assert as_bob.post(f"/api/v1/runs/{run.pk}/stop/").status_code == 404
    assert as_bob.post(f"/api/v1/runs/{run.pk}/resume/").status_code == 404
    assert as_bob.get("/api/v1/runs/").json()["results"] == []
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED  # bob's stop did nothing
    # Bob's web pages refuse too.
    web = Client()
    web.force_login(bob)
    assert web.get(f"/runs/{run.pk}/").status_code == 404
    staff = make_user("root", is_staff=True)
    listed = api_for(staff).get("/api/v1/runs/").json()
    assert [r["id"] for r in listed["results"]] == [run.pk]
    assert api_for(staff).get(f"/api/v1/runs/{run.pk}/").json()["owner"] == "alice"


def test_idempotency_key_returns_the_same_run(alice):
    client = api_for(alice)
    first = client.post(
        "/api/v1/runs/", {"config": good_config()}, format="json", HTTP_IDEMPOTENCY_KEY="ci-42"
    )
    again = client.post(
        "/api/v1/runs/", {"config": good_config()}, format="json", HTTP_IDEMPOTENCY_KEY="ci-42"
    )
    assert first.status_code == again.status_code == 201
    assert first.json()["id"] == again.json()["id"]
    assert again["Idempotent-Replayed"] == "true"
    assert Run.objects.count() == 1
    other = client.post(
        "/api/v1/runs/", {"config": good_config(max_steps=9)}, format="json", HTTP_IDEMPOTENCY_KEY="ci-42"
    )
    assert other.status_code == 409
    # Keys are per user: Bob's "ci-42" is his own run.
    bob = make_user("bob")
    theirs = api_for(bob).post(
        "/api/v1/runs/", {"config": good_config()}, format="json", HTTP_IDEMPOTENCY_KEY="ci-42"
    )
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]


def test_metrics_ingest_is_one_upsert_per_step_and_served_by_name(alice, django_assert_max_num_queries):
    run, _ = services.run_create(owner=alice, config=good_config(), launch=False)
    values = {f"m{i}": float(i) for i in range(50)} | {"reward": 0.25, "note": "text is skipped"}
    with django_assert_max_num_queries(1):  # bulk, not one INSERT per value
        assert ingest.metric_points_ingest(run_id=run.pk, step=1, values=values) == 51
    ingest.metric_points_ingest(run_id=run.pk, step=2, values={"reward": 0.5, "loss": float("nan")})
    # A retried / resumed step replaces its values instead of duplicating them.
    ingest.metric_points_ingest(run_id=run.pk, step=2, values={"reward": 0.75})
    assert MetricPoint.objects.filter(run=run, name="reward").count() == 2
    client = api_for(alice)
    body = client.get(f"/api/v1/runs/{run.pk}/metrics/?names=reward,loss").json()
    assert body == {
        "series": {
            "reward": [{"step": 1, "value": 0.25}, {"step": 2, "value": 0.75}],
            "loss": [{"step": 2, "value": None}],  # NaN is stored, served as null
        }
    }
    since = client.get(f"/api/v1/runs/{run.pk}/metrics/?names=reward&since_step=1").json()
    assert since["series"]["reward"] == [{"step": 2, "value": 0.75}]
    everything = client.get(f"/api/v1/runs/{run.pk}/metrics/").json()["series"]
    assert len(everything) == 52
    assert client.get(f"/api/v1/runs/{run.pk}/metrics/?since_step=-1").status_code == 400
    latest = selectors.run_metric_latest(run=run)
    assert latest["reward"] == {"step": 2, "value": 0.75}


def test_completions_ingest_and_endpoint(alice):
    run, _ = services.run_create(owner=alice, config=good_config(), launch=False)
    items = [
        {
            "prompt": f"what is {i}+1?",
            "completion": f"\\boxed{{{i + 1}}}",
            "reward": 1.0,
            "rewards": {"accuracy_reward": 1.0},
            "advantage": 0.5,
            "group_id": 3,
            "row_index": i,
        }
        for i in range(4)
    ]
    assert ingest.completion_samples_ingest(run_id=run.pk, step=1, items=items) == 4
    ingest.completion_samples_ingest(run_id=run.pk, step=1, items=items)  # retry: no duplicates
    ingest.completion_samples_ingest(run_id=run.pk, step=2, items=items[:1])
    assert CompletionSample.objects.filter(run=run).count() == 5
    body = api_for(alice).get(f"/api/v1/runs/{run.pk}/completions/").json()
    assert body["count"] == 5
    assert body["results"][0]["step"] == 2  # newest first
    assert body["results"][1]["prompt"] == "what is 0+1?" and body["results"][1]["rewards"] == {
        "accuracy_reward": 1.0
    }


def test_stale_heartbeat_marks_a_live_run_failed_on_read(alice):
    run, _ = services.run_create(owner=alice, config=good_config())
    claimed = services.run_claim(run_id=run.pk, task_id=run.celery_task_id, worker_host="gone-host")
    assert claimed.status == RunStatus.STARTING
    # Fake (named as such): a worker that vanished is simulated by an old heartbeat, since killing
    # the session's real worker would take it from the other tests.
    Run.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    body = api_for(alice).get(f"/api/v1/runs/{run.pk}/").json()
    assert body["status"] == "failed"
    assert "worker lost" in body["failure_reason"] and "gone-host" in body["failure_reason"]
    run.refresh_from_db()
    assert run.finished_at is not None
    # The supervisor, should it come back, can no longer overwrite the outcome.
    assert services.run_heartbeat(run_id=run.pk) is None
    assert not services.run_finish(run_id=run.pk, status=RunStatus.COMPLETED)


def test_claims_give_concurrent_runs_their_own_ports_and_dirs(alice, settings, tmp_path):
    settings.GRPO_RUNS_DIR = tmp_path
    settings.GRPO_VLLM_PORTS = (8440, 8449)
    a, _ = services.run_create(owner=alice, config=good_config())
    b, _ = services.run_create(owner=alice, config=good_config())
    ca = services.run_claim(run_id=a.pk, task_id=a.celery_task_id, worker_host="h")
    cb = services.run_claim(run_id=b.pk, task_id=b.celery_task_id, worker_host="h")
    assert ca.vllm_port != cb.vllm_port
    assert ca.output_dir != cb.output_dir and ca.output_dir.startswith(str(tmp_path))
    # A second claim (a redelivered task) or a stale task id cannot take a run again.
    assert services.run_claim(run_id=a.pk, task_id=a.celery_task_id, worker_host="h") is None
    # The database itself refuses two live runs on one port of one host.
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.filter(pk=b.pk).update(vllm_port=ca.vllm_port)


def test_database_constraints_hold(alice):
    run, _ = services.run_create(owner=alice, config=good_config())
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.filter(pk=run.pk).update(status="exploded")
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.filter(pk=run.pk).update(status=RunStatus.FAILED, finished_at=timezone.now())  # no reason
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.filter(pk=run.pk).update(status=RunStatus.COMPLETED)  # no finished_at
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)  # never claimed
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.filter(pk=run.pk).update(config={"model": "changed"})  # launched: frozen
    draft, _ = services.run_create(owner=alice, config=good_config(), launch=False)
    Run.objects.filter(pk=draft.pk).update(launched_at=None)
    Run.objects.filter(pk=draft.pk).update(config={"model": "tiny"})  # not launched yet: allowed
    MetricPoint.objects.create(run=run, step=1, name="reward", value=0.1)
    with pytest.raises(IntegrityError), transaction.atomic():
        MetricPoint.objects.create(run=run, step=1, name="reward", value=0.2)


def test_stop_and_resume_follow_the_life_cycle(alice):
    client = api_for(alice)
    run, _ = services.run_create(owner=alice, config=good_config())
    assert client.post(f"/api/v1/runs/{run.pk}/resume/").status_code == 409  # queued: nothing to resume
    stopped = client.post(f"/api/v1/runs/{run.pk}/stop/")
    assert stopped.status_code == 202 and stopped.json()["status"] == "stopped"  # no supervisor yet
    assert client.post(f"/api/v1/runs/{run.pk}/stop/").status_code == 409
    resumed = client.post(f"/api/v1/runs/{run.pk}/resume/")
    assert resumed.status_code == 202 and resumed.json()["status"] == "queued"
    run.refresh_from_db()
    assert run.finished_at is None and run.config == good_config()
    # A live run with a fresh heartbeat goes to "stopping": the supervisor finishes the job.
    claimed = services.run_claim(run_id=run.pk, task_id=run.celery_task_id, worker_host="h")
    assert claimed.attempt == 1
    assert client.post(f"/api/v1/runs/{run.pk}/stop/").json()["status"] == "stopping"
    assert services.run_heartbeat(run_id=run.pk) == RunStatus.STOPPING
    kinds = [e["kind"] for e in client.get(f"/api/v1/runs/{run.pk}/events/").json()]
    assert kinds.count("status") >= 4


def test_form_requires_login_and_csrf_and_shows_field_errors(alice):
    assert Client().get("/runs/new/").status_code == 302  # to the login page
    web = Client(enforce_csrf_checks=True)
    web.force_login(alice)
    page = web.get("/runs/new/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="reward_funcs"' in html and 'value="trainer.rewards.accuracy_reward"' in html
    assert re.search(r'name="num_generations"[^>]*value="8"', html)  # the spec's default
    base = {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "num_generations": "8",
        "max_completion_length": "128",
        "learning_rate": "1e-6",
    }
    assert web.post("/runs/new/", base).status_code == 403  # no CSRF token
    token = web.cookies["csrftoken"].value
    bad = web.post(
        "/runs/new/",
        {**base, "num_generations": "1", "advanced": '{"top_p": 0.5}', "csrfmiddlewaretoken": token},
    )
    assert bad.status_code == 400
    assert "at least 2 completions per prompt" in bad.context["form"].errors["num_generations"][0]
    body = bad.content.decode()
    assert body.index('id="field-num_generations"') < body.index("at least 2 completions per prompt")
    unknown = web.post("/runs/new/", {**base, "advanced": '{"nope": 1}', "csrfmiddlewaretoken": token})
    assert "args.nope" in unknown.context["form"].errors["advanced"][0]
    assert not Run.objects.exists()
    ok = web.post(
        "/runs/new/",
        {**base, "max_steps": "4", "advanced": '{"epsilon": 0.3}', "csrfmiddlewaretoken": token},
    )
    assert ok.status_code == 302
    run = Run.objects.get()
    assert ok["Location"] == f"/runs/{run.pk}/"
    assert run.config == {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {"max_steps": 4, "max_completion_length": 128, "epsilon": 0.3},
    }
    assert web.get(f"/runs/{run.pk}/").status_code == 200
    assert str(run.pk) in web.get("/runs/").content.decode()


def test_issue_token_creates_the_user_and_prints_a_working_token():
    out = io.StringIO()
    call_command("issue_token", "ci-bot", stdout=out)
    token = out.getvalue().strip()
    assert re.fullmatch(r"[0-9a-f]{40}", token)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + token)
    assert client.get("/api/v1/runs/").status_code == 200
    call_command("issue_token", "ci-bot", "--revoke-others", stdout=io.StringIO())  # rotation
    assert client.get("/api/v1/runs/").status_code == 401


def test_openapi_schema_lists_the_run_endpoints(alice):
    client = Client()
    client.force_login(alice)
    schema = client.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for path in (
        "/api/v1/runs/",
        "/api/v1/runs/{run_id}/",
        "/api/v1/runs/{run_id}/stop/",
        "/api/v1/runs/{run_id}/resume/",
        "/api/v1/runs/{run_id}/metrics/",
        "/api/v1/runs/{run_id}/completions/",
        "/api/v1/registry/",
        "/api/v1/metrics/catalogue/",
        "/api/v1/runs/compare/",
    ):
        assert path in schema["paths"], path


def test_demo_run_uses_registry_names_and_is_reused():
    run = services.demo_run_start()
    assert run.owner.username == "demo" and run.config["model"] == "tiny"
    assert run.config["args"]["max_steps"] == 200
    assert services.demo_run_start().pk == run.pk  # still queued: not duplicated


@pytest.mark.django_db(transaction=True)
def test_output_tailer_stores_the_sink_files_and_survives_refused_lines(tmp_path):
    """What the trainer's default sink writes, read back by the supervisor's tailer."""
    from controlplane.runs.models import Checkpoint
    from trainer.reporting.sinks import JsonlSink
    from worker.tailer import RunOutputTailer

    owner = make_user("trainer-owner")
    run, _ = services.run_create(owner=owner, config=good_config(), launch=False)
    sink = JsonlSink(tmp_path)
    tailer = RunOutputTailer(run_id=run.pk, output_dir=tmp_path)
    item = {
        "prompt": "p",
        "completion": "c\x00",
        "reward": 1.0,
        "rewards": {},
        "advantage": 0.0,
        "group_id": 0,
    }
    sink.metrics(1, {"reward": 0.5, "loss": 0.1})
    sink.completions(1, [item, item])
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "rollout_state.json").write_text("{}")  # the trainer writes it last
    sink.checkpoint(1, str(folder))
    tailer.poll()
    assert MetricPoint.objects.filter(run=run, step=1).count() == 2
    assert CompletionSample.objects.filter(run=run, step=1, completion="c").count() == 2
    assert Checkpoint.objects.get(run=run).path == str(tmp_path / "checkpoint-1")
    # The database refuses a line (a negative step violates the column's check): it is skipped,
    # and later steps still get through; the trainer never sees an error.
    sink.metrics(-1, {"reward": 0.1})
    for _ in range(5):
        sink.metrics(2, {"reward": 0.75})
    tailer.poll()
    assert list(
        MetricPoint.objects.filter(run=run, name="reward").order_by("step").values_list("step", "value")
    ) == [
        (1, 0.5),
        (2, 0.75),
    ]
    # A restarted worker's tailer starts at the saved offsets: nothing is read twice.
    sink.metrics(3, {"reward": 1.0})
    assert RunOutputTailer(run_id=run.pk, output_dir=tmp_path).poll() == 1
    assert Checkpoint.objects.filter(run=run).count() == 1


@pytest.mark.django_db
def test_run_creation_is_throttled_per_user_and_queued_runs_are_capped(settings):
    settings.GRPO_RUN_CREATE_RATE = "3/min"
    settings.GRPO_MAX_QUEUED_RUNS_PER_USER = 2
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username="eager"))
    owner = get_user_model().objects.get(username="eager")
    # Two queued runs (not launched: no worker here); the cap refuses a third before it exists.
    for i in range(2):
        services.run_create(owner=owner, name=f"queued {i}", config=good_config(), launch=False)
    capped = client.post("/api/v1/runs/", {"config": good_config()}, format="json")
    assert capped.status_code == 429 and "GRPO_MAX_QUEUED_RUNS_PER_USER" in capped.json()["detail"]
    assert Run.objects.filter(owner=owner).count() == 2
    # The rate counts every creation request (this is the 2nd and 3rd); the 4th within the minute waits.
    for _ in range(2):
        assert client.post("/api/v1/runs/", {"config": {"model": ""}}, format="json").status_code == 400
    throttled = client.post("/api/v1/runs/", {"config": good_config()}, format="json")
    assert throttled.status_code == 429 and int(throttled["Retry-After"]) > 0
    # Another user is not throttled by this one, and reads are never throttled.
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION="Token " + services.token_issue(username="patient"))
    assert other.post("/api/v1/runs/", {"config": {"model": ""}}, format="json").status_code == 400
    assert client.get("/api/v1/runs/").status_code == 200
    # The form honours both too.
    web = Client()
    web.force_login(owner)
    page = web.post("/runs/new/", {"name": "x", "model": "tiny", "train_dataset": "arithmetic-small"})
    assert page.status_code == 429 and "Too many runs created" in page.content.decode()
