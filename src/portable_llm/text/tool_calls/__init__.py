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

from portable_llm.text.tool_calls import formats  # noqa: F401 (registers the formats)
from portable_llm.text.tool_calls.calls import ToolCall, ToolCallDelta
from portable_llm.text.tool_calls.parser import (
    TOOL_PARSERS,
    ToolParser,
    register_tool_parser,
    tool_parser,
    tool_parser_for,
)
from portable_llm.text.tool_calls.stream import ToolCallStream

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
