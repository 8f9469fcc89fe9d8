"""Access: issue, check and revoke API tokens; count failed logins (HackSoft style: keyword-only)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from controlplane.access.models import ApiToken

# last_used_at is refreshed at most this often (a busy CI token must not write on every request)
LAST_USED_RESOLUTION = timedelta(minutes=1)


def token_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def token_issue(*, username: str, name: str = "", revoke_others: bool = False) -> str:
    """A new API token for ``username`` (the user is created when missing). Returns the key, which is
    not stored: only its hash. Earlier tokens keep working unless ``revoke_others``."""
    with transaction.atomic():
        user, _ = get_user_model().objects.get_or_create(username=username)
        if revoke_others:
            token_revoke(user=user)
        key = secrets.token_hex(20)
        ApiToken.objects.create(user=user, key_sha256=token_hash(key), prefix=key[:8], name=name)
    return key


def token_revoke(*, user: Any, prefix: str | None = None) -> int:
    """Revoke ``user``'s active tokens (only those starting with ``prefix`` when given). Returns the count."""
    tokens = ApiToken.objects.filter(user=user, revoked_at__isnull=True)
    if prefix:
        tokens = tokens.filter(prefix=prefix[:8])
    return tokens.update(revoked_at=timezone.now())


def token_user(*, key: str) -> Any | None:
    """The active user an unrevoked token belongs to, or None."""
    if not key or len(key) > 200:
        return None
    token = (
        ApiToken.objects.select_related("user")
        .filter(key_sha256=token_hash(key), revoked_at__isnull=True)
        .first()
    )
    if token is None or not token.user.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user


# ------------------------------------------------------------------------------ login limits
def _login_keys(*, username: str, ip: str) -> tuple[str, str]:
    digest = hashlib.sha256(username.strip().lower().encode("utf-8", "replace")).hexdigest()[:16]
    return f"login-fail:{ip}:{digest}", f"login-fail-ip:{ip}"


def login_blocked_for(*, username: str, ip: str) -> int:
    """Seconds until ``ip`` may try ``username`` again (0 = now). Failures are counted per
    (ip, username) and per ip, in a window of ``GRPO_LOGIN_WINDOW_S`` seconds."""
    user_key, ip_key = _login_keys(username=username, ip=ip)
    counts = cache.get_many([user_key, ip_key])
    if counts.get(user_key, 0) >= settings.GRPO_LOGIN_MAX_FAILURES or counts.get(ip_key, 0) >= (
        settings.GRPO_LOGIN_MAX_FAILURES * 5
    ):
        return int(settings.GRPO_LOGIN_WINDOW_S)
    return 0


def login_failure_record(*, username: str, ip: str) -> None:
    for key in _login_keys(username=username, ip=ip):
        cache.add(key, 0, timeout=settings.GRPO_LOGIN_WINDOW_S)
        try:
            cache.incr(key)
        except ValueError:  # expired between add and incr
            cache.set(key, 1, timeout=settings.GRPO_LOGIN_WINDOW_S)


def login_success_record(*, username: str, ip: str) -> None:
    user_key, _ = _login_keys(username=username, ip=ip)
    cache.delete(user_key)
