"""A tool call and the pieces a stream sends of it, and the JSON reading every JSON format
shares: the call object ``{"name": ..., "arguments": {...}}`` with its arguments as the model
wrote them, how far an object that is still being generated goes, values one after another."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CALL_HEAD",
    "ToolCall",
    "ToolCallDelta",
    "decoded_call",
    "json_values",
    "new_call_id",
    "object_so_far",
    "open_arguments",
    "raw_call",
    "value_starts",
]


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (as the OpenAI API)."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {
            "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }  # fmt: skip


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: the first of a call has its ``id`` and ``name`` (and
    ``arguments == ""``), the next ones pieces of its arguments' JSON text, which joined are the
    call's ``arguments``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` item of a chunk's delta, as the OpenAI API streams it."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index, "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }  # fmt: skip


#: A call's JSON up to its arguments' value: ``{"name": "...", "arguments": `` (or
#: ``"parameters"``); group 1 the name as a JSON string.
CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def raw_call(text: str, start: int = 0) -> ToolCall | None:
    """The call whose JSON object begins at ``text[start]``, its arguments the model's own
    JSON text (as the stream sent it); ``None`` when it is not ``{"name": ..., "arguments":
    {...}}`` in that order (then :func:`decoded_call` of the decoded object)."""
    head = CALL_HEAD.match(text, start)
    if head is None:
        return None
    try:
        args, end = json.JSONDecoder().raw_decode(text, head.end())
        name = json.loads(head.group(1))
    except ValueError:
        return None
    close = re.compile(r"\s*\}").match(text, end)
    if not isinstance(args, dict) or close is None:
        return None
    return ToolCall(name, text[head.end() : end], new_call_id())


def open_arguments(text: str, start: int = 0) -> tuple[str, str] | None:
    """A call in progress from ``text[start]``: its name and the arguments' text so far (all of
    it while their object is open, the whole object once closed); ``None`` before its
    arguments' ``{``."""
    head = CALL_HEAD.match(text, start)
    if head is None or not text.startswith("{", head.end()):
        return None
    return json.loads(head.group(1)), object_so_far(text, head.end())


def object_so_far(text: str, start: int) -> str:
    """The JSON object (or array) that begins at ``text[start]``, as far as it goes: up to its
    closing bracket, else to the end of ``text`` (brackets inside strings do not count)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = c == "\\", c != '"'
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return text[start:]


def decoded_call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A :class:`ToolCall` from a decoded ``{"name": str, arguments_key: {...}}``, else None."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # already JSON text: keep it if it is JSON
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    else:
        text = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text, new_call_id())


def json_values(text: str, separator: str = "") -> tuple[list[Any], bool]:
    """The JSON values one after another at the front of ``text`` (between them, whitespace
    and ``separator``), and whether nothing else follows."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or (separator and text[i] == separator and out)):
            i += 1
        if i == n:
            return out, bool(out)
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return out, False
        out.append(value)


def value_starts(text: str, separator: str, count: int) -> list[int]:
    """Where each of the first ``count`` values of :func:`json_values` begins (the last one
    possibly still incomplete)."""
    decoder = json.JSONDecoder()
    out: list[int] = []
    i, n = 0, len(text)
    while len(out) < count:
        while i < n and (text[i].isspace() or (separator and text[i] == separator and out)):
            i += 1
        out.append(i)
        try:
            _, i = decoder.raw_decode(text, i)
        except ValueError:
            break
    return out


def new_call_id() -> str:
    """A fresh call id, ``call_`` and 24 hex digits (OpenAI's shape)."""
    return "call_" + uuid.uuid4().hex[:24]
