"""A trainer across hosts (``resources.trainer.nodes``): the first host's side and a further host's part.

The run's first host owns the run (:mod:`worker.supervisor`: its vLLM server, its output files, its
status). Its supervisor takes a rendezvous port and asks each further host's worker for its part
(:func:`nodes_ask`), reads how they fare while its trainer runs (:func:`node_problem`), and names a
lost host when its own trainer fails (:func:`failure_reason`). Each further host's worker gets a
``worker.run_node`` task on its own queue; :func:`supervise_node` then:

1. takes the part (:func:`~controlplane.runs.services.nodes.run_node_begin`: the attempt is live and
   the part is this worker's, else nothing to do),
2. starts ``torch.distributed.run --nnodes N --nproc-per-node P --rdzv-backend c10d
   --rdzv-endpoint FIRST_HOST:PORT --rdzv-id run-<id>-<attempt>`` with the run's launched document
   (``<output_dir>/RUN.yaml``: the output folder is on storage every host of the pool shares), on
   the GPUs its share leased, under :mod:`worker.guard`,
3. heartbeats its node row every ``GRPO_RUN_HEARTBEAT_S`` and learns there whether the attempt still
   lives; when it does not (stopped, failed, finished elsewhere) it ends its processes,
4. reports how its processes ended (:func:`~controlplane.runs.services.nodes.run_node_end`: a
   failure in one sentence, which the first host's supervisor puts in the run's failure reason).

A shutdown of this worker (SIGTERM: Ctrl-C, a warm stop) asks the trainer to save a checkpoint at
its step's end (the interrupt marker in the shared output folder, which rank 0 reads, wherever it
runs) and waits up to ``GRPO_STOP_GRACE_S``; the first host then records the run ``interrupted``.
A SIGKILL of this worker leaves the guard to end its processes; the first host notices the silence
after ``GRPO_NODE_LOST_AFTER_S`` (or its own ranks' broken connections first) and fails the run
naming this host.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import DatabaseError, close_old_connections

from controlplane.runs import services
from controlplane.runs.models import Run, RunStatus
from trainer.processes.interrupt import EXIT_INTERRUPTED, interrupt_request
from worker import log_records
from worker.launch import Rendezvous, trainer_command
from worker.processes import ManagedProcess, describe_exit, free_port_in, install_shutdown_flag, start_guarded

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a further host's processes are looked at


# ------------------------------------------------------------------------------ the first host
def nodes_ask(*, run_id: int, attempt: int, placement: dict, checkpoint: Path | None) -> Rendezvous | None:
    """This host's rendezvous (a free port of ``GRPO_RENDEZVOUS_PORTS`` at ``GRPO_WORKER_ADDRESS``),
    recorded in ``placement["trainer"]["rendezvous"]`` (with the checkpoint every host resumes from)
    and stored, then each further host's worker asked to start its part
    (:func:`~controlplane.runs.services.nodes.run_nodes_ask`). None when no port of the range is free."""
    port = free_port_in(*settings.GRPO_RENDEZVOUS_PORTS)
    if port is None:
        return None
    further = placement["nodes"]
    rendezvous = Rendezvous(
        nodes=1 + len(further),
        endpoint=f"{settings.GRPO_WORKER_ADDRESS}:{port}",
        run_id=f"run-{run_id}-{attempt}",
        hosts_store=True,
    )
    placement["trainer"]["rendezvous"] = {
        "endpoint": rendezvous.endpoint,
        "id": rendezvous.run_id,
        "resume": str(checkpoint) if checkpoint is not None else None,
    }
    services.run_placement_record(
        run_id=run_id,
        placement=placement,
        message=f"trainer rendezvous at {rendezvous.endpoint} ({rendezvous.nodes} hosts)",
    )
    services.run_nodes_ask(run_id=run_id, attempt=attempt, nodes=further)
    return rendezvous


def _through_db_blips(call: Any, *, otherwise: Any = None) -> Any:
    """``call()``'s result, or ``otherwise`` when the database is unreachable (asked again at the next
    poll; the broken connection is dropped so that the next try reconnects)."""
    try:
        return call()
    except DatabaseError:
        logger.warning("a trainer across hosts: the database is unreachable; trying again", exc_info=True)
        close_old_connections()
        return otherwise


def node_problem(*, run_id: int, attempt: int) -> services.NodeProblem | None:
    """What went wrong on a further host (failed, silent, never started), or None."""
    return _through_db_blips(lambda: services.run_node_problem(run_id=run_id, attempt=attempt))


def failure_reason(*, run_id: int, attempt: int, sentence: str) -> str:
    """The failure reason when the first host's trainer failed with ``sentence``: a further host lost
    goes first (its ranks' sockets close here at once, its silence shows only after
    ``GRPO_NODE_LOST_AFTER_S``: waited for, unless every further host reports its own end), a further
    host's own failure after."""
    deadline = time.monotonic() + settings.GRPO_NODE_LOST_AFTER_S + 2 * settings.GRPO_RUN_HEARTBEAT_S
    while True:
        problem = node_problem(run_id=run_id, attempt=attempt)
        ended = _through_db_blips(lambda: services.run_nodes_ended(run_id=run_id, attempt=attempt))
        if (problem and problem.kind != "failed") or ended is True or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if problem is None:
        return sentence
    return (
        f"{problem.sentence}; {sentence}" if problem.kind != "failed" else f"{sentence}; {problem.sentence}"
    )


# ----------------------------------------------------------------------------- a further host


def supervise_node(*, run_id: int, attempt: int, index: int, worker_name: str) -> str:
    """Run node ``index`` of attempt ``attempt`` of ``run_id`` on this worker until the attempt ends;
    returns ``exited`` / ``failed`` / ``skipped``."""
    run = services.run_node_begin(run_id=run_id, attempt=attempt, index=index, worker=worker_name)
    if run is None:
        logger.info("run %s attempt %s node %s: not this worker's to start", run_id, attempt, index)
        return "skipped"
    return NodeSupervisor(run, index).run()


class NodeSupervisor:
    """Starts and watches one further host's trainer processes (see the module docstring)."""

    def __init__(self, run: Run, index: int) -> None:
        self.run_id = run.pk
        self.attempt = run.attempt
        self.index = index
        self.out = Path(run.output_dir)
        self.share: dict = run.placement["nodes"][index - 1]
        rendezvous = run.placement["trainer"]["rendezvous"]
        self.resume: str | None = rendezvous.get("resume")
        self.rendezvous = Rendezvous(
            nodes=1 + len(run.placement["nodes"]),
            endpoint=rendezvous["endpoint"],
            run_id=rendezvous["id"],
            hosts_store=False,
        )
        self.trainer: ManagedProcess | None = None
        self.shutdown_signal: int | None = None

    def run(self) -> str:
        previous = self._install_sigterm()
        code: int | None = None
        reason = ""
        try:
            code, reason = self._attempt()
        except Exception as exc:  # the part failed here: say so on the row, the first host ends the run
            logger.exception("run %s node %s: supervisor error", self.run_id, self.index)
            reason = f"node supervisor error: {type(exc).__name__}: {exc}"
            code = None
        finally:
            if self.trainer is not None and self.trainer.poll() is None:
                code = self.trainer.stop(grace_s=settings.GRPO_STOP_GRACE_S)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self._report(
            lambda: services.run_node_end(
                run_id=self.run_id, attempt=self.attempt, index=self.index, exit_code=code, reason=reason
            )
        )
        return "failed" if reason else "exited"

    def _attempt(self) -> tuple[int | None, str]:
        """Start the part and watch it: ``(exit code, failure sentence or "")``."""
        module = ["-m", "trainer", "train", "--config", str(self.out / "RUN.yaml")]
        if self.resume:
            module += ["--resume", self.resume]
        argv, devices, _ = trainer_command(self.share, module, rendezvous=self.rendezvous)
        env = {"GRPO_RUN_ID": str(self.run_id), "GRPO_WORKER_HOST": settings.GRPO_WORKER_HOST, **devices}
        log = self.out / "logs" / f"trainer-node{self.index}.attempt-{self.attempt}.log"
        self.trainer = start_guarded(
            f"trainer-node{self.index}", argv, env, log_path=log, grace_s=settings.GRPO_STOP_GRACE_S
        )
        next_beat = 0.0
        while True:
            code = self.trainer.poll()
            if code is not None:
                if code == 0:
                    return 0, ""
                return code, log_records.failure_sentence(
                    process="trainer",
                    status=describe_exit(code),
                    log_text=self.trainer.log_tail(log_records.TAIL_LINES),
                )
            if self.shutdown_signal is not None:
                return self._interrupt()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + settings.GRPO_RUN_HEARTBEAT_S
                status = self._report(
                    lambda: services.run_node_heartbeat(
                        run_id=self.run_id, attempt=self.attempt, index=self.index, pid=self.trainer.pid
                    )
                )
                if status is None or status == RunStatus.STOPPING:  # the attempt ended on its first host
                    return self._end_with_the_attempt(), ""
            time.sleep(POLL_S)

    def _end_with_the_attempt(self) -> int | None:
        """The attempt ended on the first host (finished, stopped, failed): this host's ranks end on
        their own (finished, or their peers gone); after ``GRPO_STOP_GRACE_S`` they are ended."""
        deadline = time.monotonic() + settings.GRPO_STOP_GRACE_S
        while self.trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self.trainer.stop(grace_s=settings.GRPO_STOP_GRACE_S)

    def _interrupt(self) -> tuple[int | None, str]:
        """This worker shuts down: the trainer saves a checkpoint at its step's end and every rank
        exits (the first host records ``interrupted``); after ``GRPO_STOP_GRACE_S``, ended anyway."""
        interrupt_request(self.out)
        deadline = time.monotonic() + settings.GRPO_STOP_GRACE_S
        while self.trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        code = self.trainer.stop(grace_s=settings.GRPO_STOP_GRACE_S)
        if code in (0, EXIT_INTERRUPTED):  # checkpointed: the first host records the run interrupted
            return code, ""
        signame = signal.Signals(self.shutdown_signal).name
        return code, (
            f"the worker of host {settings.GRPO_WORKER_HOST} received {signame} and its trainer ranks saved "
            f"no checkpoint within {settings.GRPO_STOP_GRACE_S:g} s (GRPO_STOP_GRACE_S)"
        )

    def _report(self, write: Any) -> Any:
        """A write to the database; while it is unreachable the part goes on (the run's status unknown)."""
        return _through_db_blips(write, otherwise=RunStatus.RUNNING)

    def _install_sigterm(self):
        return install_shutdown_flag(self)
