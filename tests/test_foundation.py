"""Foundation: settings from the environment, one-line service errors, pages, schema, Celery, compose."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.django_db


def _manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unreachable_database_is_one_clear_line():
    port = free_port()  # nothing listens there
    result = _manage("migrate", env={"DATABASE_URL": f"postgres://postgres@127.0.0.1:{port}/grpo"})
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "PostgreSQL is unreachable" in lines[0] and f"127.0.0.1:{port}" in lines[0]
    assert "docker compose up -d postgres redis" in lines[0] and "DATABASE_URL" in lines[0]
    assert "Traceback" not in result.stderr


def test_unreachable_broker_is_one_clear_line():
    port = free_port()
    result = _manage("runstack", "--no-tiny", "--no-demo", env={"REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Redis is unreachable" in lines[0] and "REDIS_URL" in lines[0]


def test_missing_database_is_created(settings):
    from controlplane.preflight import check_postgres

    name = f"grpo_preflight_{os.getpid()}"
    url = f"postgres://postgres@127.0.0.1:5432/{name}"
    import psycopg

    try:
        check_postgres(url)
        psycopg.connect(url).close()  # exists now
    finally:
        with psycopg.connect("postgres://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


def test_settings_come_from_environment():
    code = (
        "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='controlplane.settings'; django.setup();"
        "from django.conf import settings as s;"
        "print(s.DEBUG, s.SECRET_KEY, s.DATABASES['default']['NAME'], s.CELERY_BROKER_URL)"
    )
    env = {
        **os.environ,
        "DEBUG": "false",
        "SECRET_KEY": "k" * 50,
        "DATABASE_URL": "postgres://u@db.example:5433/other",
        "REDIS_URL": "redis://r.example:6380/3",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "k" * 50, "other", "redis://r.example:6380/3"]


def test_home_page_and_health(client):
    response = client.get("/")
    assert response.status_code == 200
    assert b"Async GRPO control plane" in response.content
    assert client.get("/healthz").json() == {"status": "ok"}


def test_openapi_schema_is_served(client):
    response = client.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    assert b"openapi" in response.content


@pytest.mark.django_db(transaction=True)
def test_celery_worker_runs_a_task_through_redis(celery_worker_process):
    from worker.celery_tasks import ping

    result = ping.apply_async(args=["hello"], queue=celery_worker_process["queue"])
    answer = result.get(timeout=60)
    assert answer["payload"] == "hello"
    assert answer["pid"] != os.getpid()  # a real worker process answered, not eager mode


def test_docker_compose_file_is_valid():
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose is installed by `scripts/install.sh --system` (make test)"
    result = subprocess.run(
        [compose, "-f", "docker-compose.yml", "config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SECRET_KEY": "x" * 10 + "compose-config-check-0123456789abcdefghijklmnop"},
    )
    assert result.returncode == 0, result.stderr
    for service in ("postgres:", "redis:", "web:", "worker:", "vllm:"):
        assert service in result.stdout
    assert "VLLM_SERVER_DEV_MODE" in result.stdout and "processed_logprobs" in result.stdout
    assert "controlplane.settings_production" in result.stdout
    # Placement (docs/cluster.md): the worker reserves every GPU and places runs itself; the vllm
    # service is a named server, in its own profile so that its GPU is not the worker's by default.
    assert "count: all" in result.stdout and "GRPO_WORKER_GPUS" in result.stdout
    assert "GRPO_VLLM_SERVERS: vllm=http://vllm:8000" in result.stdout
    assert "vllm_server_base_url" not in (REPO / "docker-compose.yml").read_text()
    unset = subprocess.run(
        [compose, "-f", "docker-compose.yml", "config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "SECRET_KEY"},
    )
    assert unset.returncode != 0 and "SECRET_KEY" in unset.stderr  # no default secret in deployments


def test_serve_command_has_the_spec_flags_on_cpu_and_gpu():
    from trainer.processes.serve import build_serve_command

    cpu = build_serve_command("/m", port=8123, gpu=False, extra=["--enable-lora", "--max-lora-rank", "8"])
    argv = " ".join(cpu.argv)
    assert "vllm.entrypoints.openai.api_server --model /m" in argv
    assert "--port 8123" in argv and "--logprobs-mode processed_logprobs" in argv
    assert "--max-model-len 2048" in argv and "--weight-transfer-config" in argv
    assert cpu.env["VLLM_SERVER_DEV_MODE"] == "1" and cpu.env["VLLM_CPU_KVCACHE_SPACE"]
    assert "--gpu-memory-utilization 0.3" in argv and argv.endswith("--enable-lora --max-lora-rank 8")
    assert cpu.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    gpu = build_serve_command(
        "Qwen/Qwen3-0.6B", gpu=True, max_model_len=4096, extra=["--logprobs-mode", "raw_logprobs"]
    )
    gargv = " ".join(gpu.argv)
    assert (
        '{"backend": "nccl"}' in gargv and "--api-server-count 8" in gargv and "--max-model-len 4096" in gargv
    )
    assert gargv.count("--logprobs-mode") == 1 and "raw_logprobs" in gargv  # user flags win
    # Issue 35 item 7: on CPU the server computes in the trainer's dtype (float32) unless told
    # otherwise; on GPU vLLM's own choice stands.
    assert "--dtype float32" in argv and "--dtype" not in gargv
    given = build_serve_command("/m", gpu=False, extra=["--dtype", "bfloat16"])
    assert given.argv.count("--dtype") == 1 and given.argv[-1] == "bfloat16"
    # Issue 30: a scheduling policy is the operator's flag, passed through unchanged (eval uses it)
    priority = build_serve_command("/m", gpu=False, extra=["--scheduling-policy", "priority"])
    assert priority.argv.count("--scheduling-policy") == 1 and priority.argv[-1] == "priority"


def test_trainer_cli_help():
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0
    for command in ("tiny OUTDIR", "serve MODEL", "train --config RUN.yaml"):
        assert command in out.stdout
