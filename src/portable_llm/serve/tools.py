"""Tools and structured outputs in requests: ``tools``, ``tool_choice``, ``response_format``.

:func:`read_structure` checks the fields (every bad value an :class:`~portable_llm.serve.
protocol.APIError` naming it) and :meth:`Structure.grammar` gives what constrained decoding
must keep the answer inside: the ``response_format``'s JSON, or, with ``tool_choice``
``"required"`` or a named function, one well-formed call in the model's own tool-call format
(its :class:`~portable_llm.text.tool_calls.ToolParser`, chosen from the chat template).
:func:`template_message` turns an OpenAI message of the history (assistant ``tool_calls``, a
``tool`` result) into what chat templates read. :class:`ToolAnswer` splits the answer into its
text and its ``tool_calls``, whole or as stream deltas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from portable_llm.generation.grammar import Grammar, grammar_engine, response_format_grammar
from portable_llm.serve.protocol import APIError
from portable_llm.text.tool_calls import (
    TOOL_PARSERS,
    ToolCallStream,
    ToolParser,
    tool_parser_for,
)

__all__ = [
    "MAX_TOOLS",
    "Structure",
    "ToolAnswer",
    "answer_parser",
    "compile_grammar",
    "read_structure",
    "template_message",
    "template_messages",
]

#: The most tools one request may declare (OpenAI's limit).
MAX_TOOLS = 128


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class Structure:
    """A request's tools and output constraint, checked.

    ``tools``: the OpenAI tool objects to render (``None``: none, or ``tool_choice`` ``"none"``);
    ``choice``: ``"auto"``, ``"required"``, or the name of the function to call;
    ``response_format``: the ``json_object``/``json_schema`` object, or ``None``.
    """

    tools: list[dict[str, Any]] | None = None
    choice: str = "auto"
    response_format: Mapping[str, Any] | None = None

    @property
    def param(self) -> str:
        """The field whose grammar constrains the answer (named in its errors)."""
        return "tool_choice" if self.tools and self.choice != "auto" else "response_format"

    def grammar(self, parser: ToolParser | None) -> Grammar | None:
        """The grammar the answer must match (``None``: free text)."""
        if self.tools and self.choice != "auto":
            assert parser is not None
            tools = [t for t in self.tools if self.choice in ("required", t["function"]["name"])]
            return Grammar(parser.call_schema(tools), parser.prefix, parser.suffix)
        if self.response_format is not None:
            return response_format_grammar(self.response_format)
        return None


def read_structure(body: Mapping[str, Any], *, chat: bool) -> Structure:
    """``tools``, ``tool_choice`` (chat only) and ``response_format`` of a request body."""
    response_format = _response_format(body.get("response_format"))
    if not chat:
        for key in ("tools", "tool_choice"):
            if body.get(key) is not None:
                raise _bad(key, "only on /v1/chat/completions", "unsupported")
        return Structure(response_format=response_format)
    if body.get("functions") is not None:
        raise _bad("functions", "is deprecated: send tools", "unsupported")
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        choice = "auto"
    elif isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "expected {'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise _bad("tool_choice", f"names {name[:100]!r}, which is not among the tools")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", "expected 'none', 'auto', 'required' or a named function")
    elif choice == "required" and not tools:
        raise _bad("tool_choice", "'required' needs tools")
    if choice == "none" or not tools:
        return Structure(None, "auto", response_format)
    if choice != "auto" and response_format is not None:
        raise _bad("response_format", "not with tool_choice 'required' or a named function")
    return Structure(tools, choice, response_format)


def compile_grammar(model: Any, grammar: Grammar, stop: Any, structure: Structure) -> None:
    """Build the grammar engine and compile ``grammar`` for ``model`` now, off the engine
    thread (the first build reads the vocabulary: ~0.3-1 s for 50k ids), so the batch never
    waits on it and a schema the engine refuses is a 400 naming the field. ``stop``: the job's
    stop ids (``None``: the model's EOS ids, as the generator takes them)."""
    param = structure.param
    stops = model.eos_token_ids if stop is None else stop
    if not stops:
        raise _bad(param, "needs a stop token (not ignore_eos without stop_token_ids)")
    try:
        engine = grammar_engine(model.tokenizer, vocab_size=model.vocab_size, stop_ids=stops)
        engine.matcher(grammar)
    except ImportError as exc:
        raise _bad(param, f"needs a grammar engine on the server: {exc}", "unsupported") from None
    except ValueError as exc:
        raise _bad(param, str(exc)[:1000]) from None


def _response_format(value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    try:
        grammar = response_format_grammar(value)
    except (TypeError, ValueError) as exc:
        raise _bad("response_format", str(exc).removeprefix("response_format: ")) from None
    return None if grammar is None else value


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise _bad("tools", f"expected an array of at most {MAX_TOOLS} tools", "invalid_type")
    out, seen = [], set()
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(fn, Mapping)
        ):
            raise _bad(param, "expected {'type': 'function', 'function': {...}}", "invalid_type")
        name = fn.get("name")
        if not (isinstance(name, str) and 0 < len(name) <= 64) or name in seen:
            raise _bad(f"{param}.function.name", "expected a unique name of 1 to 64 characters")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise _bad(f"{param}.function.parameters", "expected a JSON schema object")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{param}.function.description", "expected a string", "invalid_type")
        function = {"name": name, "parameters": dict(params)}
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages of :func:`~portable_llm.serve.protocol.read_chat` as chat templates read
    them (:func:`template_message`)."""
    return [template_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def template_message(message: Mapping[str, Any], param: str) -> dict[str, Any]:
    """A message with the fields a chat template reads besides ``role`` and ``content``
    checked: an assistant's ``tool_calls`` (``arguments`` decoded to an object, as
    transformers' templates expect and vLLM passes them), a tool result's ``tool_call_id``
    and ``name``."""
    out: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise _bad(f"{param}.tool_calls", "an array, on assistant messages only")
        out["tool_calls"] = [_history_call(c, f"{param}.tool_calls[{j}]") for j, c in
                             enumerate(calls)]  # fmt: skip
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise _bad(f"{param}.{key}", "expected a string", "invalid_type")
            out[key] = value
    return out


def _history_call(call: Any, param: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise _bad(param, "expected {'type': 'function', 'function': {'name', 'arguments'}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise _bad(f"{param}.function.arguments", "is not JSON") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


class ToolAnswer:
    """One answer's text split into text and tool calls by ``parser`` (``None``: all text).

    ``whole(text)`` gives the message's ``content`` and ``tool_calls``; ``delta(piece)`` and
    ``delta("", final=True)`` give the stream's deltas, as the OpenAI API sends them: text as
    ``{"content": ...}``, each call as ``{"tool_calls": [{"index", "id", "type", "function":
    {"name", "arguments": ""}}]}`` then pieces of its arguments ``{"tool_calls": [{"index",
    "function": {"arguments": ...}}]}`` as they come
    (:class:`~portable_llm.text.tool_calls.ToolCallStream`). ``called`` once a call was found
    (``finish_reason`` then ``"tool_calls"``).
    """

    def __init__(self, parser: ToolParser | None) -> None:
        self.parser = parser
        self._stream = ToolCallStream(parser) if parser is not None else None
        self.called = False

    def whole(self, text: str) -> dict[str, Any]:
        if self.parser is None:
            return {"content": text}
        content, calls = self.parser.parse(text)
        self.called = bool(calls)
        if not calls:
            return {"content": text}
        return {"content": content, "tool_calls": [c.to_openai() for c in calls]}

    def delta(self, piece: str, *, final: bool = False) -> list[dict[str, Any]]:
        if self._stream is None:
            return [{"content": piece}] if piece else []
        text, calls = self._stream.feed(piece, final=final)
        out: list[dict[str, Any]] = [{"content": text}] if text else []
        out += [{"tool_calls": [delta.to_openai()]} for delta in calls]
        self.called = self.called or bool(calls)
        return out


def answer_parser(tokenizer: Any, structure: Structure) -> ToolParser | None:
    """The tool-call parser of the model's chat template when the request has tools (else
    ``None``); 400 naming ``tools`` when the template writes no format this server parses."""
    if not structure.tools:
        return None
    parser = tool_parser_for(tokenizer.chat_template if tokenizer is not None else None)
    if parser is None:
        raise _bad(
            "tools",
            "this model's chat template renders no tool-call format the server knows "
            f"(one of {sorted(TOOL_PARSERS)})",
            "unsupported",
        )
    if structure.choice != "auto" and not parser.constrainable:
        raise _bad(
            "tool_choice",
            f"only 'auto' or 'none' for this model: its tool calls ({parser.name}) are not "
            "JSON, so they cannot be constrained",
            "unsupported",
        )
    return parser
