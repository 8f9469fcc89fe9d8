"""``python manage.py registry [--json]``: every registered name, by kind, with its origin, the first
line of its docstring and (rewards) the dataset columns it reads; broken plugins with their error."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand

from controlplane.runs.selectors import REGISTRY_KEYS, registry_get


class Command(BaseCommand):
    help = "List the registered models, datasets, reward functions, tools, environments and rollout loops."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="print GET /api/v1/registry/'s JSON")

    def handle(self, *args, **opts):
        listing = registry_get()
        if opts["json"]:
            self.stdout.write(json.dumps(listing, indent=2))
            return
        for key in REGISTRY_KEYS.values():
            self.stdout.write(self.style.MIGRATE_HEADING(f"{key}:"))
            if not listing[key]:
                self.stdout.write("  (none)")
            for name, entry in listing[key].items():
                origin = f"{entry['origin']['package']} {entry['origin']['version']}"
                columns = f"  [reads: {', '.join(entry['columns'])}]" if entry.get("columns") else ""
                if entry.get("broken"):
                    self.stdout.write(self.style.ERROR(f"  {name}  ({origin})  BROKEN: {entry['error']}"))
                else:
                    self.stdout.write(f"  {name}  ({origin})  {entry['doc']}{columns}")
        for module, error in listing["plugin_errors"].items():
            self.stdout.write(self.style.ERROR(f"plugin module {module}: BROKEN: {error}"))
