"""``python manage.py run_gate``: a CI gate on a training run (feature X2).

Creates a run through the REST API from a RUN.yaml (or follows an existing one with ``--run``),
prints its progress, waits for it to end, and exits 0 only if the metric's last logged value
reaches the threshold::

    python manage.py run_gate --config RUN.yaml --metric reward --min 0.6 \\
        --url https://grpo.example.com --token "$GRPO_API_TOKEN"

``--metric`` is any logged name, an evaluation's too (``eval/pass@1``, ``eval/reward``: their last
value is the latest step evaluated, whichever line of metrics.jsonl brought it).

Exit status: 0 the threshold is met; 1 it is not; 2 the run did not complete (failed, stopped,
config rejected, metric never logged, API error); 3 timed out (a run the gate created is stopped).
An ``interrupted`` run (its worker was shut down) is waited for: it resumes from its checkpoint when
a worker of its host starts.
Only HTTP is used (no database access), so it runs anywhere the API is reachable.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from trainer.config.run_config import RunConfigError, read_run_file
from trainer.reporting.metrics import REWARD

EXIT_PASS, EXIT_BELOW, EXIT_RUN, EXIT_TIMEOUT = 0, 1, 2, 3
TERMINAL = ("completed", "failed", "stopped")  # not "interrupted": it goes on when its worker is back


class GateError(Exception):
    """Ends the gate with exit status 2 and a message."""


class Api:
    """The few REST calls the gate makes (token auth, JSON)."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 30.0):
        self.base = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: Any = None, headers: dict | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if self.token:
            request.add_header("Authorization", f"Token {self.token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            payload = exc.read()
            try:
                return exc.code, json.loads(payload or b"null")
            except json.JSONDecodeError:
                return exc.code, payload.decode("utf-8", "replace")[:500]
        except urllib.error.URLError as exc:
            raise GateError(f"cannot reach {self.base}: {exc.reason}") from None


class Command(BaseCommand):
    help = "Create (or follow) a run through the API, wait, and exit 0 only if a metric reaches a threshold."

    def add_arguments(self, parser: CommandParser) -> None:
        what = parser.add_mutually_exclusive_group(required=True)
        what.add_argument("--config", help="RUN.yaml to create a run from")
        what.add_argument("--run", type=int, help="follow an existing run instead of creating one")
        parser.add_argument("--metric", default=REWARD, help=f"metric name as logged (default: {REWARD})")
        parser.add_argument("--min", type=float, default=None, help="pass if the last value >= MIN")
        parser.add_argument("--max", type=float, default=None, help="pass if the last value <= MAX")
        parser.add_argument("--name", default="", help="run name (default: 'MODEL on DATASET')")
        parser.add_argument("--url", default=os.environ.get("GRPO_API_URL", "http://127.0.0.1:8000"))
        parser.add_argument("--token", default=os.environ.get("GRPO_API_TOKEN", ""))
        parser.add_argument(
            "--idempotency-key",
            default=os.environ.get("GRPO_IDEMPOTENCY_KEY", ""),
            help="makes a retried CI job reuse its run (default: a new key per invocation)",
        )
        parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds to wait (default 6 h)")
        parser.add_argument("--poll", type=float, default=5.0, help="seconds between progress polls")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["min"] is None and opts["max"] is None:
            self.stderr.write("run_gate: give --min and/or --max")
            raise SystemExit(EXIT_RUN)
        api = Api(opts["url"], opts["token"])
        try:
            code = self._gate(api, opts)
        except GateError as exc:
            self.stderr.write(f"run_gate: {exc}")
            code = EXIT_RUN
        raise SystemExit(code)

    def _gate(self, api: Api, opts: dict) -> int:
        created = opts["run"] is None
        run_id = self._create(api, opts) if created else opts["run"]
        metric = opts["metric"]
        deadline = time.monotonic() + opts["timeout"]
        last_step, last_value, status = -1, None, None
        while True:
            run = self._get(api, f"/api/v1/runs/{run_id}/")
            if run["status"] != status:
                status = run["status"]
                self._say(f"run {run_id}: {status}")
            for point in self._series(api, run_id, metric, last_step):
                last_step, last_value = point["step"], point["value"]
                self._say(f"run {run_id}: step {last_step} {metric}={last_value}")
            if status in TERMINAL:
                break
            if time.monotonic() > deadline:
                self._say(f"run {run_id}: timed out after {opts['timeout']:.0f} s ({status})")
                if created:
                    api.call("POST", f"/api/v1/runs/{run_id}/stop/")
                return EXIT_TIMEOUT
            time.sleep(opts["poll"])
        if status != "completed":
            reason = (run.get("failure_reason") or "").strip().splitlines()
            raise GateError(f"run {run_id} ended {status}" + (f": {reason[0]}" if reason else ""))
        if last_value is None:
            raise GateError(f"run {run_id} never logged a finite {metric!r}")
        return self._verdict(metric, last_step, last_value, opts["min"], opts["max"])

    def _create(self, api: Api, opts: dict) -> int:
        try:
            document = read_run_file(opts["config"])
        except RunConfigError as exc:
            raise GateError("; ".join(exc.errors.values())) from None
        key = opts["idempotency_key"] or f"run-gate-{uuid.uuid4()}"
        status, body = api.call(
            "POST",
            "/api/v1/runs/",
            {"name": opts["name"], "config": document},
            headers={"Idempotency-Key": key},
        )
        if status == 400 and isinstance(body, dict):
            errors = body.get("config", body)
            lines = [
                f"  {k}: {v if isinstance(v, str) else ' '.join(map(str, v))}" for k, v in errors.items()
            ]
            raise GateError("the API rejected the config:\n" + "\n".join(lines))
        if status != 201:
            raise GateError(f"creating the run failed: HTTP {status}: {body}")
        self._say(f"run {body['id']} created: {body.get('web_url') or body['url']}")
        return int(body["id"])

    def _get(self, api: Api, path: str) -> dict:
        status, body = api.call("GET", path)
        if status != 200:
            raise GateError(f"GET {path}: HTTP {status}: {body}")
        return body

    def _series(self, api: Api, run_id: int, metric: str, since_step: int) -> list[dict]:
        query = f"?names={urllib.request.quote(metric)}" + (
            f"&since_step={since_step}" if since_step >= 0 else ""
        )
        body = self._get(api, f"/api/v1/runs/{run_id}/metrics/{query}")
        return [p for p in body["series"].get(metric, []) if p["value"] is not None]

    def _verdict(self, metric: str, step: int, value: float, low: float | None, high: float | None) -> int:
        ok = (low is None or value >= low) and (high is None or value <= high)
        bounds = " and ".join(
            b
            for b in ((f">= {low}" if low is not None else ""), (f"<= {high}" if high is not None else ""))
            if b
        )
        verdict = "PASS" if ok else "FAIL"
        self._say(f"{verdict}: {metric} = {value} at step {step} (needs {bounds})")
        return EXIT_PASS if ok else EXIT_BELOW

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()
