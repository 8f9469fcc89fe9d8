"""The trainer's log cut into whole records for the run's "log" events (the supervisor's log tail).

The trainer logs with ``trainer/cli.py``'s format, ``2026-01-02 03:04:05,678 LEVEL name: message``;
a record is such a line with what belongs to it: indented lines and a Python traceback (from
``Traceback (most recent call last):`` through its exception line, chained tracebacks included).
Lines without the header (a ``print``, a progress bar) are records of their own. The log file keeps
everything; the events keep what a person reads: httpx's request lines (one per vLLM call, several per
step: ``HTTP Request: POST http://... "HTTP/1.1 200 OK"``) are left out.

Reads are cut at record boundaries: a partial last line, or a traceback whose exception line is not
written yet, waits for the next read (:func:`cut_records` says how many bytes it used).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LogCut", "cut_records", "event_message", "is_noise", "log_tail"]

RECORD_HEAD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<name>[\w.]+): ")
HTTPX_REQUEST = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ httpx: HTTP Request: ")
TRACEBACK_START = "Traceback (most recent call last):"
CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# A record at these levels takes a traceback that follows it (logger.exception / exc_info=True);
# after an INFO record, a traceback is the process's own (an uncaught exception on stderr).
TAKES_TRACEBACK = frozenset({"WARNING", "ERROR", "CRITICAL"})
# A traceback still open after this many lines is let go as it is (the process may have died mid-way).
MAX_PENDING_LINES = 400
# An event carries the latest records up to this many lines (one longer record is still kept whole).
EVENT_MAX_LINES = 20


@dataclass(frozen=True)
class LogCut:
    """What one read of the log gives: whole records (each a list of lines, no newlines) and how many
    bytes of the read they used (the rest waits for the next read)."""

    records: list[list[str]]
    used_bytes: int


def cut_records(data: bytes, *, final: bool = False) -> LogCut:
    """Split ``data`` (bytes read from the log at the saved offset) into whole records.

    A trailing partial line, and a traceback without its exception line yet, are not used unless
    ``final`` (the trainer has exited: nothing more will come). Blank lines are dropped; bytes that are not UTF-8 are replaced.
    """
    end = len(data) if final else data.rfind(b"\n") + 1
    raw_lines = data[:end].split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()  # the text after the last newline: nothing
    records: list[list[str]] = []
    starts: list[int] = []  # byte offset where each record starts
    offset, open_traceback = 0, False
    for raw in raw_lines:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        at, offset = offset, offset + len(raw) + 1
        if not line.strip():
            continue  # blank lines (also between chained tracebacks) carry nothing in an event
        if open_traceback:
            records[-1].append(line)
            open_traceback = _continues_traceback(line)
            continue
        if line.startswith(TRACEBACK_START) or line.startswith(CHAINED):
            chained = line.startswith(CHAINED) and records and _has_traceback(records[-1])
            if chained or (records and _takes_traceback(records[-1])):
                records[-1].append(line)
            else:
                records.append([line])
                starts.append(at)
            open_traceback = True
            continue
        if line[0].isspace() and records:
            records[-1].append(line)
            continue
        records.append([line])
        starts.append(at)
    used = min(offset, end)
    if open_traceback and not final and len(records[-1]) < MAX_PENDING_LINES:
        records.pop()  # its exception line is still to come: read it again, whole, next time
        used = starts.pop()
    return LogCut(records=records, used_bytes=used)


def _continues_traceback(line: str) -> bool:
    """Whether the line after ``line`` still belongs to the traceback ``line`` is in: frames are
    indented; the first unindented line that is not a traceback or chaining header is the exception."""
    return (
        not line.strip() or line[0].isspace() or line.startswith(TRACEBACK_START) or line.startswith(CHAINED)
    )


def _has_traceback(record: list[str]) -> bool:
    return any(line.startswith(TRACEBACK_START) for line in record)


def _takes_traceback(record: list[str]) -> bool:
    head = RECORD_HEAD.match(record[0])
    return bool(head) and head["level"] in TAKES_TRACEBACK and not _has_traceback(record)


def is_noise(record: list[str]) -> bool:
    """httpx's one-line request records (they stay in the log file, not in the events)."""
    return len(record) == 1 and HTTPX_REQUEST.match(record[0]) is not None


def event_message(
    records: list[list[str]], *, max_lines: int = EVENT_MAX_LINES, keep_tracebacks: bool = True
) -> str:
    """One event's text: the latest whole records up to ``max_lines`` lines (at least the last record,
    whatever its length), plus (``keep_tracebacks``) every earlier record holding a traceback, in log
    order; noise left out. "" when nothing is left."""
    kept = [record for record in records if not is_noise(record)]
    chosen: set[int] = set()
    lines = 0
    for i in range(len(kept) - 1, -1, -1):
        if chosen and lines + len(kept[i]) > max_lines:
            break
        chosen.add(i)
        lines += len(kept[i])
    if keep_tracebacks:
        chosen.update(i for i, record in enumerate(kept) if _has_traceback(record))
    return "\n".join("\n".join(kept[i]) for i in sorted(chosen))


def log_tail(data: bytes, *, max_lines: int) -> str:
    """The end of a log for a failure reason or an exit event: ``data`` is the file's last bytes,
    starting at a line, given as the latest whole records up to ``max_lines`` lines (the last one
    whole, e.g. the traceback that ended the process), noise left out."""
    return event_message(cut_records(data, final=True).records, max_lines=max_lines, keep_tracebacks=False)
