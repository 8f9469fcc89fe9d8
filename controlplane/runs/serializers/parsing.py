"""Request bodies as the API reads them: JSON whose nesting and size are bounded before parsing
(the DRF parser every view uses), and a YAML document's depth checked before it is loaded."""

from __future__ import annotations

import yaml
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from controlplane.runs.validation import MAX_DOCUMENT_DEPTH


def yaml_depth_error(text: str) -> str | None:
    """Refuse YAML nested deeper than ``MAX_DOCUMENT_DEPTH`` while it is parsed, from PyYAML's event
    stream: 64 KB of ``[[[[...`` is 32,000 levels, and building that document first cost 3.8 s of
    CPU before the depth check on the result could refuse it. Syntax errors are left to the loader."""
    if _flow_depth(text) > MAX_DOCUMENT_DEPTH:  # one pass over the characters, no parser
        return f"is nested deeper than {MAX_DOCUMENT_DEPTH} levels"
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DOCUMENT_DEPTH:
                    return f"is nested deeper than {MAX_DOCUMENT_DEPTH} levels"
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    return None


def _flow_depth(text: str) -> int:
    """The deepest nesting of unquoted ``[`` / ``{`` (YAML flow collections), scanning characters.

    Approximate on purpose: quotes are tracked without escapes, so it can only under-count (a
    plain scalar's apostrophe hides what follows), never refuse a document the parser would accept
    at that depth."""
    depth = deepest = 0
    quote = ""
    for ch in text:
        if quote:
            if ch == quote or ch == "\n":
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


class SafeJSONParser(JSONParser):
    """DRF's JSON parser, but a body nested too deeply for Python's ``json`` (``[[[[...`` 100k
    deep, a few hundred KB) is a 400 ``ParseError`` instead of an unhandled ``RecursionError`` (500).

    Installed as the first of ``REST_FRAMEWORK["DEFAULT_PARSER_CLASSES"]`` (settings.py).
    """

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type=media_type, parser_context=parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply") from None
