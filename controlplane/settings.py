"""Django settings, configured from the environment.

``DATABASE_URL`` (default ``postgres://postgres@127.0.0.1:5432/grpo``), ``REDIS_URL`` (default
``redis://127.0.0.1:6379/0``; Celery broker and Channels layer), ``SECRET_KEY``, ``DEBUG``,
``ALLOWED_HOSTS`` (comma-separated), ``GRPO_RUNS_DIR`` (where run output directories go).
Production hardening lives in ``controlplane.settings_production``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


DEBUG = env_bool("DEBUG", True)
SECRET_KEY = os.environ.get("SECRET_KEY") or "dev-insecure-key-change-me-in-production-0123456789abcdef"
ALLOWED_HOSTS = [
    h.strip() for h in os.environ.get("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",") if h
]

DATABASE_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/grpo")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "controlplane.core",
    "controlplane.access",
    "controlplane.runs",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.core.middleware.ContentSecurityPolicyMiddleware",
    "controlplane.core.middleware.NotFoundPageMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# Scripts from this origin only (no inline script anywhere; uPlot is vendored); inline styles allowed.
GRPO_CONTENT_SECURITY_POLICY = os.environ.get(
    "GRPO_CONTENT_SECURITY_POLICY",
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'",
)
# A websocket frame from a client larger than this closes the socket with 1009 (message too big).
GRPO_WS_MAX_FRAME_BYTES = int(os.environ.get("GRPO_WS_MAX_FRAME_BYTES", "65536"))
# Seconds a websocket handshake may take before daphne resets the connection (daphne's default is 5:
# 150 pages connecting at once to a loaded web process got resets while they waited their turn).
GRPO_WS_HANDSHAKE_TIMEOUT_S = int(os.environ.get("GRPO_WS_HANDSHAKE_TIMEOUT_S", "30"))

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Persistent connections off by default (Django's advice under ASGI): daphne runs each request's sync
# code in a worker thread, and with a max age every such thread kept its own connection (one daphne
# held 71 and Postgres refused clients). Workers may raise it; 0 closes at each request's end.
GRPO_DB_CONN_MAX_AGE = int(os.environ.get("GRPO_DB_CONN_MAX_AGE", "0"))
DATABASES = {
    "default": dj_database_url.parse(
        DATABASE_URL, conn_max_age=GRPO_DB_CONN_MAX_AGE, conn_health_checks=GRPO_DB_CONN_MAX_AGE > 0
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Shared by every web process (login failure counts must be, or a limit per process means nothing).
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        # Per deployment (the login limiter and the run-creation throttle count here); a test session
        # takes its own, like GRPO_CHANNEL_PREFIX.
        "KEY_PREFIX": os.environ.get("GRPO_CACHE_PREFIX", "grpo"),
    }
}
# Run creation (API and form): at most this many creations per user (DRF rate syntax, e.g. "30/min"),
# and at most this many of a user's runs waiting as queued at once.
GRPO_RUN_CREATE_RATE = os.environ.get("GRPO_RUN_CREATE_RATE", "30/min")
GRPO_MAX_QUEUED_RUNS_PER_USER = int(os.environ.get("GRPO_MAX_QUEUED_RUNS_PER_USER", "20"))
GRPO_LOGIN_MAX_FAILURES = int(os.environ.get("GRPO_LOGIN_MAX_FAILURES", "10"))
GRPO_LOGIN_WINDOW_S = int(os.environ.get("GRPO_LOGIN_WINDOW_S", "300"))

# redis-py 8 gives every connection a 5 s socket read timeout, the same as channels-redis's blocking
# pop (BZPOPMIN, brpop_timeout = 5 s): an idle consumer's read then races the server's empty answer
# and often loses, raising TimeoutError and closing the browser's websocket every few seconds. Reads
# must outlast the pop; a dead Redis is still detected, after this many seconds (None = never).
GRPO_CHANNEL_SOCKET_TIMEOUT_S = float(os.environ.get("GRPO_CHANNEL_SOCKET_TIMEOUT_S", "30"))
# Key prefix of the Channels layer in Redis: deployments (or test sessions) sharing one Redis keep
# their run streams apart (group names are run-<id>, and two databases reuse ids).
GRPO_CHANNEL_PREFIX = os.environ.get("GRPO_CHANNEL_PREFIX", "asgi")
# Redis connections one web process's channel layer may hold at once (redis-py's pool; its default,
# 100, was exhausted by 100 sockets connecting at once: each join holds one while it runs). A socket
# that still finds the pool full is closed with 4503 (HTTP 503 + 4000: try again later), never 1011.
GRPO_CHANNEL_MAX_CONNECTIONS = int(os.environ.get("GRPO_CHANNEL_MAX_CONNECTIONS", "1000"))
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [
                {
                    "address": REDIS_URL,
                    "socket_timeout": GRPO_CHANNEL_SOCKET_TIMEOUT_S,
                    "max_connections": GRPO_CHANNEL_MAX_CONNECTIONS,
                }
            ],
            "capacity": 1000,
            "expiry": 30,
            "prefix": GRPO_CHANNEL_PREFIX,
        },
    }
}

# Celery (worker/celery.py reads every CELERY_* setting). Long supervisor tasks: ack late, one task
# prefetched at a time, redelivery only after a run could have finished (NOTES.md).
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 7 * 24 * 3600}
CELERY_RESULT_EXPIRES = 24 * 3600
CELERY_TASK_DEFAULT_QUEUE = "default"
# A Redis restart must not cancel a supervisor task: its run trains on and the task reconnects
# (tests/faults/test_run_faults.py bounces Redis mid-run). Celery's default, pinned: 6.0 flips it.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
# Each worker also consumes a queue of its own (``<worker name>.dq2``): the first host of a trainer
# across hosts sends each further host's worker its part there (controlplane/runs/services/nodes.py).
CELERY_WORKER_DIRECT = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.access.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON nested too deeply for Python's parser is a 400, not a RecursionError (500).
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.runs.serializers.SafeJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "GRPO control plane API",
    "DESCRIPTION": "Create, watch, stop and resume async GRPO runs.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
}

GRPO_RUNS_DIR = Path(os.environ.get("GRPO_RUNS_DIR") or BASE_DIR / "var" / "runs")


def env_list(name: str) -> list[str]:
    return [p.strip() for p in os.environ.get(name, "").replace(os.pathsep, ",").split(",") if p.strip()]


def env_named_urls(name: str) -> dict[str, str]:
    """``"a=http://h:8000,b=http://g:8000"`` -> ``{"a": "http://h:8000", ...}`` (startup error if malformed)."""
    from urllib.parse import urlparse

    named: dict[str, str] = {}
    # Commas only (env_list also splits on os.pathsep, the ':' every URL has).
    for item in (p.strip() for p in os.environ.get(name, "").split(",") if p.strip()):
        key, sep, url = item.partition("=")
        key, url = key.strip(), url.strip().rstrip("/")
        if not sep or not key or urlparse(url).scheme not in ("http", "https") or not urlparse(url).hostname:
            raise ImproperlyConfigured(f"{name}: {item!r} is not NAME=http(s)://host:port")
        named[key] = url
    return named


def env_port_range(name: str, default: str) -> tuple[int, int]:
    low, _, high = os.environ.get(name, default).partition("-")
    return int(low), int(high or low)


# Runs (controlplane.runs + worker.supervisor). Run supervision tasks go to this Celery queue: a
# worker started with `-Q gpu` on another machine adds capacity.
GRPO_RUNS_QUEUE = os.environ.get("GRPO_RUNS_QUEUE", "gpu")
CELERY_TASK_ROUTES = {"worker.run_supervise": {"queue": GRPO_RUNS_QUEUE}}
CELERY_BEAT_SCHEDULE = {"runs-check-stale": {"task": "worker.runs_check_stale", "schedule": 60.0}}
# Worker pools: a run's `resources.pool` names the Celery queue it goes to (default: GRPO_RUNS_QUEUE).
# Start each pool's workers with `-Q <pool>`; a pool is typically one kind of GPU host.
GRPO_RUN_POOLS = env_list("GRPO_RUN_POOLS") or [GRPO_RUNS_QUEUE]
# External vLLM servers a run may name with `resources.server` instead of starting its own:
# "name=url,name=url" (e.g. "vllm=http://vllm:8000"). One run at a time uses a named server (its
# weights are the run's policy); the next waits as queued.
GRPO_VLLM_SERVERS = env_named_urls("GRPO_VLLM_SERVERS")
# The GPUs this worker may place runs on ("0,1,2,3", or "none"); unset: CUDA_VISIBLE_DEVICES, else
# every GPU nvidia-smi lists, else none (a CPU worker). Read by the worker (worker/inventory.py).
GRPO_WORKER_GPUS = os.environ.get("GRPO_WORKER_GPUS")
# The host name this worker places runs on and announces (runs, GPUs and ports are leased per host),
# and the address other hosts reach it at: a trainer across hosts (resources.trainer.nodes) has its
# rendezvous there, and its own vLLM server listens there. Two workers on one machine with distinct
# host names act as two hosts (tests/test_nodes.py).
GRPO_WORKER_HOST = os.environ.get("GRPO_WORKER_HOST") or socket.gethostname()
GRPO_WORKER_ADDRESS = os.environ.get("GRPO_WORKER_ADDRESS") or GRPO_WORKER_HOST
# A trainer across hosts: the first host's rendezvous (torch.distributed.run's c10d store) takes a
# free port of this range; open it, and the hosts' traffic to one another, between the pool's hosts.
GRPO_RENDEZVOUS_PORTS = env_port_range("GRPO_RENDEZVOUS_PORTS", "29400-29499")
# A trainer across hosts fails, naming the host, when one of its other hosts' workers has not
# refreshed its node's heartbeat for this many s (its worker or machine is gone), or has not started
# its part this many s after the first host asked it to.
GRPO_NODE_LOST_AFTER_S = float(os.environ.get("GRPO_NODE_LOST_AFTER_S", "30"))
GRPO_NODE_JOIN_TIMEOUT_S = float(os.environ.get("GRPO_NODE_JOIN_TIMEOUT_S", "300"))
# A run whose GPUs (or named server) are busy stays queued and its task retries after this many s.
GRPO_PLACEMENT_RETRY_S = float(os.environ.get("GRPO_PLACEMENT_RETRY_S", "5"))
# Each live run's vLLM server gets its own port from this range (per worker host).
GRPO_VLLM_PORTS = env_port_range("GRPO_VLLM_PORTS", "8100-8199")
# Extra flags for every run's `python -m trainer serve` (shell syntax), e.g. "--enable-lora".
GRPO_VLLM_EXTRA_ARGS = os.environ.get("GRPO_VLLM_EXTRA_ARGS", "")
GRPO_VLLM_START_TIMEOUT_S = float(os.environ.get("GRPO_VLLM_START_TIMEOUT_S", "900"))
# A run's own vLLM server without resources.vllm.max_model_len gets the run's lengths (longest prompt
# + max_completion_length) rounded up to a multiple of this many tokens, capped at the model's limit.
GRPO_VLLM_MAX_MODEL_LEN_MULTIPLE = int(os.environ.get("GRPO_VLLM_MAX_MODEL_LEN_MULTIPLE", "256"))
# Preflight (controlplane/runs/launch_checks.py): prompts tokenized per dataset to find the longest
# (a larger dataset is sampled, and the refusal says so), and seconds a named server's /v1/models and
# /server_info may take to answer (no answer: not refused, the server may start later).
GRPO_PREFLIGHT_SAMPLE_ROWS = int(os.environ.get("GRPO_PREFLIGHT_SAMPLE_ROWS", "2000"))
GRPO_PREFLIGHT_SERVER_TIMEOUT_S = float(os.environ.get("GRPO_PREFLIGHT_SERVER_TIMEOUT_S", "2"))
# The supervisor refreshes Run.heartbeat_at this often; a live run silent for longer than
# GRPO_RUN_STALE_AFTER_S lost its worker and is marked failed.
GRPO_RUN_HEARTBEAT_S = float(os.environ.get("GRPO_RUN_HEARTBEAT_S", "2"))
GRPO_RUN_STALE_AFTER_S = float(os.environ.get("GRPO_RUN_STALE_AFTER_S", "90"))
# Stop: SIGTERM, then SIGKILL after this many seconds. A worker's shutdown first gives each live run's
# trainer this long to save a checkpoint at its step's end (the run is then `interrupted`).
GRPO_STOP_GRACE_S = float(os.environ.get("GRPO_STOP_GRACE_S", "10"))
# A worker that starts resumes the interrupted runs of its host and pools (from their checkpoint).
GRPO_RESUME_INTERRUPTED = env_bool("GRPO_RESUME_INTERRUPTED", True)
# A run launched by a worker fails once this many groups in a row were dropped (equal rewards: nothing
# to train), instead of holding its GPUs forever; the document's args.max_dropped_groups wins; 0: never.
GRPO_MAX_DROPPED_GROUPS = int(os.environ.get("GRPO_MAX_DROPPED_GROUPS", "1000"))
# Local model directories / dataset files a web or API document may name (besides registry names).
GRPO_ALLOWED_MODEL_ROOTS = env_list("GRPO_ALLOWED_MODEL_ROOTS")
GRPO_ALLOWED_DATASET_ROOTS = env_list("GRPO_ALLOWED_DATASET_ROOTS")
# Bounds on a run's resources that hold before any worker has registered what its host has (then
# the registered hosts bound them): GPUs of one run (it gets one host's), trainer processes of a CPU
# run, and the context of its vLLM server.
GRPO_MAX_RUN_GPUS = int(os.environ.get("GRPO_MAX_RUN_GPUS", "16"))
GRPO_MAX_TRAINER_PROCESSES = int(os.environ.get("GRPO_MAX_TRAINER_PROCESSES", "256"))
GRPO_MAX_MODEL_LEN = int(os.environ.get("GRPO_MAX_MODEL_LEN", "1048576"))
# A local folder named as a model or dataset is walked (links followed) to check that nothing in it
# leads out of those roots; a folder with more entries than this is refused (the walk's bound).
GRPO_LOCAL_SOURCE_MAX_ENTRIES = int(os.environ.get("GRPO_LOCAL_SOURCE_MAX_ENTRIES", "10000"))
# Hub repo ids a web document may name (glob patterns, e.g. "Qwen/*,meta-llama/Llama-3.2-*"); empty
# means none. The worker downloads with its own HF_TOKEN; HF_HUB_OFFLINE=1 keeps it to its cache.
GRPO_ALLOWED_HUB_MODELS = env_list("GRPO_ALLOWED_HUB_MODELS")
GRPO_ALLOWED_HUB_DATASETS = env_list("GRPO_ALLOWED_HUB_DATASETS")
# attn_implementation values a web document may use besides eager / sdpa / flex_attention.
GRPO_ALLOWED_ATTN_IMPLEMENTATIONS = env_list("GRPO_ALLOWED_ATTN_IMPLEMENTATIONS")
GRPO_COMPLETIONS_PER_STEP = int(os.environ.get("GRPO_COMPLETIONS_PER_STEP", "64"))
# The supervisor reads a live run's metrics.jsonl / completions.jsonl this often (seconds), at most
# this many bytes per file and read (a backlog after a worker restart takes a few reads).
GRPO_INGEST_POLL_S = float(os.environ.get("GRPO_INGEST_POLL_S", "0.1"))
GRPO_INGEST_MAX_READ_BYTES = int(os.environ.get("GRPO_INGEST_MAX_READ_BYTES", str(8 << 20)))
# A run's tags and note as the API and the pages accept them (the database's ceilings, 64 tags of
# 64 characters and a 20,000-character note, bound them: see controlplane/runs/models.py).
GRPO_RUN_MAX_TAGS = int(os.environ.get("GRPO_RUN_MAX_TAGS", "16"))
GRPO_RUN_TAG_MAX_CHARS = int(os.environ.get("GRPO_RUN_TAG_MAX_CHARS", "40"))
GRPO_RUN_NOTE_MAX_CHARS = int(os.environ.get("GRPO_RUN_NOTE_MAX_CHARS", "4000"))
# Charts a user may pin at the top of the run page (PUT /api/v1/preferences/charts/).
GRPO_MAX_PINNED_CHARTS = int(os.environ.get("GRPO_MAX_PINNED_CHARTS", "24"))
# Runs per page of the run list (the page and GET /api/v1/runs/ without page_size).
GRPO_RUN_LIST_PAGE_SIZE = int(os.environ.get("GRPO_RUN_LIST_PAGE_SIZE", "50"))
# The comparison page and GET /api/v1/runs/compare/: runs compared at once (each live one is a
# websocket of the page; 8 = the chart palette's distinct colours) and metrics charted at once.
GRPO_COMPARE_MAX_RUNS = int(os.environ.get("GRPO_COMPARE_MAX_RUNS", "8"))
GRPO_COMPARE_MAX_METRICS = int(os.environ.get("GRPO_COMPARE_MAX_METRICS", "16"))
# The completions API and the run page's completions table: characters of a ?q= search, and groups
# per page of ?by=group (default, and the most a page_size may ask for).
GRPO_COMPLETION_SEARCH_MAX_CHARS = int(os.environ.get("GRPO_COMPLETION_SEARCH_MAX_CHARS", "200"))
GRPO_COMPLETION_GROUPS_PAGE_SIZE = int(os.environ.get("GRPO_COMPLETION_GROUPS_PAGE_SIZE", "10"))
GRPO_COMPLETION_GROUPS_MAX_PAGE_SIZE = int(os.environ.get("GRPO_COMPLETION_GROUPS_MAX_PAGE_SIZE", "100"))
GRPO_DEMO_PASSWORD = os.environ.get("GRPO_DEMO_PASSWORD", "demo")
# The demo run trains on this registered vLLM server (a name of GRPO_VLLM_SERVERS) instead of starting
# its own; empty: its own, as any run without `resources.server`.
GRPO_DEMO_SERVER = os.environ.get("GRPO_DEMO_SERVER", "")

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []
STATIC_ROOT = BASE_DIR / "var" / "static"
# The ASGI app serves /static/ itself (one box, no nginx needed); false where a proxy serves STATIC_ROOT.
GRPO_SERVE_STATIC = env_bool("GRPO_SERVE_STATIC", True)
LOGIN_URL = "/runs/login/"
LOGIN_REDIRECT_URL = "/runs/"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
