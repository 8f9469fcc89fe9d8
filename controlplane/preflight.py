"""Fail fast, in one line, when Postgres or Redis is not reachable.

Used by ``manage.py`` (commands that need the database), ``runstack`` and the Celery worker, so that
a newcomer sees which service is missing and how to start it instead of a traceback.
"""

from __future__ import annotations

import sys
from urllib.parse import urlparse

HINT = "start it (e.g. `docker compose up -d postgres redis`) or point {var} at a running one"


class ServiceUnavailable(RuntimeError):
    """A required service is unreachable; ``str()`` is the one-line message for the user."""


def check_postgres(url: str, *, create_database: bool = True, timeout: float = 3.0) -> None:
    """Connect to the database of ``url``; create it when the server is up but the database is not."""
    import psycopg

    parsed = urlparse(url)
    where = f"{parsed.hostname or 'localhost'}:{parsed.port or 5432}"
    dbname = (parsed.path or "/").lstrip("/") or "postgres"
    try:
        psycopg.connect(url, connect_timeout=int(max(timeout, 1))).close()
        return
    except psycopg.OperationalError as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        if create_database and f'database "{dbname}" does not exist' in str(exc):
            _create_database(url, dbname, timeout)
            return
        raise ServiceUnavailable(
            f"PostgreSQL is unreachable at {where} ({message}): " + HINT.format(var="DATABASE_URL")
        ) from None


def _create_database(url: str, dbname: str, timeout: float) -> None:
    import psycopg
    from psycopg import sql

    admin_url = urlparse(url)._replace(path="/postgres").geturl()
    with psycopg.connect(admin_url, connect_timeout=int(max(timeout, 1)), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))


def check_redis(url: str, *, timeout: float = 3.0) -> None:
    """PING the Redis server of ``url``."""
    import redis

    parsed = urlparse(url)
    where = f"{parsed.hostname or 'localhost'}:{parsed.port or 6379}"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping()
    except redis.RedisError as exc:
        raise ServiceUnavailable(
            f"Redis is unreachable at {where} ({exc}): " + HINT.format(var="REDIS_URL")
        ) from None


def require_services(*, database: bool = True, broker: bool = True) -> None:
    """Check the configured services; on failure print one line to stderr and exit with status 2."""
    from django.conf import settings

    try:
        if database:
            check_postgres(settings.DATABASE_URL)
        if broker:
            check_redis(settings.REDIS_URL)
    except ServiceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
