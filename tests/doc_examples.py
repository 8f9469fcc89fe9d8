"""The examples of README.md and docs/*.md that ``tests/test_doc_examples.py`` runs (issue 28 item 4).

An example is a fenced block whose language is ``yaml`` or ``json``, or any block with a ``curl``
command in it. Each says what it is in an HTML comment on the line above its fence, which the
rendered page does not show:

* ``<!-- example: run document -->``: a whole run document; the control plane accepts it as is;
* ``<!-- example: run document fragment -->``: added to a small ``tiny`` document, accepted;
* ``<!-- example: trainer run file -->``: a RUN.yaml for ``python -m trainer train``; the trainer's
  reader accepts it and the control plane accepts it less the ``args`` it sets for each run;
* ``<!-- example: reference -->``: a listing of fields (alternatives shown side by side); every
  key is one the run document has;
* ``<!-- example: commands -->``: shell lines run against the live stack in order (``python
  manage.py ...``, ``curl ... http://HOST/...`` with ``$TOKEN``); each answers as the text says;
* ``<!-- example: tested by tests/FILE.py::TEST -->``: a longer flow that test runs;
* ``<!-- example: not run: WHY -->``: cannot run in the suite, and why.

A block with ``curl`` and no marker is ``commands``; any other example with no marker is an error.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KINDS = (
    "run document",
    "run document fragment",
    "trainer run file",
    "reference",
    "commands",
    "tested by",
    "not run",
)
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*example:\s*(?P<text>.*?)\s*-->$")


@dataclass(frozen=True)
class Example:
    """One fenced block: where it is (``path`` relative to the repo, 1-based ``line`` of its fence),
    its language, its text, and the marker above it (``kind`` None when there is none)."""

    path: str
    line: int
    lang: str
    body: str
    kind: str | None
    detail: str  # the reason of "not run", the test of "tested by"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def documents() -> list[Path]:
    """README.md and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _marker(line: str) -> tuple[str | None, str]:
    """(kind, detail) of a marker line; (None, "") if the line is not one."""
    match = _MARKER.match(line.strip())
    if match is None:
        return None, ""
    text = match["text"]
    for kind in ("tested by", "not run"):
        if text.startswith(kind):
            return kind, text[len(kind) :].lstrip(" :")
    return text, ""


def blocks(path: Path) -> list[Example]:
    """Every fenced block of ``path`` with the marker on the line above it, if any."""
    lines = path.read_text().splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        kind, detail = _marker(lines[i - 1]) if i > 0 else (None, "")
        found.append(
            Example(
                path=str(path.relative_to(REPO)),
                line=i + 1,
                lang=fence.group(1),
                body="\n".join(lines[i + 1 : end]) + "\n",
                kind=kind,
                detail=detail,
            )
        )
        i = end + 1
    return found


def is_example(block: Example) -> bool:
    """yaml, json, a block with a curl command (the issue's curl, JSON and YAML examples), or any
    block with a marker."""
    return (
        block.kind is not None
        or block.lang in ("yaml", "yml", "json")
        or any(line.lstrip().startswith("curl ") for line in block.body.splitlines())
    )


def examples() -> list[Example]:
    """Every example of README.md and docs/, each with its kind (``commands`` for an unmarked curl)."""
    found = []
    for path in documents():
        for block in blocks(path):
            if not is_example(block):
                continue
            if block.kind is None and block.lang not in ("yaml", "yml", "json"):
                block = Example(block.path, block.line, block.lang, block.body, "commands", "")
            found.append(block)
    return found


def commands(body: str) -> list[list[str]]:
    """The shell commands of a block as argv lists (``shlex`` rules): a backslash-newline continues a
    line, a newline inside quotes belongs to the quoted word, ``#`` outside quotes starts a comment."""
    text = body.replace("\\\n", " ")
    found: list[list[str]] = []
    current: list[str] = []
    quote = ""
    for char in text:
        if char == "\n" and not quote:
            found.append(shlex.split("".join(current), comments=True))
            current = []
            continue
        if char in "'\"" and (not quote or quote == char):
            quote = "" if quote else char
        current.append(char)
    found.append(shlex.split("".join(current), comments=True))
    return [argv for argv in found if argv]
