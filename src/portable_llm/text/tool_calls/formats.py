"""The tool-call formats of the supported families, each a :class:`~portable_llm.text.
tool_calls.parser.ToolParser` registered by name (see the table in
:mod:`portable_llm.text.tool_calls`)."""

from __future__ import annotations

import ast
import json
import re

from portable_llm.text.tool_calls.calls import (
    ToolCall,
    decoded_call,
    json_values,
    new_call_id,
    object_so_far,
    open_arguments,
    raw_call,
    value_starts,
)
from portable_llm.text.tool_calls.parser import ToolParser, register_tool_parser

__all__ = ["HermesParser", "Llama3JsonParser", "MistralParser", "PythonicParser"]


class HermesParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen, Hermes)."""

    name = "hermes"
    markers = ("<tool_call>",)
    start = ("<tool_call>",)
    prefix = "<tool_call>\n"
    suffix = "\n</tool_call>"
    _block = re.compile(r"\s*<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls(self, text: str) -> tuple[list[ToolCall], bool]:
        out: list[ToolCall] = []
        i = 0
        while True:
            match = self._block.match(text, i)
            if match is None:
                break
            values, whole = json_values(match.group(1))
            call = None
            if whole and len(values) == 1:
                body = match.group(1)
                call = raw_call(body, len(body) - len(body.lstrip())) or decoded_call(values[0])
            if call is None:
                return out, False
            out.append(call)
            i = match.end()
        return out, bool(out) and not text[i:].strip()

    def pending(self, text: str, done: int) -> tuple[str, str] | None:
        i = 0
        for _ in range(done):
            match = self._block.match(text, i)
            if match is None:
                return None
            i = match.end()
        opened = re.compile(r"\s*<tool_call>\s*").match(text, i)
        return None if opened is None else open_arguments(text, opened.end())


class MistralParser(ToolParser):
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    start = ("[TOOL_CALLS]",)
    special_tokens = True
    prefix = "[TOOL_CALLS]["
    suffix = "]"

    def calls(self, text: str) -> tuple[list[ToolCall], bool]:
        out: list[ToolCall] = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            calls, done, _ = _mistral_segment(part)
            out += calls
            if not done:
                return out, False
        return out, bool(out)

    def pending(self, text: str, done: int) -> tuple[str, str] | None:
        parts = text.split("[TOOL_CALLS]")[1:]
        before = sum(len(_mistral_segment(p)[0]) for p in parts[:-1])
        if not parts:
            return None
        calls, _, opened = _mistral_segment(parts[-1])
        return opened if before + len(calls) == done else None


def _mistral_segment(text: str) -> tuple[list[ToolCall], bool, tuple[str, str] | None]:
    """What follows one ``[TOOL_CALLS]``: its complete calls, whether it is complete and well
    formed, and the call in progress (name, arguments so far) if any."""
    i = len(text) - len(text.lstrip())
    if text.startswith("[", i):  # a JSON array of calls
        return _mistral_array(text, i + 1)
    name, sep, _ = text.partition("[ARGS]")  # name[ARGS]{...}
    if not sep or not name.strip():
        return [], False, None
    start = len(name) + len(sep)
    start += len(text[start:]) - len(text[start:].lstrip())
    try:
        args, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        opened = text.startswith("{", start)
        return [], False, (name.strip(), object_so_far(text, start)) if opened else None
    if not isinstance(args, dict) or text[end:].strip():
        return [], False, None
    call = ToolCall(name.strip(), text[start:end], new_call_id())
    return [call], True, None


def _mistral_array(text: str, i: int) -> tuple[list[ToolCall], bool, tuple[str, str] | None]:
    """The calls of ``[{...}, {...}]`` from ``text[i]`` (just past the ``[``)."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    while True:
        while i < len(text) and (text[i].isspace() or (text[i] == "," and calls)):
            i += 1
        if text.startswith("]", i):
            return calls, bool(calls) and not text[i + 1 :].strip(), None
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            return calls, False, open_arguments(text, i)
        call = raw_call(text, i) or decoded_call(value)
        if call is None:
            return calls, False, None
        calls.append(call)
        i = end


class Llama3JsonParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` as the whole answer (Llama 3.1-3.3)."""

    name = "llama3_json"
    markers = ("<|python_tag|>", '"parameters": ')
    start = ("<|python_tag|>", "{")
    at_start_only = True
    arguments_key = "parameters"

    def calls(self, text: str) -> tuple[list[ToolCall], bool]:
        body = text.strip().removeprefix("<|python_tag|>")
        values, whole = json_values(body, ";")
        starts = value_starts(body, ";", len(values))
        calls = [
            raw_call(body, i) or decoded_call(v, "parameters")
            for v, i in zip(values, starts, strict=True)
        ]
        if any(c is None for c in calls):
            return [], False
        return [c for c in calls if c is not None], whole

    def pending(self, text: str, done: int) -> tuple[str, str] | None:
        body = text.strip().removeprefix("<|python_tag|>")
        (start,) = value_starts(body, ";", done + 1)[-1:] or (0,)
        return open_arguments(body, start)


class PythonicParser(ToolParser):
    """``[get_weather(city="Paris", days=3), now()]`` as the whole answer, possibly between
    ``<|python_start|>`` and ``<|python_end|>`` (Llama 4, Llama 3.2's pythonic templates).

    Read with :func:`ast.parse` and :func:`ast.literal_eval` (literals only: nothing is run).
    Not JSON, so no grammar: ``tool_choice`` ``"required"`` or named is refused for it.
    """

    name = "pythonic"
    markers = ("[func_name1(",)
    start = ("<|python_start|>", "[")
    at_start_only = True
    constrainable = False

    def calls(self, text: str) -> tuple[list[ToolCall], bool]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return [], False
        if not isinstance(tree, ast.List) or not tree.elts:
            return [], False
        out = []
        for node in tree.elts:
            call = _pythonic_call(node)
            if call is None:
                return [], False
            out.append(call)
        return out, True


def _pythonic_call(node: ast.expr) -> ToolCall | None:
    """``name(key=literal, ...)`` as a call; ``None`` for anything else."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return decoded_call({"name": node.func.id, "arguments": args})


for _parser in (HermesParser, MistralParser, PythonicParser, Llama3JsonParser):
    register_tool_parser(_parser)
