"""``GET /metrics``: the server's Prometheus page, driven by the official ``openai`` client.

The oracle of every counter is counted apart from the server: prompt tokens from the tokenizer
and the chat template, generated tokens from :func:`portable_llm.generate` on each prompt alone
(greedy, a final stop token included), prefix-cache hits from the cache's rule (a repeated
prompt takes all but its last token from the cache). Histograms count one observation per
request (one per token gap for the inter-token latency); gauges come back to 0 when idle.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

from conftest import skip_reason

if skip_reason("numpy") is not None:  # the server runs the model on NumPy
    pytest.skip(skip_reason("numpy"), allow_module_level=True)
pytest.importorskip("starlette", reason="the serve extra (starlette) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("prometheus_client", reason="the serve extra (prometheus-client)")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
httpx = pytest.importorskip("httpx2", reason="the openai client's HTTP library")

import prometheus_client  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import portable_llm as pl  # noqa: E402
from portable_llm.serve import create_app  # noqa: E402
from servers import alone, chat_ids, serving, tiny_model  # noqa: E402

KEY = "metrics-key"
POOL = 128
PAGE = 16
P = "portable_llm:"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pl.Model:
    return tiny_model(tmp_path_factory.mktemp("metrics"))


@pytest.fixture(scope="module")
def server(model: pl.Model) -> Any:
    """One request at a time (``max_batch=1``), so a second one waits."""
    app = create_app(model, model_name="tiny", api_key=KEY, max_batch=1, pool_pages=POOL,
                     page_size=PAGE)  # fmt: skip
    with serving(app) as url:
        yield url, app


@pytest.fixture
def client(server: tuple[str, Any]) -> Any:
    with openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def scrape(url: str) -> dict[str, float]:
    """``{"name{label=value}": value}`` of every sample (the ``model_name`` label left out,
    after checking it names the served model)."""
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if not s.name.startswith(P):
                continue
            labels = dict(s.labels)
            assert labels.pop("model_name") == "tiny"
            shown = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            out[f"{s.name}{{{shown}}}"] = s.value
    return out


def idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The page once no request runs or waits."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = m[P + "num_requests_running{}"] + m[P + "num_requests_waiting{}"]
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def until(url: str, name: str, value: float, timeout: float = 10.0) -> dict[str, float]:
    """The page once ``name`` reads ``value``."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m[name] == value or time.monotonic() > deadline:
            return m
        time.sleep(0.01)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_counters_and_histograms_count_what_was_sent(
    model: pl.Model, server: tuple[str, Any], client: Any
) -> None:
    url, _ = server
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What does the cache keep?"}]  # fmt: skip
    chat = chat_ids(model, messages)
    start = 7 if chat[0] != 7 else 8  # shares no first token with the chat prompt
    prompt = list(range(start, start + 37))  # 2 full pages and 5 tokens
    asks = [("completion", prompt, 7), ("chat", chat, 5), ("completion", prompt, 6)]
    wants = [alone(model, ids, n) for _, ids, n in asks]
    before = idle(url)
    cached, spent = [], []
    for (kind, _, n), (want, _) in zip(asks, wants, strict=True):
        t0 = time.perf_counter()
        if kind == "completion":
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                          temperature=0)  # fmt: skip
            text, usage = r.choices[0].text, r.usage
        else:
            chunks = list(client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=n, temperature=0, stream=True,
                stream_options={"include_usage": True},
            ))  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        spent.append(time.perf_counter() - t0)
        assert text == want  # the requests ran as generate runs them
        cached.append(usage.prompt_tokens_details.cached_tokens)
    after = idle(url)

    n_prompt = sum(len(ids) for _, ids, _ in asks)
    drawn = [d for _, d in wants]
    assert delta(after, before, P + "prompt_tokens_total{}") == n_prompt
    assert delta(after, before, P + "generation_tokens_total{}") == sum(drawn)
    assert delta(after, before, P + "prefix_cache_queries_total{}") == n_prompt
    hits = len(prompt) - 1  # the repeated prompt: all but its last token (its logits are needed)
    assert cached == [0, 0, hits]
    assert delta(after, before, P + "prefix_cache_hits_total{}") == hits
    assert before[P + "prefix_cache_hit_rate{}"] == 0.0  # nothing was asked before
    assert after[P + "prefix_cache_hit_rate{}"] == pytest.approx(hits / n_prompt)
    reasons = ["length" if d == n else "stop" for d, (_, _, n) in zip(drawn, asks, strict=True)]
    for reason in set(reasons):
        got = delta(after, before, P + f"request_success_total{{finished_reason={reason}}}")
        assert got == reasons.count(reason)
    per_request = (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_time_per_output_token_seconds",
    )
    for name in per_request:
        assert delta(after, before, P + name + "_count{}") == len(asks), name
        assert delta(after, before, P + name + "_bucket{le=+Inf}") == len(asks), name
    gaps = sum(d - 1 for d in drawn)
    assert delta(after, before, P + "inter_token_latency_seconds_count{}") == gaps
    # each request's times lie within what its client waited
    e2e = delta(after, before, P + "e2e_request_latency_seconds_sum{}")
    ttft = delta(after, before, P + "time_to_first_token_seconds_sum{}")
    assert 0 < ttft <= e2e <= sum(spent)


def test_gauges_running_waiting_and_back_to_zero(
    model: pl.Model, server: tuple[str, Any], client: Any
) -> None:
    """One long stream runs and a second waits (``max_batch=1``); its pages are used; once the
    first is closed and the second done, running, waiting and used pages read 0 and the pages
    left are the prefix cache's."""
    url, app = server
    before = idle(url)
    long = client.completions.create(model="tiny", prompt=list(range(40, 90)), max_tokens=900,
                                     temperature=0, stream=True)  # fmt: skip
    next(iter(long))
    m = until(url, P + "num_requests_running{}", 1)
    assert m[P + "num_requests_running{}"] == 1
    assert m[P + "kv_pages_used{}"] >= math.ceil(50 / PAGE)
    assert m[P + "kv_cache_usage_perc{}"] == m[P + "kv_pages_used{}"] / POOL

    answers: list[Any] = []
    second = threading.Thread(target=lambda: answers.append(client.completions.create(
        model="tiny", prompt=[9, 8, 7, 6], max_tokens=3, temperature=0,
    )))  # fmt: skip
    second.start()
    m = until(url, P + "num_requests_waiting{}", 1)
    assert (m[P + "num_requests_running{}"], m[P + "num_requests_waiting{}"]) == (1, 1)
    long.close()  # the client goes away: the request is cancelled, the waiting one admitted
    second.join(20)
    assert len(answers) == 1 and answers[0].usage.completion_tokens >= 1

    after = idle(url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_pages_used",
                 "kv_cache_usage_perc"):  # fmt: skip
        assert after[P + name + "{}"] == 0, name
    cache = app.state.engine.generator.prefix_cache
    assert after[P + "kv_pages_cached{}"] == cache.num_idle > 0
    assert after[P + "kv_pages_total{}"] == POOL
    assert after[P + "kv_pages_free{}"] == POOL - cache.num_idle
    assert delta(after, before, P + "request_success_total{finished_reason=abort}") == 1
    assert delta(after, before, P + "e2e_request_latency_seconds_count{}") == 2


def test_stop_string_counts_as_stop(model: pl.Model, server: tuple[str, Any], client: Any) -> None:
    """A stop string ends the request in the app (a cancel for the engine): counted as
    ``stop``, not as ``abort``, with the tokens drawn until the cancel landed."""
    url, _ = server
    ids = list(range(100, 120))
    want, drawn = alone(model, ids, 200)
    assert drawn == 200 and "DD" in want  # without the stop string it would run to the end
    before = idle(url)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=200, temperature=0,
                                  stop=["DD"])  # fmt: skip
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want[: want.index("DD")], "stop")
    after = until(url, P + "e2e_request_latency_seconds_count{}",
                  before[P + "e2e_request_latency_seconds_count{}"] + 1)  # fmt: skip
    assert delta(after, before, P + "request_success_total{finished_reason=stop}") == 1
    assert delta(after, before, P + "request_success_total{finished_reason=abort}") == 0
    assert r.usage.completion_tokens <= delta(after, before, P + "generation_tokens_total{}") < 200


def test_key_and_registries_per_app(model: pl.Model, server: tuple[str, Any]) -> None:
    """``/metrics`` needs the key when one is set; each app has a registry of its own (a second
    app in the process starts at 0, the process-wide registry holds none of them)."""
    url, app = server
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer no"}).status_code == 401
    other = create_app(model, model_name="tiny", pool_pages=8)
    assert other.state.metrics.registry is not app.state.metrics.registry
    text = other.state.metrics.render().decode()
    assert 'portable_llm:prompt_tokens_total{model_name="tiny"} 0.0' in text
    assert scrape(url)[P + "prompt_tokens_total{}"] > 0
    names = {f.name for f in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith(P) for n in names)


def test_n_choices_count_once_per_request(model: pl.Model) -> None:
    """``n=2``: one prefill (prompt tokens once), every choice's tokens generated, one time to
    first token, one end, and the gaps between tokens taken within each choice."""
    app = create_app(model, model_name="tiny", pool_pages=POOL, page_size=PAGE)
    with serving(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="none") as c:
        before = idle(url)
        prompt = list(range(60, 75))
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=9, n=2, temperature=0)
        after = idle(url)
    _, drawn = alone(model, prompt, 9)  # greedy: each choice draws these
    assert [ch.index for ch in r.choices] == [0, 1]
    assert delta(after, before, P + "prompt_tokens_total{}") == len(prompt)
    assert delta(after, before, P + "generation_tokens_total{}") == 2 * drawn
    assert delta(after, before, P + "inter_token_latency_seconds_count{}") == 2 * (drawn - 1)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds"):  # fmt: skip
        assert delta(after, before, P + name + "_count{}") == 1, name
    # the mean gap within a choice is at most the request's decode time over its gaps
    tpot = delta(after, before, P + "request_time_per_output_token_seconds_sum{}")
    e2e = delta(after, before, P + "e2e_request_latency_seconds_sum{}")
    assert 0 < tpot <= e2e / (drawn - 1)
