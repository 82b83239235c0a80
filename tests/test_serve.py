"""``portable-llm serve``: the OpenAI-compatible server, driven by the official ``openai`` client.

The server runs in this process (uvicorn in a thread, on 127.0.0.1 and a free port) over a tiny
random checkpoint. The oracle is :func:`portable_llm.generate` on each prompt alone: greedy
requests, alone or 32 at once in one batch, get exactly its text; seeded ones its draws. The
engine's counters and ``/health`` show the batching (more than one request per step), the
cancellations and the pages coming back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from conftest import skip_reason

if skip_reason("numpy") is not None:  # the server runs the model on NumPy
    pytest.skip(skip_reason("numpy"), allow_module_level=True)
pytest.importorskip("starlette", reason="the serve extra (starlette) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
httpx = pytest.importorskip("httpx2", reason="the openai client's HTTP library")

import portable_llm as pl  # noqa: E402
from portable_llm.serve import create_app  # noqa: E402
from portable_llm.testing import tolerance  # noqa: E402
from portable_llm.testing.checkpoints import (  # noqa: E402
    SENTENCES,
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)
from servers import alone as _alone  # noqa: E402
from servers import chat_ids as _chat_ids  # noqa: E402
from servers import serving  # noqa: E402

KEY = "test-key"
JSON = {"Content-Type": "application/json"}
POOL = 256
CONTEXT = 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pl.Model:
    folder = tmp_path_factory.mktemp("serve")
    cfg = tiny_config("llama", max_position_embeddings=CONTEXT)
    write_checkpoint(folder, cfg, seed=11)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return pl.load(folder, backend="numpy", dtype="float32")


@pytest.fixture(scope="module")
def server(model: pl.Model) -> Iterator[tuple[str, Any]]:
    app = create_app(
        model, model_name="tiny", aliases=("tiny-alias",), api_key=KEY, max_batch=32,
        pool_pages=POOL, max_queue=64, prefill_chunk=256,
    )  # fmt: skip
    with serving(app) as url:
        yield url, app


@pytest.fixture
def client(server: tuple[str, Any]) -> Iterator[Any]:
    with openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def _health(url: str) -> dict:
    return httpx.get(url + "/health").json()


def _idle(url: str, timeout: float = 10.0) -> dict:
    """``/health`` once nothing runs or waits (pages of finished requests come back)."""
    deadline = time.monotonic() + timeout
    while True:
        h = _health(url)
        if (h["running"], h["queue_depth"]) == (0, 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.02)


# -- endpoints ----------------------------------------------------------------------------------


def test_models_and_health(server: tuple[str, Any], client: Any) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = httpx.get(server[0] + "/health")  # open without the key
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok"
    assert {"running", "queue_depth", "free_pages", "cached_pages"} <= set(body)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_generate(model: pl.Model, client: Any, stream: bool) -> None:
    prompt = "Rotary embeddings turn queries"
    ids = model.tokenizer.encode_prompt(prompt)
    want, drawn = _alone(model, ids, 12)
    args = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    if not stream:
        r = client.completions.create(**args)
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    else:
        chunks = list(
            client.completions.create(**args, stream=True, stream_options={"include_usage": True})
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and
                      c.choices[0].finish_reason)  # fmt: skip
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert text == want
    assert finish == ("length" if drawn == 12 else "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), drawn)
    assert usage.total_tokens == len(ids) + drawn


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equal_generate(model: pl.Model, client: Any, stream: bool) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What does the cache keep?"},
    ]
    ids = _chat_ids(model, messages)
    want, drawn = _alone(model, ids, 10)
    args = {"model": "tiny-alias", "messages": messages, "max_completion_tokens": 10,
            "temperature": 0}  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**args)
        assert r.choices[0].message.role == "assistant"
        text, usage = r.choices[0].message.content, r.usage
    else:
        chunks = list(
            client.chat.completions.create(
                **args, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    assert text == want
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), drawn)


def test_stop_strings_across_tokens(model: pl.Model, client: Any) -> None:
    """A stop string that starts inside one token and ends in the next: the text ends just
    before it, streamed or not, and no chunk shows any of it."""
    ids = model.tokenizer.encode_prompt("A mixture of experts sends")
    new = list(pl.generate(model, ids, max_new_tokens=24))
    tok = model.tokenizer
    full = tok.decode(new)
    ends = [len(tok.decode(new[:k])) for k in range(len(new) + 1)]
    k = next(
        k for k in range(1, len(new) - 1)
        if ends[k] - ends[k - 1] >= 2 and ends[k + 1] > ends[k]
        and full[: ends[k]] == tok.decode(new[:k])
    )  # fmt: skip
    stop = full[ends[k] - 1 : ends[k] + 1]  # the last character of token k, the first of k + 1
    want = full[: full.index(stop)]
    args = {"model": "tiny", "prompt": ids, "max_tokens": 24, "temperature": 0,
            "stop": ["never-there", stop]}  # fmt: skip
    r = client.completions.create(**args)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    assert "".join(c.text for c in chunks) == want
    assert chunks[-1].finish_reason == "stop"
    assert all(stop not in c.text for c in chunks)


def test_seeds_reproducible(model: pl.Model, client: Any) -> None:
    """A seeded request draws what ``generate`` draws with that seed, every time."""
    ids = model.tokenizer.encode_prompt("The cache keeps")
    args = {"model": "tiny", "prompt": ids, "max_tokens": 10, "temperature": 0.9,
            "top_p": 0.95}  # fmt: skip
    a = client.completions.create(**args, seed=1234).choices[0].text
    b = client.completions.create(**args, seed=1234).choices[0].text
    c = client.completions.create(**args, seed=99).choices[0].text
    want, _ = _alone(model, ids, 10, temperature=0.9, top_p=0.95, seed=1234)
    assert a == b == want
    assert c != a


def test_logprobs(model: pl.Model, client: Any) -> None:
    """The first token's log-probability and top 3 are those of the model's logits (float64
    log-softmax of a direct forward); later ones are sorted and at most 0."""
    messages = [{"role": "user", "content": "Grouped-query attention"}]
    ids = _chat_ids(model, messages)
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    logits = pl.to_numpy(model(np.asarray([ids])))[0, -1].astype(np.float64)  # (V,)
    ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    order = np.argsort(-ref, kind="stable")[:3]
    tol = tolerance("float32")
    got = [t.logprob for t in content[0].top_logprobs]
    np.testing.assert_allclose(got, ref[order], rtol=tol.rtol, atol=tol.atol)
    assert content[0].logprob == pytest.approx(ref[order[0]], rel=tol.rtol, abs=tol.atol)
    for item in content:
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True) and max(values) <= 0
        assert item.logprob == pytest.approx(values[0])  # greedy: the most likely
    c = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                  logprobs=2)  # fmt: skip
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
    assert lp.token_logprobs[0] == pytest.approx(content[0].logprob, rel=tol.rtol, abs=tol.atol)


# -- one batch for every client -----------------------------------------------------------------


def test_32_concurrent_streams(model: pl.Model, server: tuple[str, Any]) -> None:
    """32 streaming clients at once: each gets exactly the text ``generate`` gives its prompt
    alone (nothing lost, nothing mixed), and steps decoded several requests together."""
    url, app = server
    engine = app.state.engine
    rng = np.random.default_rng(5)
    prompts = [[int(i) for i in rng.integers(3, 300, size=int(n))]
               for n in rng.integers(2, 40, size=32)]  # fmt: skip
    lengths = [int(n) for n in rng.integers(4, 17, size=32)]
    wants = [_alone(model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    engine.max_decoded = 0

    async def one(prompt: list[int], n: int) -> tuple[str, int]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as c:
            stream = await c.completions.create(
                model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            text, usage = [], None
            async for chunk in stream:
                text += [ch.text for ch in chunk.choices]
                usage = chunk.usage or usage
            return "".join(text), usage.completion_tokens

    async def all_() -> list[tuple[str, int]]:
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))

    got = asyncio.run(all_())
    assert got == wants
    assert engine.max_decoded > 1


def test_disconnect_gives_pages_back(server: tuple[str, Any], client: Any) -> None:
    url, app = server
    engine = app.state.engine
    before = engine.cancelled
    stream = client.completions.create(
        model="tiny", prompt=list(range(5, 40)), max_tokens=900, temperature=0, stream=True
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while engine.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.cancelled == before + 1
    h = _idle(url)
    assert h["running"] == 0
    assert h["free_pages"] + h["cached_pages"] == POOL  # every page is free, or an idle prefix


# -- errors -------------------------------------------------------------------------------------


BAD: list[tuple[str, Any, int, str | None]] = [
    # (path, body (bytes: raw), status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": 3}]},
        400,
        "messages[0].content",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "top_k": 1.5}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "min_p": -1}, 400, "min_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": "x" * 600}, 400, "stop"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, None),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
        400,
        "temperature",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": list(range(3, 300)) * 4}, 400, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": CONTEXT}, 400, "max_tokens"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "a", "stream_options": {}},
        400,
        "stream_options",
    ),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_input(
    server: tuple[str, Any], client: Any, path: str, body: Any, status: int, param: str | None
) -> None:
    """Each bad request gets its status and an OpenAI error body (all four keys, no traceback);
    then a good request succeeds."""
    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    if isinstance(body, bytes):
        r = httpx.post(url + path, content=body, headers=auth | JSON)
    else:
        r = httpx.post(url + path, json=body, headers=auth)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert "Traceback" not in error["message"] and len(error["message"]) < 2000
    ok = client.completions.create(model="tiny", prompt="a", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_auth_and_methods(server: tuple[str, Any], client: Any) -> None:
    url, _ = server
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    r = httpx.get(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                       n=0)  # fmt: skip
    assert client.completions.create(model="tiny", prompt="a", max_tokens=1).usage is not None


def test_queue_full_answers_429(model: pl.Model) -> None:
    """With one request running and ``max_queue=1`` waiting, the next ones get 429 with
    ``Retry-After``; the server then serves again."""
    app = create_app(model, model_name="tiny", max_batch=1, max_queue=1, pool_pages=128)
    with serving(app) as url:

        async def one(c: Any) -> int:
            try:
                await c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=60,
                                           temperature=0)  # fmt: skip
            except openai.RateLimitError as exc:
                assert exc.response.headers.get("retry-after") == "1"
                assert exc.body["code"] == "rate_limit_exceeded"
                return 429
            return 200

        async def burst() -> list[int]:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
                return await asyncio.gather(*(one(c) for _ in range(6)))

        codes = asyncio.run(burst())
        assert 429 in codes and 200 in codes
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            assert c.completions.create(model="tiny", prompt="a", max_tokens=2).choices


def test_generation_failure_keeps_serving(
    server: tuple[str, Any], client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that raises mid-batch: its requests get 500 (an OpenAI error body), every page
    comes back, and the next request is served."""
    url, app = server
    gen = app.state.engine.generator
    forward = gen._forward
    calls = []

    def boom(*args: Any, **kwargs: Any) -> Any:
        if not calls:
            calls.append(1)
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(gen, "_forward", boom)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="tiny", prompt="a", max_tokens=4)
    assert info.value.body["type"] == "server_error"
    h = _idle(url)
    assert h["free_pages"] + h["cached_pages"] == POOL
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices


# -- prefix caching -----------------------------------------------------------------------------


def test_prefix_cache(model: pl.Model, server: tuple[str, Any], client: Any) -> None:
    """A second request sharing a long system prompt takes it from the cache: cached tokens in
    its usage, fewer tokens and less time in its prefill, and the text of ``generate`` alone."""

    def system(i: int) -> str:
        return f"Rule {i}. " + " ".join(SENTENCES * 3)

    def ask(sys_text: str, question: str) -> Any:
        messages = [{"role": "system", "content": sys_text},
                    {"role": "user", "content": question}]  # fmt: skip
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                           temperature=0)  # fmt: skip
        return messages, r

    cold = [ask(system(i), "First question?") for i in range(3)]  # each system prompt is new
    warm = [ask(system(0), f"Question {i}?") for i in range(3)]
    n_system = len(_chat_ids(model, cold[0][0]))
    assert n_system > 500
    for _, r in cold:
        assert r.usage.prompt_tokens_details.cached_tokens < 32  # the template's start at most
    for messages, r in warm:
        assert r.usage.prompt_tokens_details.cached_tokens >= n_system - 48
        assert r.timings["prompt_n"] < 64
        want, _ = _alone(model, _chat_ids(model, messages), 6)
        assert r.choices[0].message.content == want
    assert min(r.timings["prompt_ms"] for _, r in warm) < min(
        r.timings["prompt_ms"] for _, r in cold
    )


# -- soak ---------------------------------------------------------------------------------------


def test_soak_leaves_nothing_behind(server: tuple[str, Any]) -> None:
    """A few hundred short requests, 16 at a time, some cancelled by stop strings and some by
    closing the stream: afterwards no request runs, every page is free or an idle cached
    prefix, and no thread or task is left."""
    url, app = server
    engine = app.state.engine
    loop = app.state.loop

    async def tasks() -> list[str]:
        return [repr(t.get_coro()) for t in asyncio.all_tasks()]

    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as c:  # warm
        c.completions.create(model="tiny", prompt="a", max_tokens=1)
    _idle(url)
    threads = threading.active_count()
    tasks_before = asyncio.run_coroutine_threadsafe(tasks(), loop).result(10)
    rng = np.random.default_rng(9)

    async def one(c: Any, i: int, gate: asyncio.Semaphore) -> None:
        prompt = [int(t) for t in rng.integers(3, 300, size=int(rng.integers(1, 24)))]
        async with gate:
            if i % 5 == 4:  # a client that goes away after the first chunk
                stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                                    temperature=0, stream=True)  # fmt: skip
                async for _ in stream:
                    break
                await stream.close()
            else:
                await c.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                           temperature=0.5, seed=i, stop=["e"])  # fmt: skip

    async def soak() -> None:
        gate = asyncio.Semaphore(16)
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as c:
            await asyncio.gather(*(one(c, i, gate) for i in range(300)))

    asyncio.run(soak())
    h = _idle(url)
    assert (h["running"], h["queue_depth"]) == (0, 0)
    assert h["free_pages"] + h["cached_pages"] == POOL
    assert not engine._jobs
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = asyncio.run_coroutine_threadsafe(tasks(), loop).result(10)
        if len(now) <= len(tasks_before) and threading.active_count() <= threads:
            break
        time.sleep(0.05)
    assert len(now) <= len(tasks_before), now
    assert threading.active_count() <= threads


def test_cli_serve_parser() -> None:
    import argparse

    from portable_llm.cli.serve import add_serve_parser

    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    p = add_serve_parser(sub)
    args = p.parse_args(["m", "--port", "0", "--max-batch", "4", "--api-key", "k"])
    assert (args.host, args.port, args.max_batch, args.api_key) == ("127.0.0.1", 0, 4, "k")
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--max-batch", "0"])
