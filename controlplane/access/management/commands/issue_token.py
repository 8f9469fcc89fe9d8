"""``python manage.py issue_token USERNAME [--staff] [--name N] [--revoke-others]``: print a new API
token (creating the user). The key is printed once; only its hash is stored."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from controlplane.access.services import token_issue


class Command(BaseCommand):
    help = "Print a new REST API token for USERNAME (the user is created when missing)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--staff", action="store_true", help="let this user see every user's runs")
        parser.add_argument("--name", default="", help="a label for the token (e.g. 'github-ci')")
        parser.add_argument(
            "--revoke-others", action="store_true", help="revoke the user's earlier tokens (rotation)"
        )

    def handle(self, *args, **opts):
        key = token_issue(username=opts["username"], name=opts["name"], revoke_others=opts["revoke_others"])
        if opts["staff"]:
            get_user_model().objects.filter(username=opts["username"]).update(is_staff=True)
        self.stdout.write(key)
