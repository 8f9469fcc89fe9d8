"""API tokens, stored hashed.

The key is shown once, when issued; the database keeps only its SHA-256 (a leaked database or backup
does not hand out working tokens) and an 8-character prefix to tell tokens apart in lists. A token is
revoked by setting ``revoked_at``; a revoked token never authenticates again.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    key_sha256 = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=8)
    name = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(key_sha256__regex=r"^[0-9a-f]{64}$"), name="api_token_hash_hex"
            ),
        ]

    def __str__(self) -> str:
        state = "revoked" if self.revoked_at else "active"
        return f"token {self.prefix}… of {self.user} ({state})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None
