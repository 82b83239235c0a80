"""Tool-call parsers (:mod:`portable_llm.text.tool_calls`) on known text, the stream against the
whole answer at every split, the choice of parser from a chat template, and tool histories
rendered through a template as transformers renders them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from portable_llm.testing.checkpoints import CHAT_TEMPLATES, save_hf_tokenizer
from portable_llm.text.tool_calls import (
    TOOL_PARSERS,
    ToolCallStream,
    ToolParser,
    register_tool_parser,
    tool_parser,
    tool_parser_for,
)

WEATHER = {"city": "Paris", "days": 3}
# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", '
        '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',
        "Let me look.",
        [("weather", WEATHER), ("time", {})],
    ),
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    # a call that never closes, or is not JSON, is text: nothing is lost
    (
        "hermes",
        '<tool_call>\n{"name": "weather", "argu',
        '<tool_call>\n{"name": "weather", "argu',
        [],
    ),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "time", "arguments": {}}]',
        None,
        [("weather", WEATHER), ("time", {})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS]weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]time[ARGS]{}',
        "Sure.",
        [("weather", WEATHER), ("time", {})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "time", "parameters": {}}',
        None,
        [("weather", WEATHER), ("time", {})],
    ),
    ("llama3_json", '  {"name": "time", "parameters": {}}', None, [("time", {})]),
    # JSON that is not a call, or a call after text, is Llama 3's plain answer
    ("llama3_json", '{"answer": 4}', '{"answer": 4}', []),
    ("llama3_json", 'I would call {"name": "time", "parameters": {}}', None, []),
    (
        "pythonic",
        '<|python_start|>[weather(city="Paris", days=3), time()]<|python_end|>',
        None,
        [("weather", WEATHER), ("time", {})],
    ),
    ("pythonic", '[weather(city="Paris", days=3)]', None, [("weather", WEATHER)]),
    # not literals, positional arguments, not a list: plain text (nothing is evaluated)
    ("pythonic", "[weather(city=open('/etc/passwd'))]", None, []),
    ("pythonic", '[weather("Paris")]', None, []),
    ("pythonic", "[1, 2, 3]", None, []),
    ("pythonic", "Sure: [weather(days=3)]", None, []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parse(name: str, text: str, content: str | None, calls: list) -> None:
    """The calls, in order, with their arguments as JSON text; the text before them (all of it
    when there is no well-formed call)."""
    got_content, got = tool_parser(name).parse(text)
    assert got_content == (content if calls else text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)
    assert len({c.id for c in got}) == len(got)


def _joined(deltas: list) -> list[dict]:
    """The calls a client rebuilds from stream deltas (as the openai SDK accumulates them)."""
    out: dict[int, dict] = {}
    for d in deltas:
        call = out.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id is not None:
            assert call["id"] is None and d.arguments == ""  # one head per call, first
            call["id"], call["name"] = d.id, d.name
        call["arguments"] += d.arguments
    assert sorted(out) == list(range(len(out)))
    return [out[i] for i in sorted(out)]


@pytest.mark.parametrize("name, text, content, calls", CASES)
@given(data=st.data())
def test_stream_equals_whole(
    name: str, text: str, content: str | None, calls: list, data: st.DataObject
) -> None:
    """Fed in pieces split anywhere, the stream's deltas rebuild the whole answer's calls, in
    order, each ``arguments`` the same text, and its ids those of ``stream.calls``; its text is
    all of the answer without calls, the text before them with (up to trailing space)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ToolCallStream(tool_parser(name))
    shown, deltas = "", []
    for piece in pieces:
        t, d = stream.feed(piece)
        shown += t
        deltas += d
    t, d = stream.feed("", final=True)
    shown += t
    deltas += d
    joined = _joined(deltas)
    whole = tool_parser(name).parse(text)[1]
    assert [(c["name"], c["arguments"]) for c in joined] == [(c.name, c.arguments) for c in whole]
    assert [(c["name"], json.loads(c["arguments"])) for c in joined] == calls
    assert [c["id"] for c in joined] == [c.id for c in stream.calls]
    if calls:
        assert shown.strip() == (content or "")
    else:
        assert shown == text


def test_stream_sends_arguments_as_they_come() -> None:
    """A Hermes call goes out once its name and the ``{`` of its arguments are there, then its
    arguments piece by piece (a brace or quote inside a string does not end them), then the
    rest when the call closes; the model's own JSON text is the call's ``arguments``."""
    stream = ToolCallStream(tool_parser("hermes"))
    assert stream.feed("<tool_call>\n") == ("", [])
    assert stream.feed('{"name": "note", "arguments": ') == ("", [])
    text, (head, first) = stream.feed("{")
    assert text == "" and (head.index, head.name, head.arguments) == (0, "note", "")
    assert head.id is not None and head.id.startswith("call_")
    assert (first.index, first.id, first.arguments) == (0, None, "{")
    sent = ["{"]
    for piece in ['"text":', ' "a } \\" {', '"}', "}\n</tool", "_call>"]:
        text, deltas = stream.feed(piece)
        assert text == "" and all(d.id is None and d.index == 0 for d in deltas)
        sent += [d.arguments for d in deltas]
    assert sent[1:3] == ['"text":', ' "a } \\" {']  # each piece as it came
    assert "".join(sent) == '{"text": "a } \\" {"}' == stream.calls[0].arguments
    assert json.loads(stream.calls[0].arguments) == {"text": 'a } " {'}
    assert stream.calls[0].id == head.id


ARGS = '{"text": "a } \\" {", "n": [1, {"m": 2}]}'
STREAMED = [
    ("hermes", f'<tool_call>\n{{"name": "note", "arguments": {ARGS}}}\n</tool_call>'),
    ("llama3_json", f'{{"name": "note", "parameters": {ARGS}}}'),
    ("mistral", f'[TOOL_CALLS][{{"name": "note", "arguments": {ARGS}}}]'),
    ("mistral", f"[TOOL_CALLS]note[ARGS]{ARGS}"),
]


@pytest.mark.parametrize("name, text", STREAMED)
def test_every_json_format_streams_its_arguments(name: str, text: str) -> None:
    """Fed one character at a time, each JSON format sends the call's head as soon as the
    ``{`` of its arguments is there, then its arguments as they come (the model's own text)."""
    stream = ToolCallStream(tool_parser(name))
    deltas = []
    for i, ch in enumerate(text):
        _, d = stream.feed(ch)
        deltas += [(i, x) for x in d]
    deltas += [(len(text), x) for x in stream.feed("", final=True)[1]]
    head_at = next(i for i, d in deltas if d.id is not None)
    assert head_at == text.index(ARGS)  # the arguments' "{"
    pieces = [d.arguments for _, d in deltas if d.id is None]
    assert "".join(pieces) == ARGS == stream.calls[0].arguments
    assert len(pieces) > len(ARGS) // 2  # piece by piece, not at the end


#: Pieces of every format, glued at random into answers well-formed or not.
PIECES = [
    "<tool_call>", "</tool_call>", "\n", " ", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
    "<|python_start|>", "[", "]", "{", "}", ",", ";", ":", '"name"', '"arguments"',
    '"parameters"', '"f"', '"x\\"}"', "1", "f(a=1)", "note", "hi", '{"a": [1, {"b": "}"}]}',
    '{"name": "f", "arguments": {"k": "v"}}', '{"name": "g", "parameters": {}}',
]  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@given(data=st.data())
def test_any_text_parses_and_streams_alike(name: str, data: st.DataObject) -> None:
    """Property: on any text (garbage included) the parser and the stream never raise, and a
    stream that was not cut inside a call it had begun sending ends with exactly the calls of
    the whole parse (names and arguments text)."""
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=24)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    content, whole = tool_parser(name).parse(text)
    stream = ToolCallStream(tool_parser(name))
    deltas = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        deltas += stream.feed(text[a:b])[1]
    open_at_end = stream._open is not None
    deltas += stream.feed("", final=True)[1]
    if not open_at_end:
        assert [(c.name, c.arguments) for c in stream.calls] == [
            (c.name, c.arguments) for c in whole
        ]
    assert [c.id for c in stream.calls] == [c["id"] for c in _joined(deltas)][: len(stream.calls)]
    if not whole:
        assert content == text


def test_stream_holds_back_what_may_begin_a_call() -> None:
    stream = ToolCallStream(tool_parser("hermes"))
    assert stream.feed("Hi <tool") == ("Hi ", [])
    assert stream.feed("bar>") == ("<toolbar>", [])


def test_choice_from_template() -> None:
    assert isinstance(tool_parser_for(CHAT_TEMPLATES["chatml"]), TOOL_PARSERS["hermes"])
    mistral = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[TOOL_CALLS]"
    assert isinstance(tool_parser_for(mistral), TOOL_PARSERS["mistral"])
    llama = "{{- '<|python_tag|>' + tool_call.name }}"
    assert isinstance(tool_parser_for(llama), TOOL_PARSERS["llama3_json"])
    llama4 = "put it in the format of [func_name1(params_name1=params_value1), func_name2(...)]"
    assert isinstance(tool_parser_for(llama4), TOOL_PARSERS["pythonic"])
    assert tool_parser_for(CHAT_TEMPLATES["loops"]) is None
    assert tool_parser_for(None) is None


def test_registry() -> None:
    with pytest.raises(ValueError, match="name must be one of"):
        tool_parser("nope")

    class Pythonic(ToolParser):
        name = "test_pythonic"
        markers = ("[TEST_CALL",)

    try:
        register_tool_parser(Pythonic)
        assert isinstance(tool_parser_for("... [TEST_CALL ..."), Pythonic)
    finally:
        TOOL_PARSERS.pop("test_pythonic")
    with pytest.raises(ValueError, match="must set name"):
        register_tool_parser(ToolParser)


@pytest.mark.parametrize("name", sorted(n for n, p in TOOL_PARSERS.items() if p.constrainable))
def test_call_schema_names_the_tools(name: str) -> None:
    """One call's schema pins the name and takes the tool's parameters as its arguments."""
    jsonschema = pytest.importorskip("jsonschema")
    parser = tool_parser(name)
    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": n, "parameters": params}} for n in "fg"]
    schema = parser.call_schema(tools)
    key = parser.arguments_key
    jsonschema.validate({"name": "g", key: {"x": 1}}, schema)
    for bad in ({"name": "h", key: {"x": 1}}, {"name": "f", key: {}}, {"name": "f"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_tool_history_renders_as_transformers(tmp_path) -> None:
    """``tools``, an assistant's ``tool_calls`` (arguments as an object, as the server passes
    them) and a ``tool`` result render as transformers' ``apply_chat_template`` renders them."""
    pytest.importorskip("transformers")
    import portable_llm as pl
    from portable_llm.checkpoint.tokenizer import read_tokenizer

    hf = save_hf_tokenizer(tmp_path, vocab_size=300, chat_template=CHAT_TEMPLATES["chatml"])
    tok = read_tokenizer(tmp_path)
    assert isinstance(tok, pl.Tokenizer)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    call = {"type": "function", "function": {"name": "weather", "arguments": WEATHER}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                    tokenize=False)  # fmt: skip
    assert ours == theirs
    assert '"arguments": {"city": "Paris", "days": 3}' in ours and '"name": "weather"' in ours
