"""What a spawned rollout process says when it dies while still starting up.

``multiprocessing``'s spawn start method runs a fresh interpreter that first re-imports the parent's
``__main__`` script (as ``__mp_main__``), and only then runs the rollout loop. An error in that
phase (typically a training script without an ``if __name__ == "__main__":`` guard, which starts
training again on import) never reaches the loop's own error reporting: the parent only saw the
child exit with status 1.

The parent names a file in ``GRPO_ROLLOUT_STARTUP_ERROR`` before it starts the child;
:func:`record_startup_errors` (run when ``trainer`` is imported, i.e. by the re-imported script)
makes the child write any uncaught error of its start-up phase there, and the parent puts it in
its failure message with :func:`startup_failure`. Stdlib only: it runs on every ``import trainer``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path

STARTUP_ERROR_ENV = "GRPO_ROLLOUT_STARTUP_ERROR"
# multiprocessing's own refusal when the re-imported script starts a process of its own.
_UNGUARDED_SCRIPT = "bootstrapping phase"
GUARD_HINT = (
    "fix: the rollout process is spawned and re-imports your script; put the training code under "
    '`if __name__ == "__main__":`'
)


_started = False  # set in the child once its rollout loop runs: later errors are reported by the loop


def mark_started() -> None:
    """The spawned child is past its start-up phase (called first thing in its entry point)."""
    global _started
    _started = True


def _starting_up() -> bool:
    """True in a spawned child that is still importing the parent's ``__main__`` (multiprocessing
    marks that phase with ``_inheriting``)."""
    import multiprocessing.process

    return bool(getattr(multiprocessing.process.current_process(), "_inheriting", False))


def record_startup_errors() -> None:
    """In a spawned child still starting up, write any uncaught error to ``$GRPO_ROLLOUT_STARTUP_ERROR``
    (then report it as usual). Does nothing elsewhere."""
    path = os.environ.get(STARTUP_ERROR_ENV)
    if not path or not _starting_up() or getattr(sys.excepthook, "_grpo_startup", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        if not _started:
            with contextlib.suppress(OSError):  # a lost report must not hide the error itself
                Path(path).write_text("".join(traceback.format_exception(kind, value, tb)))
        previous(kind, value, tb)

    hook._grpo_startup = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def startup_failure(path: str | os.PathLike | None) -> str | None:
    """The child's start-up error written at ``path`` (its last traceback lines), with the fix when
    it is the unguarded-script case; None when it wrote none."""
    if path is None:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    if not text:
        return None
    lines = text.splitlines()
    shown = "\n".join(lines[-25:])
    if _UNGUARDED_SCRIPT in text:
        return f"{GUARD_HINT}.\nThe rollout process's error:\n{shown}"
    return f"its error while starting (importing your script):\n{shown}"
