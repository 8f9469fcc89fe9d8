"""Downloads of a run's metrics and completions (``?format=csv|json`` on their API endpoints):
rows from the selectors' streaming iterators, encoded in pieces of about ``PIECE_CHARS`` and sent as
a ``StreamingHttpResponse`` attachment, so a run of millions of points is never held whole.

A checkpoint folder (``GET /runs/<id>/checkpoints/<step>/download/``, the run's owner only) is
sent the same way as an uncompressed tar (weights hardly compress), its headers and blocks written
here so that each file is read in pieces of ``READ_BYTES``: only the folder's regular files and
directories go in (symbolic links and other special files are left out), and only a folder inside
the run's output directory, itself inside ``GRPO_RUNS_DIR`` (:func:`checkpoint_folder`).

Under ASGI (daphne) Django would turn a synchronous iterator into a list before sending it; the
pieces are therefore pulled one at a time through ``sync_to_async`` (the request's own thread, so
the server-side cursor stays on its connection). Under WSGI the iterator is served as it is.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import tarfile
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponseNotFound, StreamingHttpResponse
from django.http.response import HttpResponseBase

from controlplane.runs.json_values import finite_or_none
from controlplane.runs.models import Checkpoint

FORMATS = ("csv", "json")
CONTENT_TYPES = {"csv": "text/csv; charset=utf-8", "json": "application/json", "tar": "application/x-tar"}
PIECE_CHARS = 64 * 1024  # one chunk of the HTTP body (characters)
READ_BYTES = 1 << 20  # a checkpoint file is sent in pieces of this many bytes


def metrics_pieces(*, fmt: str, columns: list[str], rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    """CSV: a ``step`` column then one per metric name (empty where not logged at that step; NaN
    and inf written as ``nan``/``inf``, which pandas reads back). JSON: an array of
    ``{"step", name: value}`` objects, one per step (non-finite values null: JSON has none)."""
    if fmt == "csv":
        header = ["step", *columns]
        return _csv_pieces(header, ([row.get(name, "") for name in header] for row in rows))
    return _json_pieces({k: finite_or_none(v) if k != "step" else v for k, v in row.items()} for row in rows)


def completions_pieces(*, fmt: str, fields: tuple[str, ...], rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    """CSV: one row per completion, columns ``fields`` (``rewards`` as a JSON object). JSON: an
    array of objects with those fields (the API's completion shape)."""
    if fmt == "csv":
        return _csv_pieces(
            list(fields),
            ([json.dumps(v) if isinstance(v, dict) else _cell(v) for v in row.values()] for row in rows),
        )
    return _json_pieces(
        {k: finite_or_none(v) if isinstance(v, float) else v for k, v in row.items()} for row in rows
    )


def _cell(value: Any) -> Any:
    return "" if value is None else value


# A spreadsheet reads a cell starting with one of these as a formula (OWASP "CSV injection"):
# completions and plugin metric names are text from models and users.
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def csv_text_cell(value: Any) -> Any:
    """``value`` for a CSV cell: text that a spreadsheet would run as a formula gets a leading ``'``
    (shown as text, the quote hidden); numbers, negative ones included, stay numbers."""
    if isinstance(value, str) and value.startswith(FORMULA_PREFIXES):
        return "'" + value
    return value


def _csv_pieces(header: list[str], rows: Iterable[list[Any]]) -> Iterator[str]:
    buffer = io.StringIO()
    # RFC 4180's CRLF: with both in the line terminator, a field holding a bare \r (model text can)
    # is quoted too, so no reader splits a row there.
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow([csv_text_cell(name) for name in header])
    for row in rows:
        writer.writerow([csv_text_cell(cell) for cell in row])
        if buffer.tell() >= PIECE_CHARS:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


def _json_pieces(objects: Iterable[dict[str, Any]]) -> Iterator[str]:
    parts: list[str] = ["["]
    size = 1
    separator = "\n"
    for obj in objects:
        text = separator + json.dumps(obj, allow_nan=False)
        separator = ",\n"
        parts.append(text)
        size += len(text)
        if size >= PIECE_CHARS:
            yield "".join(parts)
            parts, size = [], 0
    parts.append("\n]\n")
    yield "".join(parts)


_END = object()


async def _pulled(pieces: Iterator[Any]) -> AsyncIterator[Any]:
    pull = sync_to_async(next, thread_sensitive=True)
    while (piece := await pull(pieces, _END)) is not _END:
        yield piece


def download_response(
    *, request: HttpRequest, pieces: Iterator[str], fmt: str, filename: str
) -> StreamingHttpResponse:
    """A streamed attachment ``filename`` of ``pieces`` (an async iterator under ASGI)."""
    content = _pulled(pieces) if isinstance(request, ASGIRequest) else pieces
    response = StreamingHttpResponse(content, content_type=CONTENT_TYPES[fmt])
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Cache-Control"] = "no-store"
    return response


# ---------------------------------------------------------------------------------- checkpoints
def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def checkpoint_folder(*, checkpoint: Checkpoint, runs_root: str | Path) -> Path | None:
    """The checkpoint's folder on this host, resolved (links followed), or None when it is not a
    directory here or lies anywhere but inside its run's output directory, itself inside
    ``runs_root`` (``GRPO_RUNS_DIR``): a stored path never reaches files outside the run's output."""
    run = checkpoint.run
    if not run.output_dir or "\x00" in checkpoint.path or "\x00" in run.output_dir:
        return None
    root = os.path.realpath(runs_root)
    output = os.path.realpath(run.output_dir)
    folder = os.path.realpath(checkpoint.path)
    if not (_inside(output, root) and output != root and _inside(folder, output) and folder != output):
        return None
    return Path(folder) if os.path.isdir(folder) else None


@dataclass(frozen=True)
class _TarMember:
    header: bytes
    path: Path | None  # a regular file's path; None for a directory
    size: int


def _tar_members(folder: Path, arcname: str) -> list[_TarMember]:
    """The folder's directories and regular files, in a stable order, each with its tar header.
    Symbolic links (which could point anywhere) and special files are left out."""
    members: list[_TarMember] = []

    def header(name: str, st: os.stat_result, kind: bytes) -> bytes:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.size = st.st_size if kind == tarfile.REGTYPE else 0
        info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
        info.mtime = int(st.st_mtime)
        return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")

    for here, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        relative = os.path.relpath(here, folder)
        prefix = arcname if relative == "." else f"{arcname}/{Path(relative).as_posix()}"
        members.append(_TarMember(header(prefix + "/", os.lstat(here), tarfile.DIRTYPE), None, 0))
        dirs[:] = [d for d in dirs if stat.S_ISDIR(os.lstat(os.path.join(here, d)).st_mode)]
        for name in sorted(files):
            path = Path(here) / name
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                members.append(_TarMember(header(f"{prefix}/{name}", st, tarfile.REGTYPE), path, st.st_size))
    return members


def _padding(size: int, unit: int) -> int:
    return -size % unit


def checkpoint_tar(*, folder: Path, arcname: str) -> tuple[int, Iterator[bytes]]:
    """The folder as an uncompressed tar whose top-level directory is ``arcname``: its length in
    bytes and its pieces (headers, then each file in pieces of at most ``READ_BYTES``). A file that
    shrank since it was listed ends the stream with an error (the client sees a cut download, never
    a wrong one); one that grew is sent at its listed size."""
    members = _tar_members(folder, arcname)
    body = sum(len(m.header) + m.size + _padding(m.size, tarfile.BLOCKSIZE) for m in members)
    end = 2 * tarfile.BLOCKSIZE
    total = body + end + _padding(body + end, tarfile.RECORDSIZE)

    def pieces() -> Iterator[bytes]:
        for member in members:
            yield member.header
            if member.path is None:
                continue
            fd = os.open(member.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as fh:
                left = member.size
                while left:
                    piece = fh.read(min(READ_BYTES, left))
                    if not piece:
                        raise OSError(f"{member.path} shrank while it was being sent")
                    left -= len(piece)
                    yield piece
            if pad := _padding(member.size, tarfile.BLOCKSIZE):
                yield bytes(pad)
        yield bytes(total - body)

    return total, pieces()


def checkpoint_download_response(
    *, request: HttpRequest, folder: Path, filename: str
) -> StreamingHttpResponse:
    """The checkpoint folder as a streamed tar attachment ``filename`` (``<stem>/...`` inside)."""
    size, pieces = checkpoint_tar(folder=folder, arcname=filename.removesuffix(".tar"))
    content = _pulled(pieces) if isinstance(request, ASGIRequest) else pieces
    response = StreamingHttpResponse(content, content_type=CONTENT_TYPES["tar"])
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Content-Length"] = str(size)
    response["Cache-Control"] = "no-store"
    return response


def checkpoint_owned_response(*, request: HttpRequest, user: Any, run_id: int, step: int) -> HttpResponseBase:
    """The page's and the API's checkpoint download: ``user``'s own run's checkpoint at ``step`` as a
    streamed tar (``Http404`` for anyone else's, or no such checkpoint), or a plain-text 404 saying
    the folder is not on this host (a worker elsewhere) or not inside the run's output directory."""
    from controlplane.runs import selectors

    checkpoint = selectors.run_checkpoint_owned_get(user=user, run_id=run_id, step=step)
    folder = checkpoint_folder(checkpoint=checkpoint, runs_root=settings.GRPO_RUNS_DIR)
    if folder is None:
        return HttpResponseNotFound(
            f"The folder of run {run_id}'s checkpoint at step {step} is not on this host, or not inside "
            "the run's output directory.\n",
            content_type="text/plain; charset=utf-8",
        )
    return checkpoint_download_response(
        request=request, folder=folder, filename=f"run-{run_id}-checkpoint-{step}.tar"
    )
