"""The trainer's log cut into whole records for the run's "log" events (the supervisor's log tail).

The trainer logs with ``trainer/processes/cli.py``'s format, ``2026-01-02 03:04:05,678 LEVEL name: message``;
a record is such a line with what belongs to it: indented lines and a Python traceback (from
``Traceback (most recent call last):`` through its exception line, chained tracebacks included).
Lines without the header (a ``print``, a progress bar) are records of their own. The log file keeps
everything; the events keep what a person reads: httpx's request lines (one per vLLM call, several per
step: ``HTTP Request: POST http://... "HTTP/1.1 200 OK"``) are left out.

Reads are cut at record boundaries: a partial last line, or a traceback whose exception line is not
written yet, waits for the next read (:func:`cut_records` says how many bytes it used).

A run that fails gets one sentence as its ``failure_reason`` (:func:`failure_sentence`): the cause read
from the end of the log (a vLLM refusal, a timeout, memory, the last exception) and the field or
setting to change; the log lines themselves stay in the run's events.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LogCut", "cut_records", "event_message", "failure_sentence", "is_noise", "log_tail"]

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
# Lines of a process's log a failure sentence and an exit event are read from.
TAIL_LINES = 40


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


# ------------------------------------------------------------------------------ failure sentences
# The fix for a request longer than the server's context: the field that sets each side.
_LONGER_CONTEXT = "raise the server's max_model_len (resources.vllm.max_model_len)"
# The cause is cut to this many characters (a vLLM error body can be a kilobyte of JSON).
CAUSE_MAX_CHARS = 300


def _max_tokens_refused(max_tokens: int, max_model_len: int, prompt: int | None = None) -> str:
    room = f" to at most {max_model_len - prompt}" if prompt is not None and prompt < max_model_len else ""
    with_prompt = f" with a prompt of {prompt} tokens" if prompt is not None else ""
    return (
        f"vLLM refused a request for max_tokens {max_tokens} (args.max_completion_length){with_prompt}: it does "
        f"not fit the server's max_model_len of {max_model_len} tokens; lower args.max_completion_length{room} "
        f"or {_LONGER_CONTEXT}"
    )


def _prompt_refused(prompt: int, max_model_len: int) -> str:
    return (
        f"vLLM refused a prompt of {prompt} tokens, longer than the server's max_model_len of {max_model_len} "
        f"tokens; {_LONGER_CONTEXT} or shorten the prompts (train_dataset; with tools, lower "
        "args.max_tool_calling_iterations: each turn adds to the prompt)"
    )


def _n(match: re.Match, group: int | str) -> int:
    return int(match.group(group))


# (pattern searched in the log's end, the cause it means) in order: the first that matches wins.
KNOWN_FAILURES: tuple[tuple[re.Pattern[str], Callable[[re.Match], str]], ...] = (
    (  # vLLM >= 0.11: max_tokens alone over the context
        re.compile(r"max_tokens=(\d+) cannot be greater than max_model_len=(\d+)"),
        lambda m: _max_tokens_refused(_n(m, 1), _n(m, 2)),
    ),
    (
        re.compile(
            r"'max_tokens' or 'max_completion_tokens' is too large: (\d+)\. This model's maximum context "
            r"length is (\d+) tokens and your request has (\d+) input tokens"
        ),
        lambda m: _max_tokens_refused(_n(m, 1), _n(m, 2), _n(m, 3)),
    ),
    (
        re.compile(
            r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens "
            r"\((\d+) in the messages, (\d+) in the completion\)"
        ),
        lambda m: _max_tokens_refused(_n(m, 3), _n(m, 1), _n(m, 2)),
    ),
    (
        re.compile(
            r"maximum context length is (\d+) tokens\. However, your prompt contains (?:at least )?(\d+)"
        ),
        lambda m: _prompt_refused(_n(m, 2), _n(m, 1)),
    ),
    (
        re.compile(r"Input length \((\d+)\) exceeds model's maximum context length \((\d+)\)"),
        lambda m: _prompt_refused(_n(m, 1), _n(m, 2)),
    ),
    (
        re.compile(r"decoder prompt \(length (\d+)\) is longer than the maximum model length of (\d+)"),
        lambda m: _prompt_refused(_n(m, 1), _n(m, 2)),
    ),
    (
        re.compile(
            r"User-specified max_model_len \((\d+)\) is greater than the derived max_model_len \((\w+)=(\d+)"
        ),
        lambda m: (
            f"vLLM refused --max-model-len {m.group(1)}, above the model's limit of {m.group(3)} tokens "
            f"({m.group(2)} in its config.json); set resources.vllm.max_model_len to at most {m.group(3)}"
        ),
    ),
    (
        re.compile(r"To serve at least one request with the model'?s'? max seq len \((\d+)\)"),
        lambda m: (
            f"the vLLM server's KV cache cannot hold one sequence of max_model_len {m.group(1)} tokens; lower "
            "resources.vllm.max_model_len (or args.max_completion_length) or raise "
            "resources.vllm.gpu_memory_utilization"
        ),
    ),
    (
        re.compile(r"(?:CUDA out of memory|torch\.OutOfMemoryError|OutOfMemoryError: )"),
        lambda m: (
            "the trainer ran out of GPU memory; lower args.token_budget (tokens per micro-batch), or give the "
            "trainer more GPUs (resources.trainer.gpus, with fsdp)"
        ),
    ),
    (
        re.compile(r"vLLM server at (\S+) not ready after (\d+)s"),
        lambda m: (
            f"the vLLM server at {m.group(1)} did not answer within {m.group(2)} s; check that it runs "
            "(resources.server) or raise args.vllm_server_timeout"
        ),
    ),
    (
        re.compile(r"no heartbeat for (\d+) s \(rollout_worker_timeout=([\d.]+) s\)"),
        lambda m: (
            f"the rollout process gave no heartbeat for {m.group(1)} s; raise args.rollout_worker_timeout (now "
            f"{m.group(2)} s) when rewards, tools or environments are slow"
        ),
    ),
    (
        re.compile(r"train_dataset needs a 'prompt' column \(conversational\); it has (\[[^\]]*\])"),
        lambda m: (
            f"the dataset has no 'prompt' column (it has {m.group(1)}); map one to it with dataset_columns, "
            "e.g. {question: prompt}"
        ),
    ),
    (
        re.compile(r"(\d+) groups in a row were dropped \(max_dropped_groups=(\d+)\)"),
        lambda m: (
            f"{m.group(1)} groups in a row got equal rewards for every completion, so nothing could train; "
            "check that the reward functions can tell completions apart and the task's difficulty, or raise "
            f"args.max_dropped_groups (now {m.group(2)}; default GRPO_MAX_DROPPED_GROUPS)"
        ),
    ),
    (  # the trainer CLI refused the launched document (python -m trainer train prints one line a field)
        re.compile(r"^error: \S+: ([\w.\[\]]+): (.+)$", re.MULTILINE),
        lambda m: f"the trainer refused the run document: {m.group(1)}: {m.group(2)}",
    ),
)
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure))(?::\s*(.*))?$"
)


def last_exception(log_text: str) -> str | None:
    """``Type: message`` of the last exception line in ``log_text`` (module path dropped, first line
    of the message, cut to :data:`CAUSE_MAX_CHARS`); None when there is none."""
    found = None
    for line in log_text.splitlines():
        if not line or line[0].isspace():
            continue
        match = _EXCEPTION_LINE.match(line.rstrip())
        if match:
            found = match
    if found is None:
        return None
    text = found.group(1) + (f": {found.group(2).strip()}" if found.group(2) else "")
    return text if len(text) <= CAUSE_MAX_CHARS else text[: CAUSE_MAX_CHARS - 1] + "…"


def failure_sentence(*, process: str, status: str, log_text: str) -> str:
    """One sentence for a failed run's ``failure_reason``: ``process`` (``trainer``, ``vLLM server``)
    exited with ``status`` (``1``, ``137 (SIGKILL)``), the cause read from ``log_text`` (the end of its
    log) and the field or setting to change. The log itself goes to the run's events, not here."""
    head = f"{process} exited with status {status}"
    for pattern, cause in KNOWN_FAILURES:
        match = pattern.search(log_text)
        if match:
            return f"{head}: {cause(match)} (the log is in the run's events)"
    exception = last_exception(log_text)
    if exception:
        return f"{head}: {exception} (the traceback is in the run's events)"
    return (
        f"{head} without reporting an error (stopped from outside: a kill, or out of memory); its last log "
        "lines are in the run's events"
    )
