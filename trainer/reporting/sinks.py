"""Where the trainer's records go: one :class:`Sink` interface, :class:`JsonlSink` by default.

The trainer calls its sinks from one place (the main process only): the metrics of each logging
step, the sampled completions logged with it, each checkpoint saved. ``JsonlSink`` writes the run
output folder's ``metrics.jsonl`` and ``completions.jsonl`` (a public contract: one JSON object a
line, ``{"step": N, ...}``; NaN written as ``null``; a metrics row also carries ``"timestamp"``, the
unix time in seconds it was written, which is not a metric); the checkpoint folders are their own
record.
The control plane reads those files (``worker/tailer.py``), so the trainer process needs no database.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

METRICS_FILE = "metrics.jsonl"
TIMESTAMP_KEY = "timestamp"  # a metrics row's wall time, unix seconds (float)
COMPLETIONS_FILE = "completions.jsonl"


@runtime_checkable
class Sink(Protocol):
    """Receives a run's records in the order the trainer produces them (main process only)."""

    def metrics(self, step: int, values: Mapping[str, Any]) -> None:
        """One logging step's metrics (name -> number; the last record of a step wins)."""

    def completions(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """The completions sampled since the last log, logged at ``step`` (prompt, completion,
        reward, rewards, advantage, group_id, row_index, reference: the dataset row's reference
        answer or None, ``trainer.rollout.groups.REFERENCE_COLUMNS``)."""

    def checkpoint(self, step: int, path: str) -> None:
        """A checkpoint folder complete at ``path`` (its ``rollout_state.json`` written)."""

    def close(self) -> None:
        """Training ended: flush and release what the sink holds."""


class EvalSink(Protocol):
    """A sink that also takes eval passes (optional: the trainer skips sinks without it)."""

    def evaluation(
        self,
        step: int,
        metrics: Mapping[str, Any],
        completions: Sequence[Mapping[str, Any]],
        timestamp: float,
    ) -> None:
        """One eval pass of the weights of ``step`` (an extension, issue 30): its ``eval/*`` metrics and
        its completions (records as :meth:`completions` gets them); ``timestamp``: unix seconds of that step's log.
        Usually arrives after later steps' records."""


class JsonlSink:
    """Appends to ``<output_dir>/metrics.jsonl`` and ``completions.jsonl``.

    Each record goes out in one ``write`` on an append-mode file, so a reader tailing the file sees
    whole lines but for the last one. A file whose last line was cut (a killed process) gets a
    newline first: the cut line is then one unreadable line, and the next record stays readable.
    """

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.output_dir = Path(output_dir)
        self._checked: set[str] = set()  # files whose last line is known to be whole

    def metrics(self, step: int, values: Mapping[str, Any]) -> None:
        # The wall time of the step (the dashboard's time axes); written here, not recorded in the
        # metric window, so it is no metric (no catalogue entry, no MetricPoint).
        self._append(METRICS_FILE, [{"step": step, **jsonable(values), TIMESTAMP_KEY: round(time.time(), 3)}])

    def completions(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if rows:
            self._append(COMPLETIONS_FILE, [{"step": step, **jsonable(row)} for row in rows])

    def evaluation(
        self,
        step: int,
        metrics: Mapping[str, Any],
        completions: Sequence[Mapping[str, Any]],
        timestamp: float,
    ) -> None:
        """One ``metrics.jsonl`` line at ``step`` with the step's own wall time (so the step's time on
        the dashboard's axes stays), and the completions, each marked ``"eval": true``."""
        self._append(METRICS_FILE, [{"step": step, **jsonable(metrics), TIMESTAMP_KEY: round(timestamp, 3)}])
        if completions:
            self._append(
                COMPLETIONS_FILE, [{"step": step, **jsonable(row), "eval": True} for row in completions]
            )

    def checkpoint(self, step: int, path: str) -> None:
        """Nothing to write: the ``checkpoint-<step>`` folder is the record."""

    def close(self) -> None:
        """Nothing held open between records."""

    def _append(self, name: str, records: list[dict[str, Any]]) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / name
        text = "".join(json.dumps(record) + "\n" for record in records)
        if name not in self._checked:
            self._checked.add(name)
            if _ends_mid_line(path):
                text = "\n" + text
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text)


def jsonable(values: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level values as JSON can hold them: tensors as numbers, NaN as ``None``."""
    out = {}
    for key, value in values.items():
        if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
            value = value.item()
        if isinstance(value, float) and value != value:
            value = None  # NaN is not JSON
        out[key] = value
    return out


def _ends_mid_line(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return False
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) != b"\n"
    except FileNotFoundError:
        return False
