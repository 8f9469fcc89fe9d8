"""``manage.py runstack``: the whole local stack in the foreground (what ``make run`` starts).

Migrates, starts the ASGI web server (daphne) and a Celery worker, builds the embedded tiny model
once (cached), prints the dashboard URL, and on Ctrl-C / SIGTERM stops everything it started.
"""

from __future__ import annotations

import signal
import sys
import time

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

from worker.processes import ManagedProcess, http_ok, stop_all, wait_for


class Command(BaseCommand):
    help = "Run web (ASGI) + Celery worker in the foreground; Ctrl-C stops both."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--no-tiny", action="store_true", help="do not build the embedded tiny model")
        parser.add_argument("--no-demo", action="store_true", help="do not start the demo run")

    def handle(self, *args, **opts):
        port, host = opts["port"], opts["host"]
        call_command("migrate", interactive=False, verbosity=0)
        logs = settings.BASE_DIR / "var" / "log"
        processes = [
            ManagedProcess(
                "web",
                [
                    sys.executable,
                    "-m",
                    "daphne",
                    "-b",
                    host,
                    "-p",
                    str(port),
                    "controlplane.asgi:application",
                ],
                log_path=logs / "web.log",
            ),
            ManagedProcess(
                "worker",
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "worker",
                    "worker",
                    "-Q",
                    "default,gpu",
                    "-c",
                    "2",
                    "--loglevel",
                    "INFO",
                ],
                log_path=logs / "worker.log",
            ),
        ]
        stopping = {"flag": False}

        def _stop(signum, frame):
            stopping["flag"] = True

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        try:
            for process in processes:
                process.start()
                self.stdout.write(f"{process.name}: pid {process.pid}, log {process.log_path}")
            url = f"http://{host}:{port}/"
            wait_for(lambda: http_ok(url + "healthz"), timeout_s=60, what=f"the web server on {url}")
            if not opts["no_tiny"]:
                self.stdout.write("building the embedded tiny model (cached after the first time)...")
                from trainer.registry import resolve_model

                self.stdout.write(f"tiny model: {resolve_model('tiny')}")
            if not opts["no_demo"]:
                self._start_demo_run()
            self.stdout.write(
                self.style.SUCCESS(f"dashboard: {url}  (logs in {logs}; Ctrl-C stops everything)")
            )
            while not stopping["flag"]:
                for process in processes:
                    if process.poll() is not None:
                        self.stderr.write(
                            f"{process.name} exited ({process.poll()}):\n{process.log_tail(20)}"
                        )
                        stopping["flag"] = True
                time.sleep(0.5)
        finally:
            self.stdout.write("stopping web and worker...")
            stop_all(processes, grace_s=15)
        return None

    def _start_demo_run(self) -> None:
        try:
            from controlplane.runs.services import demo_run_start  # added with the runs app
        except ImportError:
            self.stdout.write("demo run: the runs app is not installed yet; skipping")
            return
        run = demo_run_start()
        self.stdout.write(f"demo run #{run.pk} started")
