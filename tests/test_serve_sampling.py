"""The server's sampling fields (issue 32), sent by the official ``openai`` client: ``n``,
``frequency_penalty``, ``presence_penalty``, ``logit_bias``, and vLLM's ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos`` and ``min_tokens`` (``extra_body``).

The oracle is :func:`portable_llm.generate` on the prompt alone with the same options (its
penalties are checked against a float64 loop in ``tests/test_sampling_fields.py``); bad values
are 400s naming the field, as OpenAI's and vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from conftest import skip_reason

if skip_reason("numpy") is not None:  # the server runs the model on NumPy
    pytest.skip(skip_reason("numpy"), allow_module_level=True)
pytest.importorskip("starlette", reason="the serve extra (starlette) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

import portable_llm as pl  # noqa: E402
from portable_llm.serve import create_app  # noqa: E402
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer  # noqa: E402
from test_serve import _health, _idle, serving  # noqa: E402

KEY = "test-key"
IDS = [5, 17, 42, 17, 99, 5, 3, 61]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pl.Model:
    folder = tmp_path_factory.mktemp("serve_sampling")
    cfg = tiny_config("llama", max_position_embeddings=256)
    write_checkpoint(folder, cfg, seed=11)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return pl.load(folder, backend="numpy", dtype="float32")


@pytest.fixture(scope="module")
def client(model: pl.Model) -> Iterator[Any]:
    app = create_app(model, model_name="tiny", api_key=KEY, max_batch=16, page_size=4)
    with serving(app) as url, openai.OpenAI(base_url=url + "/v1", api_key=KEY,
                                            max_retries=0) as c:  # fmt: skip
        yield c


def _alone(model: pl.Model, new: int, **options: Any) -> tuple[str, int, str]:
    """``generate``'s text for :data:`IDS`, the tokens it drew (a final stop token included)
    and its finish reason."""
    gen = pl.generate(model, IDS, max_new_tokens=new, repetition_context_size=None, **options)
    out = list(gen)
    reason = gen.stats.finish_reason
    return model.tokenizer.decode(out), len(out) + (reason == "stop"), str(reason)


def _complete(client: Any, **fields: Any) -> Any:
    return client.completions.create(model="tiny", prompt=IDS, temperature=0, **fields)


def test_n_greedy_choices_each_equal_generate(client, model):
    text, drawn, reason = _alone(model, 10)
    c = _complete(client, max_tokens=10, n=3)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    assert [(ch.text, ch.finish_reason) for ch in c.choices] == [(text, reason)] * 3
    assert c.usage.completion_tokens == 3 * drawn
    assert c.usage.total_tokens == len(IDS) + 3 * drawn


def test_n_chat_choices_with_a_penalty(client, model):
    messages = [{"role": "user", "content": "the river"}]
    ids = model.tokenizer.encode_prompt(
        model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    )
    want = model.tokenizer.decode(
        list(pl.generate(model, ids, max_new_tokens=8, frequency_penalty=1.0))
    )
    c = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                       temperature=0, n=2, frequency_penalty=1.0)  # fmt: skip
    assert [ch.message.content for ch in c.choices] == [want, want]


def test_n_streamed_choices_come_apart_by_index(client, model):
    text, drawn, reason = _alone(model, 9, presence_penalty=0.8)
    stream = _complete(client, max_tokens=9, n=4, presence_penalty=0.8, stream=True,
                       stream_options={"include_usage": True})  # fmt: skip
    texts, reasons, usage = [""] * 4, [None] * 4, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert texts == [text] * 4 and reasons == [reason] * 4
    assert usage is not None and usage.completion_tokens == 4 * drawn


def test_n_seeded_choices_differ_and_repeat(client):
    def ask() -> list[str]:
        c = client.completions.create(model="tiny", prompt=IDS, max_tokens=8, n=5,
                                      temperature=1.5, seed=7)  # fmt: skip
        return [ch.text for ch in c.choices]

    first = ask()
    assert len(set(first)) > 1  # five draws, not one copied
    assert ask() == first


@pytest.mark.parametrize(
    "fields",
    [
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"presence_penalty": -1.0, "extra_body": {"repetition_penalty": 4.0}},
        {"frequency_penalty": 0.4, "logit_bias": {"40": -100, "7": 2.5}},
    ],
)
def test_penalties_equal_generate_with_them(client, model, fields):
    options = {k: v for k, v in fields.items() if k not in ("extra_body", "logit_bias")}
    options |= fields.get("extra_body", {})
    if "logit_bias" in fields:
        options["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    text, drawn, reason = _alone(model, 12, **options)
    plain, _, _ = _alone(model, 12)
    c = _complete(client, max_tokens=12, **fields)
    assert (c.choices[0].text, c.usage.completion_tokens, c.choices[0].finish_reason) == (
        text, drawn, reason,
    )  # fmt: skip
    assert text != plain  # the penalties changed the answer


def test_logit_bias_of_100_forces_a_token(client, model):
    c = _complete(client, max_tokens=5, logit_bias={"61": 100})
    assert c.choices[0].text == model.tokenizer.decode([61] * 5)


def test_stop_token_ids_end_the_answer(client, model):
    free = list(pl.generate(model, IDS, max_new_tokens=10, stop=()))
    stop = free[3]
    cut = free[: free.index(stop)]
    c = _complete(client, max_tokens=10, extra_body={"stop_token_ids": [stop]})
    assert c.choices[0].finish_reason == "stop"
    assert c.choices[0].text == model.tokenizer.decode(cut)
    assert c.usage.completion_tokens == len(cut) + 1


def test_ignore_eos_and_min_tokens(client, model):
    eos = str(next(iter(model.eos_token_ids)))
    c = _complete(client, max_tokens=6, logit_bias={eos: 100})  # EOS at once
    assert (c.choices[0].text, c.choices[0].finish_reason) == ("", "stop")
    c = _complete(client, max_tokens=6, logit_bias={eos: 100}, extra_body={"ignore_eos": True})
    assert (c.usage.completion_tokens, c.choices[0].finish_reason) == (6, "length")
    c = _complete(client, max_tokens=6, logit_bias={eos: 100}, extra_body={"min_tokens": 3})
    text, drawn, reason = _alone(model, 6, logit_bias={int(eos): 100}, min_tokens=3)
    assert (c.choices[0].text, c.usage.completion_tokens, c.choices[0].finish_reason) == (
        text, drawn, reason,
    )  # fmt: skip
    assert (drawn, reason) == (4, "stop")  # three tokens, then the EOS


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": "a"}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"repetition_penalty": -1.0}}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"300": 1}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"extra_body": {"min_tokens": 9}}, "min_tokens"),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
        ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
        ({"extra_body": {"stop_token_ids": [300]}}, "stop_token_ids"),
        ({"extra_body": {"stop_token_ids": "5"}}, "stop_token_ids"),
        ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos"),
    ],
)
def test_out_of_range_values_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        _complete(client, max_tokens=8, **fields)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and param in body["message"]


def test_n_choices_with_logprobs_and_stop_strings(client, model):
    free = [ch.text for ch in client.completions.create(
        model="tiny", prompt=IDS, max_tokens=12, n=3, temperature=1.5, seed=3).choices]  # fmt: skip
    stop = next(ch for ch in free[0][2:] if ch.strip())  # a character choice 0 draws
    c = client.completions.create(model="tiny", prompt=IDS, max_tokens=12, n=3, temperature=1.5,
                                  seed=3, stop=[stop], logprobs=2)  # fmt: skip
    for ch in c.choices:
        assert stop not in ch.text
        assert len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) >= 1
        assert all(1 <= len(top) <= 2 for top in ch.logprobs.top_logprobs)  # pieces may repeat
    # choice 0 draws as before up to its stop string (the choices share the seeded sampler, so
    # the others draw differently once it left)
    assert c.choices[0].finish_reason == "stop"
    assert free[0].startswith(c.choices[0].text) and len(c.choices[0].text) < len(free[0])
    # a choice stopped by its string is dropped alone: the others ran on, and every page is back
    h = _idle(str(client.base_url).removesuffix("/v1/"))
    assert h["running"] == 0 and h["free_pages"] + h["cached_pages"] == h["pool_pages"]


def test_health_counts_a_request_of_n_once(client):
    url = str(client.base_url).removesuffix("/v1/")
    stream = _complete(client, max_tokens=200, n=4, stream=True)
    next(iter(stream))  # its four sequences decode
    assert _health(url)["running"] == 1
    stream.close()
    assert _idle(url)["running"] == 0


def test_n_streamed_chat_choices(client):
    messages = [{"role": "user", "content": "the river"}]
    ask = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "n": 2}
    whole = client.chat.completions.create(**ask)
    texts, roles, reasons = ["", ""], [None, None], [None, None]
    for chunk in client.chat.completions.create(**ask, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            roles[ch.index] = ch.delta.role or roles[ch.index]
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert texts == [c.message.content for c in whole.choices]
    assert roles == ["assistant"] * 2
    assert reasons == [c.finish_reason for c in whole.choices]
