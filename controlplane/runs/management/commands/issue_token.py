"""``python manage.py issue_token USERNAME [--staff]``: print a new API token (creating the user)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from controlplane.runs.services import token_issue


class Command(BaseCommand):
    help = (
        "Print a new REST API token for USERNAME (the user is created when missing; old tokens stop working)."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--staff", action="store_true", help="let this user see every user's runs")

    def handle(self, *args, **opts):
        key = token_issue(username=opts["username"])
        if opts["staff"]:
            get_user_model().objects.filter(username=opts["username"]).update(is_staff=True)
        self.stdout.write(key)
