"""``python manage.py revoke_token USERNAME [--prefix ABCD1234]``: revoke a user's API tokens (all, or
the one whose key starts with the prefix). Revoked tokens never authenticate again."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from controlplane.access.services import token_revoke


class Command(BaseCommand):
    help = "Revoke USERNAME's API tokens (all, or the one with --prefix)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--prefix", default=None, help="the first 8 characters of the key to revoke")

    def handle(self, *args, **opts):
        user = get_user_model().objects.filter(username=opts["username"]).first()
        if user is None:
            raise CommandError(f"no user {opts['username']!r}")
        count = token_revoke(user=user, prefix=opts["prefix"])
        self.stdout.write(f"revoked {count} token(s) of {user.username}")
