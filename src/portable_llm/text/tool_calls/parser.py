"""The tool-call parser's contract (:class:`ToolParser`) and the registry of parsers by name,
from which :func:`tool_parser_for` picks the one a chat template writes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from portable_llm.text.tool_calls.calls import ToolCall

__all__ = ["TOOL_PARSERS", "ToolParser", "register_tool_parser", "tool_parser", "tool_parser_for"]


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
        """A whole answer as ``(content, calls)``: the complete calls from where they begin
        (what follows them is dropped, as a stream must: it sent them already), ``content`` the
        text before them (``None`` when empty); an answer without a complete call is all
        content."""
        at = self.begin(text)
        if at is None:
            return text, []
        calls, _ = self.calls(text[at:])
        if not calls:
            return text, []
        return (text[:at].strip() or None), calls


#: The parsers by name, in the order :func:`tool_parser_for` tries their markers.
TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(parser: type[ToolParser]) -> type[ToolParser]:
    """Register ``parser`` under its ``name`` (a later one of the same name replaces it);
    usable as a class decorator."""
    if not parser.name:
        raise ValueError("register_tool_parser: the parser class must set name")
    TOOL_PARSERS[parser.name] = parser
    return parser


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
