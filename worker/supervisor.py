"""The run supervisor: one Celery task per run attempt launches and watches its processes.

An attempt (:func:`supervise_run`):

1. claims the queued run (``starting``): placed on this worker's free GPUs (``resources``; a run
   that does not fit raises ``PlacementWait`` and its task retries), its own vLLM port and output
   directory,
2. writes the launched document ``<output_dir>/RUN.yaml``: the stored config plus what the control
   plane sets (``args.output_dir``, ``args.vllm_server_base_url`` on the run's own port or the named
   server's URL, the model's local directory),
3. starts ``python -m trainer serve`` on the run's vLLM GPUs (none with a named server), its
   ``--max-model-len`` the document's or fitted to the run's lengths on the local model and dataset
   (:func:`controlplane.runs.launch_checks.per_run_max_model_len`), and waits for ``/health``,
4. stores what a previous attempt left unread in the output folder, then starts
   ``python -m trainer train --config RUN.yaml`` (``--resume CHECKPOINT`` when a previous attempt
   left one) on the trainer's GPUs, under ``torch.distributed.run`` for several processes
   (:mod:`worker.launch`), without the control plane's credentials (``worker.processes.CONTROL_PLANE_ENV``), records
   each child's environment and the trainer's ranks, and marks the run ``running``,
5. watches both, ingesting the trainer's ``metrics.jsonl``, ``completions.jsonl`` and checkpoint
   folders as they grow (:mod:`worker.tailer`, every ``INGEST_POLL_S``): trainer exit 0 ->
   ``completed``; trainer or server exit otherwise -> ``failed`` with one sentence naming the cause
   and the field to change (:func:`worker.log_records.failure_sentence`; the last log lines go to
   the run's events); ``stopping`` (set by the API) -> both are ended and the run is ``stopped``. What the
   trainer wrote last is ingested once its processes are gone, before the final status.

Every child is started through :mod:`worker.guard` in its own process group, and stopped as a
group (SIGTERM, SIGKILL after ``GRPO_STOP_GRACE_S``). The supervisor refreshes ``Run.heartbeat_at``
every ``GRPO_RUN_HEARTBEAT_S``; the same round trip tells it whether a stop was requested. A
SIGTERM to the worker's pool process (warm shutdown: Ctrl-C on ``make run``) asks the trainer to save
a checkpoint at its step's end (:mod:`trainer.processes.interrupt`), waits up to ``GRPO_STOP_GRACE_S`` for it,
ends both children and records the run ``interrupted`` (a worker of the host resumes it when it
starts); a SIGKILL leaves the guards to clean up and the staleness check to fail the run.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import re
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import yaml
from django.conf import settings
from django.db import DatabaseError, close_old_connections

from controlplane.runs import selectors, services
from controlplane.runs.models import Run, RunEventKind, RunStatus
from controlplane.runs.services import ingest
from controlplane.runs.validation import local_sources_errors
from trainer.processes.interrupt import EXIT_INTERRUPTED, interrupt_clear, interrupt_request, marker_read
from worker import log_records, nodes
from worker.launch import Rendezvous, devices_env, trainer_command, vllm_placement_flags
from worker.processes import (
    ManagedProcess,
    describe_exit,
    group_members,
    http_ok,
    install_shutdown_flag,
    start_guarded,
    wait_group_gone,
)
from worker.run_sources import hub_sources_resolve, latest_checkpoint, model_plan, resolve_model_dir
from worker.tailer import INGEST_POLL_S, RunOutputTailer

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
POLL_S = 1.0
FINAL_INGEST_TRIES = 5
LOG_EVENT_EVERY_S = 15.0
T = TypeVar("T")
DEFERRED = object()  # a control-plane write the database refused; tried again on a later poll


class AttemptEnded(Exception):
    """Ends the attempt early with a final status (stop requested, shutdown, process failure)."""

    def __init__(self, status: str, reason: str = ""):
        self.status = status
        self.reason = reason
        super().__init__(reason or status)


class RunLost(Exception):
    """The run left the active states under us (e.g. marked failed as stale): record nothing."""


def supervise_run(*, run_id: int, task_id: str, worker_name: str = "") -> str:
    """Run one attempt of ``run_id`` to its end; returns the final status (or ``skipped``).

    Raises :class:`~controlplane.runs.services.PlacementWait` when the run must wait for GPUs.
    """
    from worker.inventory import worker_gpus

    run = services.run_claim(
        run_id=run_id,
        task_id=task_id,
        worker_host=settings.GRPO_WORKER_HOST,
        worker_name=worker_name,
        gpus=worker_gpus(),
    )
    if run is None:
        logger.info("run %s: not queued for task %s; nothing to do", run_id, task_id)
        return "skipped"
    return RunSupervisor(run).run()


class RunSupervisor:
    """Launches and watches one attempt of a claimed run (see the module docstring)."""

    def __init__(self, run: Run):
        self.run_id = run.pk
        self.run_obj = run
        self.out = Path(run.output_dir)
        self.logs = self.out / "logs"
        self.port = run.vllm_port
        self.placement: dict = copy.deepcopy(run.placement or {})
        self.server_name: str | None = self.placement.get("server")
        # Every named server (resources.vllm.servers; one with resources.server); none: the run's own.
        self.server_names: list[str] = list(
            self.placement.get("servers") or ([self.server_name] if self.server_name else [])
        )
        # A trainer across hosts: the further hosts' shares (worker/nodes.py runs each).
        self.nodes: list[dict] = list(self.placement.get("nodes") or [])
        self._ranks_recorded = False
        self.vllm: ManagedProcess | None = None
        self.trainer: ManagedProcess | None = None
        self.shutdown_signal: int | None = None
        self._next_beat = 0.0
        self._next_log_event = 0.0
        self._log_offset = 0
        self.tailer = RunOutputTailer(run_id=run.pk, output_dir=self.out)

    # ------------------------------------------------------------------------------ life cycle
    def run(self) -> str:
        previous = self._install_sigterm()
        status, reason = RunStatus.FAILED, ""
        lost = False
        try:
            self._attempt()
            status = RunStatus.COMPLETED
        except AttemptEnded as end:
            status, reason = end.status, end.reason
        except RunLost:
            lost = True
        except Exception as exc:
            logger.exception("run %s: supervisor error", self.run_id)
            reason = f"supervisor error: {type(exc).__name__}: {exc}"
            services.run_event_create(
                run_id=self.run_id, kind=RunEventKind.ERROR, message=traceback.format_exc()
            )
        finally:
            trainer_code, vllm_code = self._stop_processes()
            self._ingest_final()
            self._record_exits(trainer_code, vllm_code)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if lost:
            return "lost"
        services.run_finish(
            run_id=self.run_id,
            status=status,
            failure_reason=reason,
            trainer_exit_code=trainer_code,
            vllm_exit_code=vllm_code,
        )
        return str(status)

    def _attempt(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        interrupt_clear(self.out)  # an earlier attempt's request must not stop this one
        config = self.run_obj.config
        started = time.monotonic()
        services.run_event_create(
            run_id=self.run_id, kind=RunEventKind.INFO, message=model_plan(config["model"])
        )
        refused = local_sources_errors(document=config)  # a link added since the run was created
        if refused:
            raise AttemptEnded(RunStatus.FAILED, "; ".join(f"{k}: {v}" for k, v in refused.items()))
        model_dir, dataset, eval_dataset = self._resolve_sources(config)
        services.run_event_create(
            run_id=self.run_id,
            kind=RunEventKind.INFO,
            message=f"model ready after {time.monotonic() - started:.0f} s: {model_dir}",
        )
        config_path = self._write_launch_document(model_dir, dataset, eval_dataset)
        if self.server_name is None:
            self._size_context(model_dir, dataset, config, eval_dataset)
            self._start_vllm(model_dir, config)
        self._wait_healthy()
        checkpoint = latest_checkpoint(self.out) if self.run_obj.attempt > 1 else None
        # What the last attempt wrote that its worker had not stored (killed with it), as that
        # attempt's (the charts' resume marker stays where it restarted), then a fresh completions
        # block for this attempt's re-done steps.
        self.tailer.drain(attempt=max(1, self.run_obj.attempt - 1))
        self.tailer.new_attempt()
        rendezvous = self._ask_nodes(checkpoint) if self.nodes else None
        self._start_trainer(config_path, checkpoint, rendezvous)
        resumed_from = None
        if checkpoint is not None:
            step = int(checkpoint.name.rsplit("-", 1)[1])
            resumed_from = selectors.run_checkpoint_get(
                run_id=self.run_id, step=step
            ) or ingest.checkpoint_record(run_id=self.run_id, step=step, path=str(checkpoint))
        services.run_mark_running(run_id=self.run_id, resumed_from=resumed_from)
        self._watch()

    # ------------------------------------------------------------------------------- processes
    def _resolve_sources(self, config: dict) -> tuple[str, Any, Any]:
        """The model directory, dataset and eval dataset the launch document names: registered names
        prepared, hub ids resolved to local snapshots (downloads reported as events, commits
        recorded: ``Run.sources`` ``model``, ``dataset``, ``eval_dataset``)."""

        def report(line: str) -> None:
            services.run_event_create(run_id=self.run_id, kind=RunEventKind.INFO, message=line)

        model_dir, dataset, eval_dataset, resolved = self._blocking(
            lambda: hub_sources_resolve(config=config, progress=report), what="resolving the hub sources"
        )
        if "model" not in resolved:  # a registered name (the tiny model is prepared) or a path
            model_dir = self._blocking(lambda: resolve_model_dir(model_dir), what="resolving the model")
        if resolved:
            services.run_sources_record(run_id=self.run_id, sources=resolved)
        return model_dir, dataset, eval_dataset

    def _write_launch_document(self, model_dir: str, dataset: Any, eval_dataset: Any = None) -> Path:
        """The document the trainer runs: the run's config with local directories for hub ids (the
        revisions are resolved, so they are dropped), the control plane's own args, and
        ``max_dropped_groups`` from ``GRPO_MAX_DROPPED_GROUPS`` unless the run sets it."""
        doc = copy.deepcopy(self.run_obj.config)
        doc["model"] = model_dir
        if dataset is not None:
            doc["train_dataset"] = dataset
        if eval_dataset is not None:
            doc["eval_dataset"] = eval_dataset
        doc.pop("model_revision", None)
        doc.pop("dataset_revision", None)
        doc.pop("eval_dataset_revision", None)
        args = doc.setdefault("args", {})
        args["output_dir"] = str(self.out)
        args["vllm_server_base_url"] = self.base_url
        if settings.GRPO_MAX_DROPPED_GROUPS > 0:  # a web-launched run that cannot learn ends (issue 35)
            args.setdefault("max_dropped_groups", settings.GRPO_MAX_DROPPED_GROUPS)
        path = self.out / "RUN.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    @property
    def server_urls(self) -> list[str]:
        """The URL of each server the run generates with: its named servers', or its own server's."""
        if not self.server_names:
            # trainer ranks on other hosts (rank 0 may be any host's) reach it at this host's address
            host = settings.GRPO_WORKER_ADDRESS if self.nodes else "127.0.0.1"
            return [f"http://{host}:{self.port}"]
        urls = []
        for name in self.server_names:
            url = settings.GRPO_VLLM_SERVERS.get(name)
            if url is None:
                raise AttemptEnded(
                    RunStatus.FAILED,
                    f"resources.server: {name!r} is not in this worker's GRPO_VLLM_SERVERS",
                )
            urls.append(url.rstrip("/"))
        return urls

    @property
    def base_url(self) -> str:
        """``args.vllm_server_base_url`` of the launched document (several servers: comma-separated)."""
        return ",".join(self.server_urls)

    def _with_server_names(self, sentence: str) -> str:
        """``sentence`` with each named server's URL followed by its name (the operator's word for it)."""
        for name in self.server_names:
            url = (settings.GRPO_VLLM_SERVERS.get(name) or "").rstrip("/")
            if url:  # after the whole address (a route may follow the URL: .../pause?mode=keep)
                sentence = re.sub(
                    re.escape(url) + r"(?![\w.:])[^\s,;]*",
                    lambda m, name=name: f"{m.group(0)} (vLLM server {name!r})",
                    sentence,
                    count=1,
                )
        return sentence

    def _size_context(self, model_dir: str, dataset: Any, config: dict, eval_dataset: Any = None) -> None:
        """The run's own server's ``max_model_len`` into the placement: the document's, else the
        run's lengths measured on the local model and dataset (:func:`~controlplane.runs.launch_checks.
        per_run_max_model_len`); a run that no longer fits (its dataset changed since it was
        created) fails here in one sentence, before vLLM starts."""
        from controlplane.runs.launch_checks import LaunchRefused, per_run_max_model_len

        def measure() -> Any:
            try:
                return per_run_max_model_len(
                    document=config,
                    model_dir=model_dir,
                    dataset=dataset if isinstance(dataset, str) else None,
                    eval_dataset=eval_dataset if isinstance(eval_dataset, str) else None,
                )
            except LaunchRefused as refused:
                return refused

        plan = self._blocking(measure, what="measuring the run's prompts")
        if isinstance(plan, LaunchRefused):
            raise AttemptEnded(RunStatus.FAILED, str(plan))
        place = self.placement.get("vllm") or {}
        place["max_model_len"] = plan.tokens
        self.placement["vllm"] = place
        services.run_event_create(
            run_id=self.run_id,
            kind=RunEventKind.INFO,
            message=f"vLLM max_model_len {plan.tokens}: {plan.reason}",
        )

    def _start_vllm(self, model_dir: str, config: dict) -> None:
        place = self.placement.get("vllm") or {}
        argv = [sys.executable, "-m", "trainer", "serve", model_dir, "--port", str(self.port)]
        if self.nodes:
            argv += ["--host", "0.0.0.0"]  # the trainer's rank 0 may run on another host
        argv += vllm_placement_flags(place, default=[])  # _size_context set max_model_len
        from trainer.config.run_schema import DEFAULTS  # the spec's dtype default, one table

        dtype = (config.get("args") or {}).get("dtype", DEFAULTS["dtype"])
        if dtype != "auto":
            argv += ["--dtype", dtype]
        argv += shlex.split(settings.GRPO_VLLM_EXTRA_ARGS)
        env = devices_env(place.get("gpus"))
        self.vllm = self._start("vllm", argv, env)
        services.run_processes_record(run_id=self.run_id, vllm_pid=self.vllm.pid)
        self._record_environment("vllm", env, launcher="python -m trainer serve")
        services.run_event_create(
            run_id=self.run_id,
            kind=RunEventKind.INFO,
            message=f"vLLM server starting on port {self.port} (pid {self.vllm.pid}): {shlex.join(argv)}",
        )

    def _record_environment(self, name: str, env: dict[str, str], *, launcher: str) -> None:
        """Put what ``name``'s processes were given (devices, launcher) in the placement and the events."""
        part = self.placement.setdefault(name, {}) or {}
        self.placement[name] = part
        part["env"] = dict(env)
        part["launcher"] = launcher
        shown = " ".join(f"{k}={v}" for k, v in env.items()) or "no device variables (CPU)"
        services.run_placement_record(
            run_id=self.run_id,
            placement=self.placement,
            message=f"{name} environment: {shown}; launched with {launcher}",
        )

    def _record_ranks(self) -> None:
        """Once the trainer wrote ``ranks.json`` (every rank's device and pid), store it."""
        from trainer.processes.host import RANKS_FILE

        if self._ranks_recorded:
            return
        try:
            ranks = json.loads((self.out / RANKS_FILE).read_text())
        except (OSError, ValueError):
            return
        self.placement.setdefault("trainer", {})["ranks"] = ranks
        described = "; ".join(
            f"rank {r.get('rank')}: {r.get('device')}"
            + (f" = GPU {r['gpu']}" if r.get("gpu") is not None else "")
            + f", pid {r.get('pid')} on {r.get('host')}"
            for r in ranks
        )
        recorded = self._through_db_blips(
            lambda: services.run_placement_record(
                run_id=self.run_id, placement=self.placement, message=f"trainer ranks: {described}"
            ),
            what="recording the trainer's ranks",
        )
        self._ranks_recorded = recorded is not DEFERRED  # else tried again on the next poll

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + settings.GRPO_VLLM_START_TIMEOUT_S
        started = time.monotonic()
        names = self.server_names or [None]
        for name, url in zip(names, self.server_urls, strict=True):
            while not http_ok(url + "/health"):
                self._check()
                if time.monotonic() > deadline:
                    which = f"vLLM server {name!r}" if name else "vLLM server"
                    # One sentence; the server's log lines go to the events when its process is ended.
                    raise AttemptEnded(
                        RunStatus.FAILED,
                        f"{which} not healthy after {settings.GRPO_VLLM_START_TIMEOUT_S:.0f} s at {url}; "
                        "raise GRPO_VLLM_START_TIMEOUT_S if it was still loading (its log is in the run's events)",
                    )
                time.sleep(POLL_S)
        services.run_event_create(
            run_id=self.run_id,
            kind=RunEventKind.INFO,
            message=f"vLLM server{'s' if len(names) > 1 else ''} healthy after {time.monotonic() - started:.0f} s "
            f"at {', '.join(self.server_urls)}",
        )

    def _ask_nodes(self, checkpoint: Path | None) -> Rendezvous:
        """A trainer across hosts: this host's rendezvous, then each further host asked for its part."""
        rendezvous = nodes.nodes_ask(
            run_id=self.run_id, attempt=self.run_obj.attempt, placement=self.placement, checkpoint=checkpoint
        )
        if rendezvous is None:
            low, high = settings.GRPO_RENDEZVOUS_PORTS
            raise AttemptEnded(
                RunStatus.FAILED,
                f"no free rendezvous port in GRPO_RENDEZVOUS_PORTS {low}-{high} on this host",
            )
        return rendezvous

    def _start_trainer(
        self, config_path: Path, checkpoint: Path | None, rendezvous: Rendezvous | None = None
    ) -> None:
        module = ["-m", "trainer", "train", "--config", str(config_path)]
        if checkpoint is not None:
            module += ["--resume", str(checkpoint)]
        argv, devices, launcher = trainer_command(
            self.placement.get("trainer") or {}, module, rendezvous=rendezvous
        )
        env = {"GRPO_RUN_ID": str(self.run_id), "GRPO_WORKER_HOST": settings.GRPO_WORKER_HOST, **devices}
        with contextlib.suppress(FileNotFoundError):
            (self.out / "ranks.json").unlink()  # a previous attempt's
        self.trainer = self._start("trainer", argv, env)
        services.run_processes_record(run_id=self.run_id, trainer_pid=self.trainer.pid)
        self._record_environment("trainer", devices, launcher=launcher)
        services.run_event_create(
            run_id=self.run_id,
            kind=RunEventKind.INFO,
            message=f"trainer started (pid {self.trainer.pid})"
            + (f", resuming from {checkpoint}" if checkpoint else "")
            + f": {shlex.join(argv)}",
        )

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        log_path = self.logs / f"{name}.attempt-{self.run_obj.attempt}.log"
        return start_guarded(name, argv, env, log_path=log_path, grace_s=settings.GRPO_STOP_GRACE_S)

    def _watch(self) -> None:
        """Ingest the output folder every ``INGEST_POLL_S``; check the processes every ``POLL_S``."""
        next_check = 0.0
        while True:
            code = self.trainer.poll()
            if code is not None:
                if code == 0:
                    return
                # someone asked (trainer/processes/interrupt.py) without a shutdown
                if code == EXIT_INTERRUPTED:
                    raise AttemptEnded(
                        RunStatus.INTERRUPTED, self._interrupted_reason("the trainer was asked to stop", code)
                    )
                sentence = self._with_server_names(
                    log_records.failure_sentence(
                        process="trainer",
                        status=describe_exit(code),
                        log_text=self.trainer.log_tail(log_records.TAIL_LINES),
                    )
                )
                if self.nodes:
                    sentence = nodes.failure_reason(
                        run_id=self.run_id, attempt=self.run_obj.attempt, sentence=sentence
                    )
                raise AttemptEnded(RunStatus.FAILED, sentence)
            now = time.monotonic()
            self._ingest_outputs(now)
            if now >= next_check:
                next_check = now + POLL_S
                self._check()
                self._record_ranks()
                self._maybe_log_event()
            time.sleep(INGEST_POLL_S)

    def _ingest_outputs(self, now: float | None = None) -> None:
        """The output files' new lines and new checkpoints, stored; on a database blip, deferred
        to a later poll (the offsets move only with a committed write)."""
        self._through_db_blips(functools.partial(self.tailer.poll, now=now), what="ingesting the outputs")

    def _check(self) -> None:
        """Between polls: a stop, a shutdown, a lost run, a dead server; heartbeat when due."""
        if self.shutdown_signal is not None:
            self._interrupt()
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + settings.GRPO_RUN_HEARTBEAT_S
            # Past GRPO_RUN_STALE_AFTER_S without a beat the run is failed as stale and we learn
            # it here (status None) once the database is back.
            status = self._through_db_blips(
                lambda: services.run_heartbeat(run_id=self.run_id), what="heartbeat"
            )
            if status is DEFERRED:
                return
            if status is None:
                raise RunLost()
            if status == RunStatus.STOPPING:
                raise AttemptEnded(RunStatus.STOPPED)
            if self.nodes and self.trainer is not None:
                problem = nodes.node_problem(run_id=self.run_id, attempt=self.run_obj.attempt)
                if problem is not None:
                    raise AttemptEnded(RunStatus.FAILED, problem.sentence)
        if self.vllm is not None and self.vllm.poll() is not None:
            raise AttemptEnded(
                RunStatus.FAILED,
                log_records.failure_sentence(
                    process="vLLM server",
                    status=describe_exit(self.vllm.poll()),
                    log_text=self.vllm.log_tail(log_records.TAIL_LINES),
                ),
            )

    def _interrupt(self) -> NoReturn:
        """The worker is shutting down: ask the trainer to checkpoint at its step's end, wait for it
        up to ``GRPO_STOP_GRACE_S`` while storing what it writes, and end the attempt ``interrupted``
        (resumable; :func:`~controlplane.runs.services.runs_resume_interrupted` resumes it when a
        worker of this host starts). Steps lost: none when the save made it, else those after the
        latest checkpoint."""
        why = f"the worker received {signal.Signals(self.shutdown_signal).name} (shutdown)"
        code = None
        if self.trainer is not None and self.trainer.poll() is None:
            grace = settings.GRPO_STOP_GRACE_S
            interrupt_request(self.out)
            self._through_db_blips(
                lambda: services.run_event_create(
                    run_id=self.run_id,
                    kind=RunEventKind.INFO,
                    message=f"{why}: the trainer saves a checkpoint at the end of its step "
                    f"(waiting up to {grace:g} s, GRPO_STOP_GRACE_S)",
                ),
                what="the interrupt's event",
            )
            deadline = time.monotonic() + grace
            while self.trainer.poll() is None and time.monotonic() < deadline:
                self._ingest_outputs()
                time.sleep(INGEST_POLL_S)
            code = self.trainer.poll()
        raise AttemptEnded(RunStatus.INTERRUPTED, self._interrupted_reason(why, code))

    def _interrupted_reason(self, why: str, trainer_code: int | None) -> str:
        """One sentence: why the attempt ended, where the run resumes from and how."""
        marker = marker_read(self.out) if trainer_code == EXIT_INTERRUPTED else None
        how = "when a worker of this host starts (GRPO_RESUME_INTERRUPTED), or with Resume"
        if marker and marker.get("checkpoint"):
            return f"{why}; checkpoint saved at step {marker['step']}: the run resumes from it {how}"
        latest = latest_checkpoint(self.out)
        where = (
            f"{latest.name} (later steps are trained again)" if latest else "the start (no checkpoint yet)"
        )
        saved = (
            "before the trainer started"
            if self.trainer is None
            else (
                f"and the trainer saved no checkpoint within {settings.GRPO_STOP_GRACE_S:g} s (GRPO_STOP_GRACE_S)"
            )
        )
        return f"{why} {saved}: the run resumes from {where} {how}"

    def _blocking(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn`` in a thread while heartbeating and honouring stops (e.g. building the tiny model)."""
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                result["value"] = fn()
            except BaseException as exc:  # re-raised in the supervisor's thread
                result["error"] = exc
            finally:
                from django.db import connection

                connection.close()  # this thread's own, if it reported events

        thread = threading.Thread(target=target, name=f"run-{self.run_id}-{what}", daemon=True)
        thread.start()
        while thread.is_alive():
            self._check()
            thread.join(POLL_S)
        if "error" in result:
            raise AttemptEnded(RunStatus.FAILED, f"{what} failed: {result['error']}")
        return result["value"]

    def _maybe_log_event(self) -> None:
        """Every ``LOG_EVENT_EVERY_S``, the trainer log's new whole records (the latest few, and any
        traceback) as one event (:mod:`worker.log_records`: cut at record boundaries, httpx request
        lines left out; a record still being written waits for the next event)."""
        now = time.monotonic()
        if now < self._next_log_event or self.trainer is None or self.trainer.log_path is None:
            return
        self._next_log_event = now + LOG_EVENT_EVERY_S
        try:
            with open(self.trainer.log_path, "rb") as fh:
                fh.seek(self._log_offset)
                new = fh.read()
        except OSError:
            return
        exited = self.trainer.proc is None or self.trainer.proc.poll() is not None  # nothing more will come
        cut = log_records.cut_records(new, final=exited)
        message = log_records.event_message(cut.records)
        if message:
            written = self._through_db_blips(
                lambda: services.run_event_create(run_id=self.run_id, kind=RunEventKind.LOG, message=message),
                what="the trainer log's event",
            )
            if written is DEFERRED:
                return  # the same records (and any newer) go with the next event
        self._log_offset += cut.used_bytes

    def _through_db_blips(self, write: Callable[[], T], *, what: str) -> T | object:
        """``write()``'s result, or ``DEFERRED`` when the database refused it (restarting, or this
        process's connection died with it): while the trainer runs, a Postgres restart must not end
        the attempt. The broken connection is dropped so the next try reconnects."""
        try:
            return write()
        except DatabaseError:
            logger.warning(
                "run %s: %s failed (database unreachable); retrying", self.run_id, what, exc_info=True
            )
            close_old_connections()
            return DEFERRED

    def _stop_processes(self) -> tuple[int | None, int | None]:
        """End both process groups at once (SIGTERM, SIGKILL after the grace period)."""
        grace = settings.GRPO_STOP_GRACE_S
        processes = [self.trainer, self.vllm]
        with ThreadPoolExecutor(max_workers=2) as pool:
            codes = list(pool.map(lambda p: p.stop(grace_s=grace) if p is not None else None, processes))
        for process in processes:
            # SIGKILLed members (vLLM's engine core, the rollout process) take a moment to go away;
            # the run is only reported ended once its groups are empty.
            if process is not None and not wait_group_gone(process.pid, timeout_s=10):
                services.run_event_create(
                    run_id=self.run_id,
                    kind=RunEventKind.ERROR,
                    message=f"{process.name}: processes of group {process.pid} still alive after SIGKILL: "
                    f"{group_members(process.pid)}",
                )
        return codes[0], codes[1]

    def _ingest_final(self) -> None:
        """What the trainer wrote last reaches Postgres before the run's final status; a database
        still down after a few tries is logged, never raised (the run must finish; the offsets
        stay, so a resumed attempt stores the rest first)."""
        for attempt in range(FINAL_INGEST_TRIES):
            try:
                self.tailer.drain()
                return
            except Exception:
                logger.warning("run %s: ingesting the output files failed", self.run_id, exc_info=True)
                close_old_connections()
                time.sleep(min(2.0**attempt, 5.0))

    def _record_exits(self, trainer_code: int | None, vllm_code: int | None) -> None:
        for process, code in ((self.trainer, trainer_code), (self.vllm, vllm_code)):
            if process is None:
                continue
            services.run_event_create(
                run_id=self.run_id,
                kind=RunEventKind.LOG,
                message=f"{process.name} (pid {process.pid}) exited with status {describe_exit(code)}; "
                f"last lines of {process.log_path}:\n{process.log_tail(log_records.TAIL_LINES)}",
            )

    def _install_sigterm(self):
        return install_shutdown_flag(self)
