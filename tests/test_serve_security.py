"""``portable-llm serve`` hardened (issue 33): web pages kept out (``Host``, ``Origin``, JSON-only
bodies, CORS only when asked for), API keys checked at start and compared in constant time,
disconnects noticed within a step, strict JSON for non-finite log-probabilities, a stop string
matched by the last token, ``max_queue=0``, the port really bound, and clean errors.

Servers run as in tests/test_serve.py (uvicorn in a thread on 127.0.0.1, a free port) over the
same tiny checkpoint; the oracles are ``pl.generate`` alone and a float64 log-softmax.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the serve extra (starlette) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("openai", reason="the openai client is not installed")

import portable_llm as pl
from portable_llm.serve import (
    create_app,
    guard,
)
from portable_llm.testing import tolerance
from portable_llm.testing.checkpoints import (
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)
from test_serve import (  # the module skips itself without NumPy or the serve extra
    JSON,
    KEY,
    _alone,
    httpx,
    model,  # noqa: F401 (a fixture)
    openai,
    serving,
)

AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(model: pl.Model) -> Iterator[tuple[str, Any]]:  # noqa: F811
    app = create_app(model, model_name="tiny", api_key=KEY, max_batch=8, pool_pages=128)
    with serving(app) as url:
        yield url, app


def _post(url: str, body: Any = COMPLETION, **headers: str) -> Any:
    return httpx.post(url + "/v1/completions", content=json.dumps(body), headers=headers)


def _strict(text: str) -> Any:
    """``text`` parsed as strict JSON: ``NaN``, ``Infinity`` and ``-Infinity`` fail."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in a response: not JSON")

    return json.loads(text, parse_constant=refuse)


def _slow_steps(monkeypatch: pytest.MonkeyPatch, app: Any, seconds: float) -> None:
    """Every forward of ``app``'s engine takes at least ``seconds``."""
    gen = app.state.engine.generator
    forward = gen._forward

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return forward(*args, **kwargs)

    monkeypatch.setattr(gen, "_forward", slow)


# -- Host: DNS rebinding ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil", ""]
)
@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_foreign_host_refused(server: tuple[str, Any], host: str, path: str) -> None:
    """A page on another name that rebinds to 127.0.0.1 sends its own name in ``Host``: 400
    before anything else (the key, the route) is looked at."""
    r = httpx.get(server[0] + path, headers={"Host": host, **AUTH})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_host"
    assert _post(server[0], Host=host, **AUTH, **JSON).status_code == 400


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:1234", "LOCALHOST.", "127.0.0.1:80", "[::1]:8000", "[::1]"]
)
def test_local_hosts_allowed(server: tuple[str, Any], host: str) -> None:
    r = httpx.get(server[0] + "/v1/models", headers={"Host": host, **AUTH})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


@pytest.mark.parametrize(
    "allowed, host, ok",
    [
        (["myhost.lan"], "myhost.lan:9000", True),
        (["myhost.lan"], "other.lan", False),
        (["192.168.1.5"], "192.168.1.5:8000", True),
        (["192.168.1.5"], "192.168.1.6", False),
        (["0.0.0.0"], "10.1.2.3:8000", True),  # a wildcard bind: any IPv4 address
        (["0.0.0.0"], "[fe80::1]", False),
        (["0.0.0.0"], "evil.example", False),  # ... never a name
        (["::"], "[fe80::1]:80", True),
        (["::"], "10.1.2.3", True),  # dual-stack: IPv4 clients too
        (["*"], "evil.example", True),
        ([], "[::ffff:127.0.0.1]:80", True),  # 127.0.0.1 spelled as IPv6
        ([], "localhost:80:80", False),
        ([], "[::1]x", False),
    ],
)
def test_allowed_hosts(allowed: list[str], host: str, ok: bool) -> None:
    hosts = guard.normalize_hosts(allowed)
    assert guard.host_allowed(guard.host_name(host), hosts) is ok


# -- cross-site requests and CORS ---------------------------------------------------------------


def test_simple_cross_site_post_refused(server: tuple[str, Any]) -> None:
    """A page's form or no-cors fetch (``text/plain``, its ``Origin``) generates nothing; a
    body that is not ``application/json`` gets 415 even without an ``Origin``."""
    url, app = server
    steps = app.state.engine.steps
    r = _post(url, **{"Content-Type": "text/plain", "Origin": "http://evil.example"}, **AUTH)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = AUTH if kind is None else {"Content-Type": kind, **AUTH}
        r = httpx.post(url + "/v1/completions", content=json.dumps(COMPLETION), headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert app.state.engine.steps == steps  # nothing ran
    r = _post(url, **{"Content-Type": "application/json; charset=utf-8"}, **AUTH)
    assert r.status_code == 200 and r.json()["choices"]


def test_cors_off_by_default(server: tuple[str, Any]) -> None:
    url, _ = server
    preflight = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(url + "/v1/completions", headers=preflight)
    assert r.status_code == 403
    assert not [h for h in r.headers if h.startswith("access-control-")]
    r = httpx.get(url + "/v1/models", headers={"Origin": "http://localhost:3000", **AUTH})
    assert r.status_code == 403


def test_cors_for_allowed_origins(model: pl.Model) -> None:  # noqa: F811
    """``allowed_origins``: those exact origins get their preflight answered and the
    ``Access-Control-Allow-Origin`` of their requests; any other origin is still refused."""
    page = "http://localhost:3000"
    app = create_app(model, model_name="tiny", api_key=KEY, allowed_origins=[page + "/"])
    with serving(app) as url:
        preflight = {
            "Origin": page,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        r = httpx.options(url + "/v1/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == page
        assert "POST" in r.headers["access-control-allow-methods"]
        r = _post(url, Origin=page, **AUTH, **JSON)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        for other in ("http://localhost:3001", "https://localhost:3000", "null"):
            r = httpx.options(url + "/v1/completions", headers={**preflight, "Origin": other})
            assert r.status_code == 403
            assert "access-control-allow-origin" not in r.headers
            assert _post(url, Origin=other, **AUTH, **JSON).status_code == 403


# -- API keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "κλειδί", "two words", "tab\tkey", "k" * 257])
def test_bad_api_key_refused(model: pl.Model, key: str) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="api_key"):
        create_app(model, api_key=key)


def test_keys_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hmac.compare_digest`` sees two SHA-256 digests, whatever the lengths given."""
    seen: list[tuple[int, int]] = []
    compare = guard.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(guard.hmac, "compare_digest", spy)
    assert guard.keys_equal("secret-key", "secret-key")
    assert not guard.keys_equal("s", "secret-key")
    assert not guard.keys_equal("secret-kez", "secret-key")
    assert not guard.keys_equal("\udc80", "secret-key")  # an undecodable header byte
    assert seen == [(32, 32)] * 4


# -- disconnects --------------------------------------------------------------------------------


def _send_raw(url: str, body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _wait(condition: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_disconnect_noticed_within_a_step(
    server: tuple[str, Any], monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """A client that closes its connection mid-generation is cancelled before the next step or
    the one after, streaming or not (it used to run all its tokens for nobody when they kept
    arriving faster than the 0.5 s check)."""
    url, app = server
    engine = app.state.engine
    _slow_steps(monkeypatch, app, 0.03)
    cancelled = engine.cancelled
    body = {**COMPLETION, "prompt": [9, 10, 11], "max_tokens": 300, "stream": stream}
    sock = _send_raw(url, body)
    try:
        start = engine.steps
        assert _wait(lambda: engine.steps >= start + 5), "the request did not run"
    finally:
        closed_at = engine.steps
        sock.close()
    assert _wait(lambda: engine.cancelled > cancelled), "the request was never cancelled"
    assert _wait(lambda: not engine.generator.has_work)
    assert engine.steps - closed_at <= 2
    assert engine.cancelled == cancelled + 1


# -- strict JSON --------------------------------------------------------------------------------


def _patch_logits(monkeypatch: pytest.MonkeyPatch, app: Any, row: np.ndarray) -> None:
    """Every forward of ``app``'s engine returns ``row`` (V,) for each sequence."""
    gen = app.state.engine.generator
    forward = gen._forward

    def fixed(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if out is None:
            return None
        return np.broadcast_to(row, np.shape(pl.to_numpy(out))).astype(np.float32)  # (B, V)

    monkeypatch.setattr(gen, "_forward", fixed)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", ["-inf", "+inf"])
def test_non_finite_logprobs_are_null(
    model: pl.Model,  # noqa: F811
    server: tuple[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
    case: str,
) -> None:
    """Logits ruling out all but three tokens: their log-probabilities are a float64
    log-softmax of the three, the others ``null``; with a ``+inf`` logit every value is
    ``null`` (inf - inf). Never ``NaN``/``-Infinity`` in the stream, never a 500."""
    url, app = server
    V = model.vocab_size
    eos = set(model.eos_token_ids)
    live = [t for t in range(100, 200) if t not in eos][:3]
    row = np.full(V, -np.inf)
    row[live] = [2.0, 1.0, 0.5]
    if case == "+inf":
        row[live[0]] = np.inf
    _patch_logits(monkeypatch, app, row)
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 3,
        "temperature": 0, "logprobs": True, "top_logprobs": 5, "stream": stream,
    }  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", content=json.dumps(body), headers=AUTH | JSON)
    assert r.status_code == 200, r.text
    if stream:
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        chunks = [_strict(ln) for ln in lines if ln != "[DONE]"]
        records = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    else:
        records = [_strict(r.text)["choices"][0]["logprobs"]]
    items = [item for lp in records if lp for item in lp["content"]]
    assert len(items) == 3
    chosen = [item["logprob"] for item in items]
    tops = [[t["logprob"] for t in item["top_logprobs"]] for item in items]
    if case == "+inf":
        assert chosen == [None] * 3 and tops == [[None] * 5] * 3
        return
    want = row[live] - np.log(np.exp(row[live]).sum())  # float64 log-softmax of the three
    tol = tolerance("float32")
    np.testing.assert_allclose(chosen, [want[0]] * 3, rtol=tol.rtol, atol=tol.atol)
    for values in tops:
        assert values[3:] == [None, None]  # ruled out: -inf
        np.testing.assert_allclose(values[:3], want, rtol=tol.rtol, atol=tol.atol)


# -- stop strings -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_matched_by_the_last_token(
    model: pl.Model,  # noqa: F811
    server: tuple[str, Any],
    stream: bool,
) -> None:
    """16 stop strings, one of which the very last token allowed completes: ``finish_reason``
    is ``stop`` (not ``length``) and the text ends before it."""
    prompt = [7, 8, 9, 10]
    for n in range(8, 40):
        text, _ = _alone(model, prompt, n)
        shorter, _ = _alone(model, prompt, n - 1)
        stop = text[-3:]
        if len(text) - len(shorter) >= 1 and len(stop) == 3 and text.find(stop) == len(text) - 3:
            break
    else:
        pytest.skip("no greedy text of the tiny model ends in a fresh 3-character string")
    stops = [f"\x01never{i}" for i in range(15)] + [stop]
    with openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0) as c:
        args = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "stop": stops}
        if stream:
            chunks = list(c.completions.create(**args, stream=True))
            got = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
            finish = [r for r in reasons if r is not None]
        else:
            r = c.completions.create(**args)
            got, finish = r.choices[0].text, [r.choices[0].finish_reason]
    assert finish == ["stop"]
    assert got == text[:-3]


# -- max_queue 0 --------------------------------------------------------------------------------


def test_max_queue_zero_serves_running_slots(
    model: pl.Model,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``max_queue=0``: an idle server serves (it used to answer 429 to everything); while
    ``max_batch`` requests run, the next one gets 429, and once they end it is served again."""
    app = create_app(model, model_name="tiny", max_batch=1, max_queue=0, pool_pages=64)
    with serving(app) as url:
        assert _post(url, **JSON).status_code == 200
        _slow_steps(monkeypatch, app, 0.02)
        body = {**COMPLETION, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream
            assert next(lines).startswith("data: ")  # the one slot is taken
            r = _post(url, **JSON)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
        engine = app.state.engine
        assert _wait(lambda: engine.in_flight == 0)
        assert _post(url, **JSON).status_code == 200


# -- clean errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "\\udc80", "prompt": "a"}',
        b'{"model": "tiny", "prompt": "a\\ud800b"}',
        b'{"model": "tiny", "prompt": "a", "stop": ["\\udfff"]}',
    ],
)
def test_lone_surrogate_is_400(server: tuple[str, Any], raw: bytes) -> None:
    r = httpx.post(server[0] + "/v1/completions", content=raw, headers={**AUTH, **JSON})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"


class _Bare:
    """A model of the generation protocol without ``config`` (nor paged members)."""

    def __init__(self, inner: pl.Model) -> None:
        self._inner = inner
        self.vocab_size = inner.vocab_size
        self.tokenizer = inner.tokenizer
        self.eos_token_ids = inner.eos_token_ids

    def make_cache(self) -> Any:
        return self._inner.make_cache()

    def __call__(self, ids: Any, /, **kwargs: Any) -> Any:
        return self._inner(ids, **kwargs)


def test_model_without_config(model: pl.Model) -> None:  # noqa: F811
    """The server reads only the protocol's members: a model without ``config`` serves the text
    of ``generate`` (it used to answer 500); an object that is no model is a ``TypeError``
    naming what it lacks."""
    bare = _Bare(model)
    assert not hasattr(bare, "config")
    app = create_app(bare, model_name="tiny", max_batch=2)
    with serving(app) as url:
        r = _post(url, {**COMPLETION, "max_tokens": 5}, **JSON)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _alone(model, COMPLETION["prompt"], 5)[0]
    with pytest.raises(TypeError, match="object lacks tokenizer, eos_token_ids, make_cache"):
        create_app(object())  # vocab_size is optional since issue 29 (the logits tell V)


@pytest.mark.parametrize(
    "options, kind",
    [
        ({"allowed_hosts": "localhost"}, TypeError),
        ({"allowed_hosts": ["http://x.lan"]}, ValueError),
        ({"allowed_hosts": ["x.lan:80"]}, ValueError),
        ({"allowed_origins": ["http://x.lan/app"]}, ValueError),
        ({"allowed_origins": ["localhost:3000"]}, ValueError),
        ({"allowed_origins": ["*"]}, ValueError),
        ({"max_queue": -1}, ValueError),
        ({"model_name": ""}, ValueError),
        ({"model_name": "a\udc80"}, ValueError),
    ],
)
def test_create_app_checks_options(
    model: pl.Model,  # noqa: F811
    options: dict[str, Any],
    kind: type[Exception],
) -> None:
    name = next(iter(options))
    with pytest.raises(kind, match=name):
        create_app(model, **options)


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--api-key", ""], "--api-key: is empty"),
        (["--api-key", "ключ"], "--api-key: must be 1 to 256 printable ASCII"),
        (["--port", "70000"], "--port: expected a port number in [0, 65535]"),
        (["--port", "-1"], "--port: expected a port number"),
        (["--host", "http://x"], "--host"),
        (["--allowed-hosts", "a.lan,b.lan:80"], "--allowed-hosts"),
        (["--allowed-origins", "http://x.lan/path"], "--allowed-origins"),
        (["--model-name", ""], "--model-name: model_name must be a non-empty string"),
        (["--model-name", "a\udcff"], "--model-name: model_name must be a non-empty string"),
    ],
)
def test_cli_bad_flag_is_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], words: str
) -> None:
    """A bad value stops the command before anything loads: one line, exit status 2 (the
    command line's usage errors, docs/cli.md)."""
    from portable_llm.cli.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "no-such-model", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err.replace("\n  ", " ") and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # one message, wrapped at 100 columns


def test_cli_port_in_use(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A port that another socket holds: one line, exit status 1, and no URL announced."""
    from portable_llm.cli.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", str(tmp_path), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines() == [
        f"portable-llm serve: error: cannot listen on 127.0.0.1 port {port}: Address already in use"
    ]


def test_cli_port_zero_announces_the_bound_port(tmp_path: Any) -> None:
    """``--port 0``: the announced URL carries the port the kernel chose, and it answers."""
    folder = tmp_path / "tiny"
    cfg = tiny_config("llama")
    write_checkpoint(folder, cfg, seed=3)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    env = {**os.environ, "PORTABLE_LLM_BACKENDS": "numpy"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "portable_llm", "serve", str(folder), "--port", "0",
         "--log-level", "warning", "--threads", "1"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        line = ""
        while " on http://" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, line
            line = proc.stderr.readline()
        url = line.split(" on ", 1)[1].strip().removesuffix("/v1")
        assert not url.endswith(":0")
        assert _wait(lambda: _health_ok(url), timeout=20)
    finally:
        proc.terminate()
        proc.wait(20)
        if proc.stderr is not None:
            proc.stderr.close()


def _health_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False
