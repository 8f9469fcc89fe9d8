"""The control plane's reader of a run's output folder: the trainer's sink files and checkpoints.

The trainer writes ``metrics.jsonl`` and ``completions.jsonl`` (``trainer.reporting.sinks.JsonlSink``) and
``checkpoint-<step>/`` folders; it has no database access. The supervisor polls a
:class:`RunOutputTailer` while the run is live (every ``INGEST_POLL_S``): each poll reads the whole
lines added since the saved byte offsets (a partial last line waits for the next poll), stores them
with the existing upserts and records checkpoints whose ``rollout_state.json`` exists, all in one
transaction with the new offsets (:func:`controlplane.runs.services.ingest.run_output_ingest`). A worker
killed at any point leaves the offsets at the last commit: the next worker reads on from there, and
the upserts on (run, name, step) / (run, step, index) make a re-read harmless.

Completion rows get their index from their position in the step's block: consecutive lines of one
step continue the block across polls; a new attempt (:meth:`RunOutputTailer.new_attempt`) starts a
new block, so a re-done step replaces its rows as it did when the trainer reported them itself.
Eval rows (``"eval": true``: scored on ``eval_dataset`` with the weights of their step) have blocks
of their own, numbered apart from the step's training rows, so the two kinds may interleave.

Metrics lines need no order: an eval line for step S usually comes after the lines of S+1, S+2, and
its names are added to step S (upserts on (run, name, step)), the step's training points untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import DataError, IntegrityError

from controlplane.runs import selectors
from controlplane.runs.models import CompletionSplit
from controlplane.runs.services import ingest
from trainer.reporting.sinks import COMPLETIONS_FILE, METRICS_FILE

logger = logging.getLogger(__name__)

# While the run is live (GRPO_INGEST_POLL_S): p95 step-to-browser delivery stays well under 500 ms.
INGEST_POLL_S = settings.GRPO_INGEST_POLL_S
CHECKPOINT_SCAN_S = 1.0
# Per file and poll (GRPO_INGEST_MAX_READ_BYTES); a long backlog (after a restart) takes a few polls.
MAX_READ_BYTES = settings.GRPO_INGEST_MAX_READ_BYTES


@dataclass
class _Cursor:
    """One file's read position: bytes consumed, and (completions) the training block's step and
    rows, the eval block's step and rows."""

    offset: int = 0
    step: int | None = None
    count: int = 0
    eval_step: int | None = None
    eval_count: int = 0

    def saved(self) -> tuple[int, int | None, int, int | None, int]:
        return (self.offset, self.step, self.count, self.eval_step, self.eval_count)

    def next_index(self, split: str, step: int) -> int:
        """The index of the next row of ``split`` at ``step`` (moving that split's block on)."""
        if split == CompletionSplit.EVAL:
            index = self.eval_count if step == self.eval_step else 0
            self.eval_step, self.eval_count = step, index + 1
        else:
            index = self.count if step == self.step else 0
            self.step, self.count = step, index + 1
        return index


@dataclass
class _Record:
    """One parsed line: its file, the cursor just past it, and what it stores."""

    name: str
    cursor: _Cursor
    step: int
    payload: dict[str, Any]
    index: int = 0  # completions: the row's index within its step and split
    split: str = CompletionSplit.TRAIN  # completions: train, or eval for a row with "eval": true


@dataclass
class _Read:
    records: list[_Record] = field(default_factory=list)
    cursors: dict[str, _Cursor] = field(default_factory=dict)  # every file read, at its new position
    checkpoints: list[tuple[int, str]] = field(default_factory=list)
    lines: int = 0  # whole lines consumed, unreadable ones included


class RunOutputTailer:
    """Ingests one run's output folder incrementally (see the module docstring). Not thread-safe.

    :meth:`poll` raises what the database raises when it cannot be reached (the supervisor's
    ``_through_db_blips`` defers to the next poll; nothing moved). A line the database refuses as
    data (a constraint, an out-of-range value) is logged and skipped, so it cannot block the run.
    """

    def __init__(self, *, run_id: int, output_dir: Path) -> None:
        self.run_id = run_id
        self.output_dir = Path(output_dir)
        self._cursors: dict[str, _Cursor] | None = None  # loaded from the database on first use
        self._checkpoints: set[int] | None = None
        self._next_scan = 0.0

    def poll(self, *, now: float | None = None, attempt: int | None = None) -> int:
        """Store what was added since the last poll (``now``: ``time.monotonic()``, to scan for
        checkpoints at most every ``CHECKPOINT_SCAN_S``; None scans; ``attempt``: the attempt that
        wrote the lines, None for the run's current one); returns how many lines and checkpoints it
        consumed."""
        self._load()
        read = self._read(scan=now is None or now >= self._next_scan)
        if now is not None and now >= self._next_scan:
            self._next_scan = now + CHECKPOINT_SCAN_S
        if not read.records and not read.checkpoints and not read.cursors:
            return 0
        try:
            self._store(read.records, read.checkpoints, read.cursors, attempt)
        except (IntegrityError, DataError):
            logger.warning("run %s: a batch was refused; storing its lines one by one", self.run_id)
            self._store_one_by_one(read, attempt)
        else:
            self._cursors.update(read.cursors)
            self._checkpoints.update(step for step, _ in read.checkpoints)
        return read.lines + len(read.checkpoints)

    def drain(self, *, attempt: int | None = None) -> int:
        """Poll until nothing is left (the end of an attempt, or catching up before one: then
        ``attempt`` names the attempt that wrote what is left)."""
        total = 0
        while stored := self.poll(attempt=attempt):
            total += stored
        return total

    def new_attempt(self) -> None:
        """The next completion rows start a new block (a trainer attempt is about to start)."""
        self._load()
        cursor = self._cursors.setdefault(COMPLETIONS_FILE, _Cursor())
        if cursor.step is not None or cursor.eval_step is not None:
            ingest.run_output_ingest(
                run_id=self.run_id, cursors={COMPLETIONS_FILE: (cursor.offset, None, 0, None, 0)}
            )
            cursor.step, cursor.count, cursor.eval_step, cursor.eval_count = None, 0, None, 0

    # ------------------------------------------------------------------------------------ reading
    def _load(self) -> None:
        if self._cursors is None:
            saved = selectors.run_file_cursors(run_id=self.run_id)
            self._cursors = {name: _Cursor(*saved[name]) for name in saved}
        if self._checkpoints is None:
            self._checkpoints = selectors.run_checkpoint_steps(run_id=self.run_id)

    def _read(self, *, scan: bool) -> _Read:
        read = _Read()
        # Checkpoints first: a folder complete now had its step's lines written before it.
        if scan:
            read.checkpoints = self._new_checkpoints()
        for name in (METRICS_FILE, COMPLETIONS_FILE):
            cursor = self._cursors.get(name, _Cursor())
            data = self._new_bytes(name, cursor)
            if data is None:
                continue
            position = dataclasses.replace(cursor)
            if data == b"":  # the file was replaced by a shorter one: read it again from the start
                position = _Cursor()
                data = self._new_bytes(name, position) or b""
            for line in data.splitlines(keepends=True):
                position = dataclasses.replace(position, offset=position.offset + len(line))
                read.lines += 1
                parsed = _parse(line)
                if parsed is None:
                    continue  # a line cut by a killed writer, or not ours
                step, payload = parsed
                index, split = 0, CompletionSplit.TRAIN
                if name == COMPLETIONS_FILE:
                    split = CompletionSplit.EVAL if payload.get("eval") is True else CompletionSplit.TRAIN
                    index = position.next_index(split, step)
                read.records.append(_Record(name, position, step, payload, index, split))
            read.cursors[name] = position
        return read

    def _new_bytes(self, name: str, cursor: _Cursor) -> bytes | None:
        """The whole lines past ``cursor`` (None: nothing new; b"": the file shrank under it)."""
        path = self.output_dir / name
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return None
        if size < cursor.offset:
            logger.warning("run %s: %s is shorter than what was read; reading it again", self.run_id, name)
            return b""
        if size == cursor.offset:
            return None
        with open(path, "rb") as fh:
            fh.seek(cursor.offset)
            data = fh.read(min(size - cursor.offset, MAX_READ_BYTES))
        end = data.rfind(b"\n")
        return data[: end + 1] if end >= 0 else None

    def _new_checkpoints(self) -> list[tuple[int, str]]:
        found = []
        for folder in self.output_dir.glob("checkpoint-*"):
            suffix = folder.name.rsplit("-", 1)[1]
            if not suffix.isdigit() or int(suffix) in self._checkpoints:
                continue
            if (folder / "rollout_state.json").exists():  # written last: the save is complete
                found.append((int(suffix), str(folder)))
        return sorted(found)

    # ------------------------------------------------------------------------------------ storing
    def _store(
        self,
        records: list[_Record],
        checkpoints: list[tuple[int, str]],
        cursors: dict[str, _Cursor],
        attempt: int | None = None,
    ) -> None:
        metrics = [(r.step, _metric_values(r.payload)) for r in records if r.name == METRICS_FILE]
        blocks: list[tuple[str, int, int, list[dict[str, Any]]]] = []  # (split, step, first index, rows)
        for r in records:
            if r.name != COMPLETIONS_FILE:
                continue
            last = blocks[-1] if blocks else None
            if last and (last[0], last[1]) == (r.split, r.step) and last[2] + len(last[3]) == r.index:
                last[3].append(r.payload)
            else:
                blocks.append((r.split, r.step, r.index, [r.payload]))
        ingest.run_output_ingest(
            run_id=self.run_id,
            metrics=metrics,
            completions=blocks,
            checkpoints=checkpoints,
            cursors={name: c.saved() for name, c in cursors.items()},
            attempt=attempt,
        )

    def _store_one_by_one(self, read: _Read, attempt: int | None = None) -> None:
        """After a refused batch: each line (and checkpoint) in its own transaction with its offset;
        a refused one is logged and skipped. Connection errors still propagate (nothing is lost:
        the next poll reads again from the last saved offsets, and re-storing is harmless)."""
        for step, path in read.checkpoints:
            with _refused_skipped(self.run_id, f"checkpoint {step}"):
                self._store([], [(step, path)], {})
            self._checkpoints.add(step)
        for record in read.records:
            with _refused_skipped(self.run_id, f"{record.name} line of step {record.step}"):
                self._store([record], [], {record.name: record.cursor}, attempt)
        self._store([], [], read.cursors)  # past the refused lines too
        self._cursors.update(read.cursors)


@contextlib.contextmanager
def _refused_skipped(run_id: int, what: str) -> Iterator[None]:
    """A data error (not a connection error) inside is logged and swallowed."""
    try:
        yield
    except (IntegrityError, DataError) as exc:
        logger.error("run %s: the database refused the %s; skipped: %s", run_id, what, exc)


def _parse(line: bytes) -> tuple[int, dict[str, Any]] | None:
    """A sink line as (step, the rest of the object); None for a cut or foreign line."""
    try:
        row = json.loads(line)
        if not isinstance(row, dict):
            return None
        return int(row.pop("step")), row
    except (ValueError, KeyError, TypeError):
        return None


def _metric_values(payload: dict[str, Any]) -> dict[str, Any]:
    """A metrics line's values as the trainer logged them: the sink writes NaN as ``null``."""
    return {name: math.nan if value is None else value for name, value in payload.items()}
