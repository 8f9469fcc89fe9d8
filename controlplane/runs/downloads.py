"""Downloads of a run's metrics and completions (``?format=csv|json`` on their API endpoints):
rows from the selectors' streaming iterators, encoded in pieces of about ``PIECE_CHARS`` and sent as
a ``StreamingHttpResponse`` attachment, so a run of millions of points is never held whole.

Under ASGI (daphne) Django would turn a synchronous iterator into a list before sending it; the
pieces are therefore pulled one at a time through ``sync_to_async`` (the request's own thread, so
the server-side cursor stays on its connection). Under WSGI the iterator is served as it is.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse

from controlplane.runs.services.ingest import finite_or_none

FORMATS = ("csv", "json")
CONTENT_TYPES = {"csv": "text/csv; charset=utf-8", "json": "application/json"}
PIECE_CHARS = 64 * 1024  # one chunk of the HTTP body (characters)


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


def _csv_pieces(header: list[str], rows: Iterable[list[Any]]) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow(row)
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


async def _pulled(pieces: Iterator[str]) -> AsyncIterator[str]:
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
