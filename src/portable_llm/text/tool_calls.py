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
            call = _call(values[0]) if whole and len(values) == 1 else None
            if call is None:
                return out, False
            out.append(call)
            i = match.end()
        return out, bool(out) and not text[i:].strip()


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
            body = part.strip()
            if body.startswith("["):  # a JSON array of calls
                values, whole = _json_objects(body)
                items = values[0] if values and isinstance(values[0], list) else []
                calls = [_call(v) for v in items]
                done = whole and len(values) == 1 and bool(items)
            else:  # name[ARGS]{...}
                name, sep, args = body.partition("[ARGS]")
                values, done = _json_objects(args)
                ok = sep and name.strip() and len(values) == 1
                calls = [_call({"name": name.strip(), "arguments": values[0]})] if ok else []
                done = done and bool(ok)
            if not calls or any(c is None for c in calls):
                return out, False
            out += [c for c in calls if c is not None]
            if not done:
                return out, False
        return out, bool(out)


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
        calls = [_call(v, "parameters") for v in values]
        if any(c is None for c in calls):
            return [], False
        return [c for c in calls if c is not None], whole


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
    """A streamed answer split as it arrives: ``feed(piece)`` returns ``(text, calls)``, the
    new text to show and the calls completed by this piece; ``feed("", final=True)`` settles
    the end (a call that never completed is shown as text, as :meth:`ToolParser.parse` does).

    Text that could begin a call is held back until the next piece settles it; from the first
    call on nothing more is shown as text (text between calls is dropped, as the non-streamed
    :meth:`ToolParser.parse` keeps only the text before them).
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""
        self._shown = 0  # characters shown as text
        self._begin: int | None = None  # where the calls begin
        self.calls: list[ToolCall] = []

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._text += piece
        text = self._text
        if self._begin is None:
            self._begin = self.parser.begin(text)
        if self._begin is None:
            end = len(text) if final else len(text) - self.parser.held(text)
            return self._show(end), []
        shown = self._show(self._begin)
        calls, whole = self.parser.calls(text[self._begin :])
        new = calls[len(self.calls) :]
        if final and not (whole and calls) and not self.calls:  # never calls: all of it is text
            self._begin = len(text)
            return shown + self._show(len(text)), []
        self.calls += new
        return shown, new

    def _show(self, end: int) -> str:
        out = self._text[self._shown : max(end, self._shown)]
        self._shown = max(end, self._shown)
        return out
