#!/usr/bin/env python
"""Django's command-line utility for the control plane."""

import os
import sys

# Commands that cannot work without Postgres (and Redis): checked first, so a missing service is
# one clear line instead of a traceback.
NEEDS_SERVICES = {"migrate", "runserver", "runstack", "issue_token", "createsuperuser", "shell", "dbshell"}


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.management import execute_from_command_line

    if len(sys.argv) > 1 and sys.argv[1] in NEEDS_SERVICES:
        import django

        django.setup()
        from controlplane.preflight import require_services

        require_services(broker=sys.argv[1] in ("runstack", "runserver"))
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
