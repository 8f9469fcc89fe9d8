"""The embedded tiny model's chat template (Qwen3 layout) and the parser for its tool calls.

Layout::

    <|im_start|>system
    {first system message}\n\n# Tools ... <tools>{one JSON schema per line}</tools> ...<|im_end|>
    <|im_start|>user
    What is 2 + 3?<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    5
    </tool_response><|im_end|>
    <|im_start|>assistant
    \\boxed{5}<|im_end|>

The template is prefix-preserving, which the multi-turn tool loop needs: the rendering of
``messages[:k]`` (with or without the generation prompt) is a prefix of the rendering of
``messages[:k+1]``. So nothing depends on what comes later: earlier reasoning is never stripped,
every tool message is its own turn (no grouping that would move an ``<|im_end|>``), and message
content is rendered verbatim (no trimming), so re-rendering a sampled turn gives back its tokens.
``enable_thinking`` and other ``chat_template_kwargs`` are accepted and ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "TOOL_RESPONSE_END",
    "TOOL_RESPONSE_START",
    "assistant_message_from_text",
    "format_tool_call",
    "parse_tool_calls",
]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is sequence -%}
{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if has_system -%}{{- render_content(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call functions. Their signatures:\n<tools>' -}}
{%- for tool in tools -%}
{{- '\n' + ((tool.function if tool.function is defined else tool) | tojson) -}}
{%- endfor -%}
{{- '\n</tools>\n\nTo call one, reply with:\n'
    + '<tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and has_system -%}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if message.reasoning_content is string -%}
{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}
{%- endif -%}
{%- set content = render_content(message.content) -%}
{{- content -}}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
{%- if not loop.first or content -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": ' + (call.name | tojson) + ', "arguments": ' -}}
{%- if call.arguments is string -%}{{- call.arguments -}}
{%- else -%}{{- call.arguments | tojson -}}
{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + render_content(message.content)
    + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()

_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The exact text the template renders for one call (what the model is trained to emit)."""
    name_json, arguments_json = (
        json.dumps(name, ensure_ascii=False),
        json.dumps(arguments, ensure_ascii=False),
    )
    payload = f'{{"name": {name_json}, "arguments": {arguments_json}}}'
    return f"{TOOL_CALL_START}\n{payload}\n{TOOL_CALL_END}"


def _parse_one(body: str) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return {"name": None, "arguments": {}, "error": f"invalid JSON in tool call: {exc.msg}"}
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return {"name": None, "arguments": {}, "error": "tool call must be an object with a string 'name'"}
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return {"name": payload["name"], "arguments": {}, "error": f"invalid JSON arguments: {exc.msg}"}
    if not isinstance(arguments, dict):
        return {"name": payload["name"], "arguments": {}, "error": "tool call 'arguments' must be an object"}
    return {"name": payload["name"], "arguments": arguments}


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The ``<tool_call>`` blocks of generated ``text``, in order.

    Returns ``[{"name": str, "arguments": dict}, ...]``; a block that does not parse (bad JSON, no
    name, non-object arguments, or an opening tag never closed) yields an entry with an ``"error"``
    key (its ``name`` is None when unknown) so the caller can count a tool failure.
    """
    calls = [_parse_one(match.group(1).strip()) for match in _TOOL_CALL_RE.finditer(text)]
    tail = text[text.rfind(TOOL_CALL_END) + len(TOOL_CALL_END) :] if TOOL_CALL_END in text else text
    if TOOL_CALL_START in tail:
        calls.append({"name": None, "arguments": {}, "error": "unterminated tool call"})
    return calls


def assistant_message_from_text(text: str) -> dict[str, Any]:
    """An assistant message (transformers format) from one generated turn, without its EOS token.

    ``content`` is the text before the first tool call (the template's separating newline removed),
    ``tool_calls`` the well-formed calls. Re-rendering the message gives back ``text`` whenever the
    model followed the template's layout, so the next turn's prompt extends the sampled tokens.
    """
    calls = [c for c in parse_tool_calls(text) if "error" not in c]
    start = text.find(TOOL_CALL_START)
    if start < 0 or not calls:
        return {"role": "assistant", "content": text}
    content = text[:start]
    if content.endswith("\n"):
        content = content[:-1]
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"type": "function", "function": c} for c in calls],
    }


# Content-part types that carry pixels (OpenAI / transformers chat formats).
_IMAGE_PART_TYPES = {"image", "image_url", "input_image", "video", "video_url"}


def check_text_only(messages: Any, where: str) -> None:
    """Refuse a conversation with image or video parts: vision-language models train on text only.

    ``where`` names the prompt (e.g. ``"train_dataset row 12"``) in the error.
    """
    if not isinstance(messages, list):
        return
    for turn, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            # Arrow-backed datasets give every part every key (None where unused): test values, not keys.
            has_pixels = isinstance(part, dict) and any(
                part.get(k) is not None for k in ("image", "image_url")
            )
            if kind in _IMAGE_PART_TYPES or has_pixels:
                raise ValueError(
                    f"{where}: message {turn} has a {kind or 'image'!r} content part; AsyncGRPOTrainer trains "
                    "vision-language models on text only (the vision tower is frozen and not synced). "
                    "Remove image/video parts from the prompts"
                )
