"""Tool calls in a model's output: one small parser class per format, chosen from the template.

Each family that ships a tool-calling chat template writes its calls in its own format:

======================  ==========================================================================
parser                  the model writes
======================  ==========================================================================
``hermes``              ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, once per
                        call (Qwen2.5, Qwen3, Hermes 2/3, SmolLM3)
``mistral``             ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or
                        ``[TOOL_CALLS]name[ARGS]{...}`` (the tokenizers of 2025)
``pythonic``            ``[name(key=value, ...), ...]`` as the whole answer, possibly between
                        ``<|python_start|>`` and ``<|python_end|>`` (Llama 4; read with
                        ``ast.literal_eval``, nothing is run)
``llama3_json``         ``{"name": ..., "parameters": {...}}`` as the whole answer, calls joined
                        by ``;``, possibly after ``<|python_tag|>`` (Llama 3.1, 3.2, 3.3)
======================  ==========================================================================

A parser is registered by name (:func:`register_tool_parser`, as vLLM's ``ToolParserManager``)
with the strings that mark its format in a chat template's source; :func:`tool_parser_for`
picks the first whose markers the template holds. :meth:`ToolParser.parse` splits a whole answer
into its text and its :class:`ToolCall` list; :class:`ToolCallStream` does the same while the
text arrives, as the OpenAI API streams ``tool_calls`` deltas. Output that does not parse as
calls is text (nothing is lost). :meth:`ToolParser.call_schema` and the parser's ``prefix`` and
``suffix`` say what a well-formed call is, for constrained decoding
(:mod:`portable_llm.generation.grammar`).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "TOOL_PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "register_tool_parser",
    "tool_parser",
    "tool_parser_for",
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
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _raw_call(text: str, start: int = 0) -> ToolCall | None:
    """The call whose JSON object begins at ``text[start]``, its arguments the model's own
    JSON text (as the stream sent it); ``None`` when it is not ``{"name": ..., "arguments":
    {...}}`` in that order (then :func:`_call` of the decoded object)."""
    head = _HEAD.match(text, start)
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
    return ToolCall(name, text[head.end() : end], "call_" + uuid.uuid4().hex[:24])


def _open_arguments(text: str, start: int = 0) -> tuple[str, str] | None:
    """A call in progress from ``text[start]``: its name and the arguments' text so far (all of
    it while their object is open, the whole object once closed); ``None`` before its
    arguments' ``{``."""
    head = _HEAD.match(text, start)
    if head is None or not text.startswith("{", head.end()):
        return None
    return json.loads(head.group(1)), _object_so_far(text, head.end())


def _object_so_far(text: str, start: int) -> str:
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


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
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
    return ToolCall(obj["name"], text, "call_" + uuid.uuid4().hex[:24])


class ToolParser:
    """A tool-call format: subclasses set the class attributes and :meth:`calls`.

    Attributes
    ----------
    name : str
        The registry's key.
    markers : tuple of str
        Any of these in a chat template's source marks the format.
    start : tuple of str
        Where calls begin in the output; text before the first is the answer's text.
    at_start_only : bool
        Calls only as the whole answer (leading whitespace aside): Llama 3's JSON.
    special_tokens : bool
        The format's markers are special tokens, so the output must be decoded with them kept.
    prefix, suffix : str
        Around one call's JSON (:meth:`call_schema`) in constrained decoding.
    constrainable : bool
        Whether one call is JSON between ``prefix`` and ``suffix``, so that constrained
        decoding can force it (``False``: ``tool_choice`` ``"required"`` or named is refused).
    """

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    start: ClassVar[tuple[str, ...]] = ()
    at_start_only: ClassVar[bool] = False
    special_tokens: ClassVar[bool] = False
    prefix: ClassVar[str] = ""
    suffix: ClassVar[str] = ""
    arguments_key: ClassVar[str] = "arguments"
    constrainable: ClassVar[bool] = True

    def calls(self, text: str) -> tuple[list[ToolCall], bool]:
        """The complete calls at the front of ``text`` (the output from its first ``start`` on)
        and whether ``text`` is entirely calls (else some of it is not, or not yet)."""
        raise NotImplementedError

    def pending(self, text: str, done: int) -> tuple[str, str] | None:
        """The call in progress after the ``done`` complete ones at the front of ``text``: its
        name and the text of its arguments so far, for a stream to send them as they come;
        ``None`` (the default: a format whose calls are sent whole) when there is none yet."""
        return None

    def call_schema(self, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The JSON schema of one call to any of ``tools`` (OpenAI tool objects)."""
        options = []
        for tool in tools:
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            options.append({
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, self.arguments_key: params},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            })  # fmt: skip
        return options[0] if len(options) == 1 else {"anyOf": options}

    def begin(self, text: str) -> int | None:
        """Where the calls begin in ``text``, or ``None``."""
        if self.at_start_only:
            body = text.lstrip()
            found = any(body.startswith(s) for s in self.start)
            return len(text) - len(body) if found else None
        hits = [i for i in (text.find(s) for s in self.start) if i >= 0]
        return min(hits) if hits else None

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` (with no call begun) could still begin
        one: they are held back from a stream until the next piece settles it."""
        if self.at_start_only:
            body = text.lstrip()
            return len(text) if any(s.startswith(body) for s in self.start) else 0
        hold = 0
        for s in self.start:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer as ``(content, calls)``: ``content`` is the text before the calls
        (``None`` when empty); output that is not entirely well-formed calls is all content."""
        at = self.begin(text)
        if at is None:
            return text, []
        calls, whole = self.calls(text[at:])
        if not whole or not calls:
            return text, []
        return (text[:at].strip() or None), calls


def _json_objects(text: str, separator: str = "") -> tuple[list[Any], bool]:
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


def _value_starts(text: str, separator: str, count: int) -> list[int]:
    """Where each of the first ``count`` values of :func:`_json_objects` begins (the last one
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
            values, whole = _json_objects(match.group(1))
            call = None
            if whole and len(values) == 1:
                body = match.group(1)
                call = _raw_call(body, len(body) - len(body.lstrip())) or _call(values[0])
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
        return None if opened is None else _open_arguments(text, opened.end())


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
        return [], False, (name.strip(), _object_so_far(text, start)) if opened else None
    if not isinstance(args, dict) or text[end:].strip():
        return [], False, None
    call = ToolCall(name.strip(), text[start:end], "call_" + uuid.uuid4().hex[:24])
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
            return calls, False, _open_arguments(text, i)
        call = _raw_call(text, i) or _call(value)
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
        values, whole = _json_objects(body, ";")
        starts = _value_starts(body, ";", len(values))
        calls = [
            _raw_call(body, i) or _call(v, "parameters")
            for v, i in zip(values, starts, strict=True)
        ]
        if any(c is None for c in calls):
            return [], False
        return [c for c in calls if c is not None], whole

    def pending(self, text: str, done: int) -> tuple[str, str] | None:
        body = text.strip().removeprefix("<|python_tag|>")
        (start,) = _value_starts(body, ";", done + 1)[-1:] or (0,)
        return _open_arguments(body, start)


#: The parsers by name, in the order :func:`tool_parser_for` tries their markers.
TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(parser: type[ToolParser]) -> type[ToolParser]:
    """Register ``parser`` under its ``name`` (a later one of the same name replaces it);
    usable as a class decorator."""
    if not parser.name:
        raise ValueError("register_tool_parser: the parser class must set name")
    TOOL_PARSERS[parser.name] = parser
    return parser


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
    return _call({"name": node.func.id, "arguments": args})


for _parser in (HermesParser, MistralParser, PythonicParser, Llama3JsonParser):
    register_tool_parser(_parser)


def tool_parser(name: str, /) -> ToolParser:
    """The parser registered as ``name``; ``ValueError`` listing the names otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_parser: name must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()


def tool_parser_for(chat_template: str | None, /) -> ToolParser | None:
    """The parser whose markers the chat template's source holds (first registered first), or
    ``None`` (a template that does not render tool calls)."""
    if not chat_template:
        return None
    for parser in TOOL_PARSERS.values():
        if any(m in chat_template for m in parser.markers):
            return parser()
    return None


class ToolCallStream:
    """A streamed answer split as it arrives: ``feed(piece)`` returns ``(text, deltas)``, the
    new text to show and :class:`ToolCallDelta` pieces of the calls; ``feed("", final=True)``
    settles the end (output that never became a call is shown as text, as
    :meth:`ToolParser.parse` does, unless a call of it was already being sent).

    Text that could begin a call is held back until the next piece settles it; from the first
    call on nothing more is shown as text (text between calls is dropped, as the non-streamed
    :meth:`ToolParser.parse` keeps only the text before them). A call goes out as soon as its
    name and the ``{`` of its arguments are there (formats with :meth:`ToolParser.pending`),
    then its arguments as they come; otherwise whole, once complete. ``calls`` holds the
    complete calls so far, their ids those the stream sent.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""
        self._shown = 0  # characters shown as text
        self._begin: int | None = None  # where the calls begin
        self.calls: list[ToolCall] = []
        self._open: tuple[str, str] | None = None  # (id, arguments sent) of the call being sent

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._text += piece
        text = self._text
        if self._begin is None:
            self._begin = self.parser.begin(text)
        if self._begin is None:
            end = len(text) if final else len(text) - self.parser.held(text)
            return self._show(end), []
        shown = self._show(self._begin)
        body = text[self._begin :]
        calls, whole = self.parser.calls(body)
        if final and not (whole and calls) and not self.calls and self._open is None:
            self._begin = len(text)  # never calls: all of it is text
            return shown + self._show(len(text)), []
        deltas = [d for call in calls[len(self.calls) :] for d in self._complete(call)]
        opened = None if final else self.parser.pending(body, len(self.calls))
        if opened is not None:
            deltas += self._progress(*opened)
        return shown, deltas

    def _complete(self, call: ToolCall) -> list[ToolCallDelta]:
        """The deltas that finish ``call`` (the rest of its arguments when it was being sent,
        else the whole call)."""
        index = len(self.calls)
        if self._open is None or not call.arguments.startswith(self._open[1]):
            out = [
                ToolCallDelta(index, "", call.id, call.name),
                ToolCallDelta(index, call.arguments),
            ]
        else:
            call = ToolCall(call.name, call.arguments, self._open[0])
            rest = call.arguments[len(self._open[1]) :]
            out = [ToolCallDelta(index, rest)] if rest else []
        self.calls.append(call)
        self._open = None
        return out

    def _progress(self, name: str, arguments: str) -> list[ToolCallDelta]:
        index = len(self.calls)
        out = []
        if self._open is None:
            self._open = ("call_" + uuid.uuid4().hex[:24], "")
            out.append(ToolCallDelta(index, "", self._open[0], name))
        sent = self._open[1]
        if len(arguments) > len(sent) and arguments.startswith(sent):
            out.append(ToolCallDelta(index, arguments[len(sent) :]))
            self._open = (self._open[0], arguments)
        return out

    def _show(self, end: int) -> str:
        out = self._text[self._shown : max(end, self._shown)]
        self._shown = max(end, self._shown)
        return out
