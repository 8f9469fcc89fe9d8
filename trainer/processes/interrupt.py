"""Graceful interrupt: when asked, the trainer saves a checkpoint at the end of the current step and stops.

Whoever runs the trainer asks by creating ``<output_dir>/INTERRUPT`` (:func:`interrupt_request`): the
control plane's worker does it when it is shut down (Ctrl-C on ``make run``, a Celery warm shutdown),
so that the run ends ``interrupted`` with nothing lost instead of ``failed``. A file and not a signal:
a signal to the trainer's process group also reaches the rollout process and the other ranks, which
must keep running until the checkpoint is written.

Rank 0 looks for the file at every step's end (one ``stat``); its answer is shared with every rank
(the save is collective). The trainer then writes ``checkpoint-<step>/`` as a scheduled save does,
skips the final model save, writes ``<output_dir>/interrupted.json`` (:func:`marker_write`: the step and
the checkpoint) and exits with :data:`EXIT_INTERRUPTED`. Resuming from that checkpoint
(``--resume``) continues at the next step: no step is lost.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

REQUEST_FILE = "INTERRUPT"
MARKER_FILE = "interrupted.json"
# The trainer's exit status after an interrupt honoured at a step's end (EX_TEMPFAIL: try again later).
EXIT_INTERRUPTED = 75


def interrupt_request(output_dir: str | Path) -> None:
    """Ask the trainer writing to ``output_dir`` to checkpoint and stop at its next step's end."""
    path = Path(output_dir) / REQUEST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def interrupt_requested(output_dir: str | Path) -> bool:
    """Whether :func:`interrupt_request` was called for ``output_dir`` (and not cleared since)."""
    return (Path(output_dir) / REQUEST_FILE).exists()


def interrupt_clear(output_dir: str | Path) -> None:
    """Forget an earlier attempt's request and marker (a new attempt starts unasked)."""
    for name in (REQUEST_FILE, MARKER_FILE):
        with contextlib.suppress(FileNotFoundError):
            (Path(output_dir) / name).unlink()


def marker_write(output_dir: str | Path, *, step: int, checkpoint: str | None) -> None:
    """Record that the trainer stopped on request at ``step``, with the checkpoint it saved there."""
    path = Path(output_dir) / MARKER_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "checkpoint": checkpoint}))
    tmp.replace(path)


def marker_read(output_dir: str | Path) -> dict | None:
    """``{"step": int, "checkpoint": str | None}`` written by :func:`marker_write`, or None."""
    try:
        return json.loads((Path(output_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
