"""Constrained decoding (:mod:`portable_llm.generation.grammar`) and tool calls in the server.

A random tiny model writes garbage, which is where the grammar must still hold: every answer
under a schema parses and validates (``jsonschema``), greedy or sampled, alone or in a batch
beside unconstrained requests (which keep the tokens they get without a neighbour's mask), in
:func:`portable_llm.generate`, :class:`~portable_llm.BatchGenerator` and the server driven by
the official ``openai`` client (tools with ``tool_choice`` ``"required"`` or named, the tool
result fed back, streamed ``tool_calls`` deltas, ``json_schema`` on both endpoints).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings

from conftest import skip_reason

if skip_reason("numpy") is not None:
    pytest.skip(skip_reason("numpy"), allow_module_level=True)
pytest.importorskip("llguidance", reason="the grammar engine (the serve extra) is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the test extra)")

import portable_llm as pl  # noqa: E402
from portable_llm.generation import BatchGenerator, Request  # noqa: E402
from portable_llm.generation.grammar import (  # noqa: E402
    ENGINES,
    Grammar,
    grammar_engine,
    response_format_grammar,
)
from portable_llm.testing.checkpoints import (  # noqa: E402
    CHAT_TEMPLATES,
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)
from portable_llm.testing.strategies import json_schemas, seeds  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name}",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("weather", "forecast")
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pl.Model:
    folder = tmp_path_factory.mktemp("structured")
    cfg = tiny_config("llama", max_position_embeddings=2048)  # tools make long prompts
    write_checkpoint(folder, cfg, seed=11)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATES["chatml"]  # renders tools; Hermes' <tool_call>
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return pl.load(folder, backend="numpy", dtype="float32")


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 0), (1.0, 1), (1.5, 2)])
def test_generate_json_schema_validates(model: pl.Model, temperature: float, seed: Any) -> None:
    gen = pl.generate(model, "hello there", max_new_tokens=200, response_format=FORMAT,
                      temperature=temperature, seed=seed)  # fmt: skip
    text = "".join(gen)
    assert gen.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert json.dumps(json.loads(text), ensure_ascii=False) == text  # compact, json.dumps' form


def test_generate_json_object(model: pl.Model) -> None:
    gen = pl.generate(
        model, "hello there", max_new_tokens=50, response_format={"type": "json_object"}
    )
    text = "".join(gen)
    assert gen.stats.finish_reason == "stop" and isinstance(json.loads(text), dict)


def test_generate_text_batch(model: pl.Model) -> None:
    """Each prompt of a batch keeps to the grammar with its own matcher."""
    pieces = list(pl.generate(model, ["hello", "a much longer prompt here"],
                              max_new_tokens=200, response_format=FORMAT))  # fmt: skip
    for b in range(2):
        jsonschema.validate(json.loads("".join(p[b] for p in pieces)), SCHEMA)


def test_batch_generator_mixed(model: pl.Model) -> None:
    """Constrained and free requests in one batch: the constrained ones validate, the free
    ones get exactly what they get alone (no neighbour's mask leaks into their row)."""
    ids = model.tokenizer.encode("hello there")
    alone = list(pl.generate(model, ids, max_new_tokens=30, temperature=0.0))
    gen = BatchGenerator(model, max_batch=6)
    formats = [FORMAT, None, FORMAT, None, {"type": "json_object"}, FORMAT]
    samplers = [pl.make_sampler(temperature=1.0, seed=i) if i % 3 == 2 else None for i in range(6)]
    rids = [gen.add(Request(ids, 200 if f else 30, samplers[i], response_format=f))
            for i, f in enumerate(formats)]  # fmt: skip
    out: dict[int, list[int]] = {rid: [] for rid in rids}
    reasons = {}
    while gen.has_work:
        for rid, token, reason in gen.step():
            if reason != "stop":
                out[rid].append(token)
            if reason is not None:
                reasons[rid] = reason
    for rid, f in zip(rids, formats, strict=True):
        if f is None:
            assert out[rid][: len(alone)] == alone
            continue
        assert reasons[rid] == "stop"
        value = json.loads(model.tokenizer.decode(out[rid]))
        if f is FORMAT:
            jsonschema.validate(value, SCHEMA)


def test_bad_response_format(model: pl.Model) -> None:
    with pytest.raises(ValueError, match="response_format: type must be"):
        pl.generate(model, "a", response_format={"type": "yaml"})
    with pytest.raises(TypeError, match=r"json_schema\.schema must be an object"):
        pl.generate(model, "a", response_format={"type": "json_schema",
                                                 "json_schema": {"schema": 3}})  # fmt: skip
    with pytest.raises(ValueError, match="needs a stop token"):
        pl.generate(model, "a", response_format=FORMAT, stop=())
    with pytest.raises(ValueError, match="response_format needs a stop token"):
        BatchGenerator(model).add(Request([3, 4], 5, response_format=FORMAT, stop=()))
    assert response_format_grammar({"type": "text"}) is None
    unsupported = {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}
    with pytest.raises(ValueError, match=r"is not supported by llguidance: .*\bnot\b"):
        pl.generate(model, "a", response_format=unsupported)


def _walk(model: pl.Model, schema: dict, seed: int) -> str:
    """A random path through the mask (ids drawn among the allowed ones, seeded) up to a stop
    token, as text; fails when the mask runs dry or no stop comes in 2000 steps."""
    import numpy as np

    engine = grammar_engine(model.tokenizer, vocab_size=model.vocab_size, stop_ids=[2])
    m, ids, rng = engine.matcher(Grammar(schema)), [], np.random.default_rng(seed)
    for _ in range(2000):
        allowed = np.flatnonzero(m.allowed())
        assert allowed.size > 0
        token = int(rng.choice(allowed))
        if token == 2:
            return str(model.tokenizer.decode(ids))
        m.accept(token)
        ids.append(token)
    pytest.fail("no stop token in 2000 steps")


@settings(max_examples=40, deadline=None)
@given(schema=json_schemas(), seed=seeds())
def test_every_walk_validates(model: pl.Model, schema: dict, seed: int) -> None:
    """Property: any path through the mask that reaches a stop token is JSON valid under the
    schema, and the mask never runs dry."""
    jsonschema.validate(json.loads(_walk(model, schema, seed)), schema)


#: An OpenAI strict-mode schema: $defs and $ref, anyOf, a nullable type, nested arrays.
STRICT = {
    "type": "object",
    "properties": {
        "steps": {"type": "array", "items": {"$ref": "#/$defs/step"}, "maxItems": 2},
        "final": {"type": ["string", "null"], "maxLength": 5},
    },
    "required": ["steps", "final"],
    "additionalProperties": False,
    "$defs": {
        "step": {
            "type": "object",
            "properties": {
                "explanation": {"type": "string", "maxLength": 4},
                "output": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                     {"type": "boolean"}]},
            },
            "required": ["explanation", "output"],
            "additionalProperties": False,
        }
    },
}  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_strict_schema_walks_validate(model: pl.Model, seed: int) -> None:
    jsonschema.validate(json.loads(_walk(model, STRICT, seed)), STRICT)


@settings(max_examples=6, deadline=None)
@given(schema=json_schemas(), seed=seeds())
def test_generate_validates(model: pl.Model, schema: dict, seed: int) -> None:
    """Property: the model's sampled answer under any schema stops and validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    gen = pl.generate(model, "hi", max_new_tokens=600, response_format=fmt, temperature=1.0,
                      seed=seed % 2**32)  # fmt: skip
    text = "".join(gen)
    assert gen.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_engines_agree_on_the_language(model: pl.Model, name: str) -> None:
    """Each installed engine (xgrammar is optional) keeps a seeded random walk in the grammar,
    with a prefix and a suffix around the JSON."""
    import numpy as np

    try:
        engine = grammar_engine(model.tokenizer, vocab_size=model.vocab_size, stop_ids=[2],
                                name=name)  # fmt: skip
    except ImportError:
        pytest.skip(f"{name} is not installed")
    if name == "xgrammar":  # benchmarks/README.md: measured, not chosen
        pytest.xfail("xgrammar 0.2.8 lets raw control characters into JSON strings")
    grammar = Grammar(SCHEMA, prefix="<tool_call>\n", suffix="\n</tool_call>")
    rng = np.random.default_rng(0)
    for _ in range(3):
        m, ids = engine.matcher(grammar), []
        for _ in range(400):
            token = int(rng.choice(np.flatnonzero(m.allowed())))
            if token == 2:
                break
            m.accept(token)
            ids.append(token)
        text = model.tokenizer.decode(ids)
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        jsonschema.validate(json.loads(text[len("<tool_call>\n") : -len("\n</tool_call>")]), SCHEMA)
        with pytest.raises(ValueError, match="does not allow"):
            engine.matcher(grammar).accept(
                int(np.flatnonzero(~engine.matcher(grammar).allowed())[0])
            )


# -- the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(model: pl.Model) -> Iterator[Any]:
    pytest.importorskip("starlette")
    openai = pytest.importorskip("openai")
    from portable_llm.serve import create_app
    from test_serve import serving

    app = create_app(model, model_name="tiny")
    with serving(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="none") as c:
        yield c


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_call(call: Any, names: tuple[str, ...]) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    return args


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_required_round_trip(client: Any, temperature: float) -> None:
    """``required``: a well-formed call to one of the tools; its result goes back as a ``tool``
    message beside the assistant's ``tool_calls``, rendered by the model's template."""
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=400,
                                       temperature=temperature, seed=5)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid_call(call, ("weather", "forecast"))
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                        max_tokens=3, temperature=0)  # fmt: skip
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result rendered
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_tool_choice_streamed(client: Any) -> None:
    """A named function, streamed: the deltas as OpenAI sends them (the call's id, type and
    name first, then its arguments in pieces as the tokens come), joined into a valid call;
    finish_reason tool_calls."""
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, temperature=0.8, seed=1,
        tool_choice={"type": "function", "function": {"name": "forecast"}}, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    reasons, pieces = [], 0
    for chunk in stream:
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
            if delta.id:
                assert call["id"] is None and delta.type == "function"
                call["id"] = delta.id
            if delta.function.name:
                call["name"] += delta.function.name
            call["arguments"] += delta.function.arguments or ""
            pieces += bool(delta.function.arguments)
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert pieces > 3  # the arguments came as they were generated, not in one piece
    assert list(calls) == [0] and calls[0]["name"] == "forecast"
    assert calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[0]["function"]["parameters"])


def test_auto_tool_choice_garbage_is_text(client: Any) -> None:
    """``auto`` on a random model: no call in the text, so it is content, finish as usual."""
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=8,
                                       temperature=0)  # fmt: skip
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_none_renders_no_tools(client: Any) -> None:
    """``none``: the tools are not rendered (the prompt is the one without them, the answer
    too) and nothing is parsed as a call; ``auto`` renders them."""
    ask = {"model": "tiny", "messages": ASK, "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**ask)
    none = client.chat.completions.create(**ask, tools=TOOLS, tool_choice="none")
    auto = client.chat.completions.create(**ask, tools=TOOLS, tool_choice="auto")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == plain.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_chat(client: Any, stream: bool) -> None:
    options = {"model": "tiny", "messages": ASK, "response_format": FORMAT, "max_tokens": 300,
               "temperature": 1.0, "seed": 3}  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**options, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**options)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_completions(client: Any) -> None:
    r = client.completions.create(model="tiny", prompt="Name:", max_tokens=300, temperature=0,
                                  extra_body={"response_format": FORMAT})  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


BAD = [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
        "response_format",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ({"functions": [{"name": "f"}]}, "functions"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize("fields, param", BAD)
def test_bad_fields(client: Any, fields: dict, param: str) -> None:
    import openai

    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.body["param"] == param, err.value.body


def test_pythonic_tools_are_auto_only(tmp_path: Any) -> None:
    """A template whose calls are Python (Llama 4's): ``auto`` works, a forced call is a 400
    naming ``tool_choice`` (no JSON grammar can force it)."""
    pytest.importorskip("starlette")
    openai = pytest.importorskip("openai")
    from portable_llm.serve import create_app
    from test_serve import serving

    cfg = tiny_config("llama", max_position_embeddings=2048)
    write_checkpoint(tmp_path, cfg, seed=1)
    write_tokenizer(tmp_path, vocab_size=cfg["vocab_size"])
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}Call them as [func_name1(params_name1=params_value1)]{% endif %}"
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    m = pl.load(tmp_path, backend="numpy", dtype="float32")
    with serving(create_app(m, model_name="t")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="t", messages=ASK, tools=TOOLS, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError, match="cannot be constrained") as err:
            c.chat.completions.create(
                model="t", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=2
            )
        assert err.value.body["param"] == "tool_choice"


def test_tools_without_a_template_format(tmp_path: Any) -> None:
    """A chat template that writes no tool-call format: ``tools`` is a 400 naming it."""
    pytest.importorskip("starlette")
    openai = pytest.importorskip("openai")
    from portable_llm.serve import create_app
    from test_serve import serving

    cfg = tiny_config("llama", max_position_embeddings=256)
    write_checkpoint(tmp_path, cfg, seed=1)
    write_tokenizer(tmp_path, vocab_size=cfg["vocab_size"])  # a template without tools
    m = pl.load(tmp_path, backend="numpy", dtype="float32")
    with serving(create_app(m, model_name="t")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no tool-call format"):
            c.chat.completions.create(model="t", messages=ASK, tools=TOOLS, max_tokens=2)


def test_special_token_prefix_is_that_token(model: pl.Model) -> None:
    """A prefix that is a special token's text (Mistral's ``[TOOL_CALLS]``; here ``<s>``) is
    generated as that token, which the matcher then accepts (llguidance reads a literal as
    plain bytes: its mask offered the token and consuming it failed)."""
    import numpy as np

    engine = grammar_engine(model.tokenizer, vocab_size=model.vocab_size, stop_ids=[2])
    m = engine.matcher(Grammar({"type": "object"}, prefix="<s>[", suffix="]"))
    assert np.flatnonzero(m.allowed()).tolist() == [model.tokenizer.token_id("<s>")]
    m.accept(model.tokenizer.token_id("<s>"))
    assert m.allowed()[model.tokenizer.encode("[", add_special_tokens=False)[0]]


def test_unsupported_schema_is_400(client: Any) -> None:
    """A schema keyword the engine does not implement is refused, never silently dropped (an
    answer that would not validate)."""
    import openai

    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}}
    with pytest.raises(openai.BadRequestError, match="is not supported by llguidance") as err:
        client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt)
    assert err.value.body["param"] == "response_format"
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]
    with pytest.raises(openai.BadRequestError, match="is not supported by llguidance") as err:
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=odd, tool_choice="required"
        )
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="needs a stop token") as err:
        client.chat.completions.create(
            model="tiny", messages=ASK, response_format=FORMAT, extra_body={"ignore_eos": True}
        )
    assert err.value.body["param"] == "response_format"


def test_mistral_calls_through_a_special_token(tmp_path: Any) -> None:
    """Mistral's format, whose ``[TOOL_CALLS]`` is a special token: a forced call is generated
    as that token then the JSON array, kept in the text (decoded with special tokens), parsed
    back into a valid call, whole and streamed."""
    pytest.importorskip("starlette")
    openai = pytest.importorskip("openai")
    from tokenizers import Tokenizer as RustTokenizer

    from portable_llm.serve import create_app
    from test_serve import serving

    cfg = tiny_config("llama", max_position_embeddings=2048)
    write_checkpoint(tmp_path, cfg, seed=2)
    write_tokenizer(tmp_path, vocab_size=cfg["vocab_size"] - 1)
    tok = RustTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens(["[TOOL_CALLS]"])
    assert tok.get_vocab_size() <= cfg["vocab_size"]
    tok.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS] "
        "Answer with [TOOL_CALLS] and a JSON array{% endif %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    m = pl.load(tmp_path, backend="numpy", dtype="float32")
    special = m.tokenizer.token_id("[TOOL_CALLS]")
    with serving(create_app(m, model_name="t")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        ask = {"model": "t", "messages": ASK, "tools": TOOLS, "max_tokens": 400,
               "tool_choice": "required", "temperature": 0}  # fmt: skip
        r = c.chat.completions.create(**ask, logprobs=True)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].logprobs.content[0].token == "[TOOL_CALLS]"  # the token itself
        (call,) = r.choices[0].message.tool_calls
        whole = _valid_call(call, ("weather", "forecast"))
        chunks = list(c.chat.completions.create(**ask, stream=True))
        deltas = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == call.function.name
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == whole
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert special is not None
