"""The OpenAI-compatible ASGI app: :func:`create_app` (Starlette) over one :class:`~portable_llm.
serve.engine.Engine`.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and ``GET /health``.
Streams are server-sent events (``data: {...}`` chunks, then ``data: [DONE]``). Every error is
an OpenAI error body; a client that goes away is cancelled and its pages come back. Requests
from web pages are kept out by :mod:`portable_llm.serve.guard` (docs/security.md); every
response is strict JSON (no ``NaN`` or ``Infinity``: a log-probability that is not finite is
``null``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from portable_llm.core.checks import check_int
from portable_llm.generation.protocol import UNKNOWN_VOCAB, vocab_size
from portable_llm.generation.sampler import make_sampler
from portable_llm.serve.engine import Engine, Job, TokenEvent
from portable_llm.serve.guard import (
    HostGuard,
    check_api_key,
    check_json_body,
    keys_equal,
    normalize_hosts,
    normalize_origins,
)
from portable_llm.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from portable_llm.serve.metrics import ServeMetrics
from portable_llm.serve.page import chat_page
from portable_llm.serve.protocol import APIError, Sampling, error_body, read_chat, read_completion
from portable_llm.serve.text import TextOut
from portable_llm.serve.tools import (
    ToolAnswer,
    answer_parser,
    compile_grammar,
    read_structure,
    template_messages,
)

__all__ = ["check_model_name", "create_app"]

#: The largest request body read (bytes); a larger one gets 413.
MAX_BODY = 4 << 20


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


@dataclass
class _Served:
    engine: Engine
    name: str
    aliases: frozenset[str]
    api_key: str | None
    max_queue: int
    max_batch: int
    default_max_tokens: int
    created: int
    prompts: ThreadPoolExecutor  # renders chat templates and tokenizes, off the event loop


# Over 80 lines for its docstring (every option of the server); the code checks the options and
# wires the engine, the routes (_routes) and the lifespan (_lifespan): ~30 lines.
def create_app(
    model: Any,
    *,
    model_name: str = "model",
    aliases: tuple[str, ...] = (),
    api_key: str | None = None,
    max_queue: int = 64,
    max_batch: int = 32,
    prefill_chunk: int = 512,
    pool_pages: int | None = None,
    page_size: int = 16,
    prefix_cache: bool = True,
    default_max_tokens: int = 512,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    broadcast: Callable[[Any], Any] | None = None,
) -> Starlette:
    """The server as an ASGI app (run it with uvicorn, or mount it in another app).

    Parameters
    ----------
    model : Model
        From :func:`portable_llm.load`; text requests need its tokenizer, chat requests its
        chat template.
    model_name : str
        The id ``/v1/models`` lists; requests naming another model (and none of ``aliases``)
        get 404.
    api_key : str, optional
        When given, every ``/v1`` request needs ``Authorization: Bearer <api_key>`` (else 401);
        ``/health`` stays open. 1 to 256 printable ASCII characters without spaces (an empty
        key is a ``ValueError``), compared in constant time.
    max_queue : int, >= 0
        Requests that may wait beyond the ``max_batch`` running ones: once ``max_batch +
        max_queue`` requests run or wait, the next one gets 429 with ``Retry-After``; 0: none
        waits.
    max_batch, prefill_chunk, pool_pages, page_size, prefix_cache
        As for :class:`~portable_llm.serve.engine.Engine`.
    default_max_tokens : int
        ``max_tokens`` of a request that gives none (less when the context is shorter).
    allowed_hosts : sequence of str
        Host names or addresses (any port) that a request's ``Host`` header may name, besides
        ``localhost``, ``127.0.0.1`` and ``::1``; else 400 (DNS rebinding). ``0.0.0.0`` admits
        any IPv4 address, ``::`` any IPv4 or IPv6 address (what those binds listen on), ``*``
        any host.
    allowed_origins : sequence of str
        Web page origins (``http://localhost:3000``) that may call the server (CORS, their
        preflights answered); a request with another ``Origin`` header gets 403. Default:
        none (CORS off).
    broadcast : callable, optional
        Rank 0's of a model split over processes: each step's events go to the other ranks
        through it, whose engines run :meth:`~portable_llm.serve.engine.Engine.follow` (see
        :class:`~portable_llm.serve.engine.Engine`; ``portable-llm serve --tensor-parallel``
        wires both).

    The engine thread starts with the app's lifespan (or at the first request when the app is
    mounted without one) and stops at its end; ``app.state.engine`` is the
    :class:`~portable_llm.serve.engine.Engine`.
    """
    api_key = check_api_key(api_key)
    check_int("create_app", "max_queue", max_queue, low=0)
    check_int("create_app", "default_max_tokens", default_max_tokens, low=1)
    check_model_name(model_name, op="create_app")
    hosts = normalize_hosts(allowed_hosts)
    origins = normalize_origins(allowed_origins)
    engine = Engine(
        model, max_batch=max_batch, prefill_chunk=prefill_chunk, pool_pages=pool_pages,
        page_size=page_size, prefix_cache=prefix_cache, broadcast=broadcast,
    )  # fmt: skip
    served = _Served(
        engine, model_name, frozenset((model_name, *aliases)), api_key, max_queue,
        engine.generator.max_batch, default_max_tokens, int(time.time()),
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="portable-llm-prompt"),
    )  # fmt: skip
    metrics = ServeMetrics(engine, model_name=model_name)  # a registry of this app's own
    engine.observer = metrics

    app = Starlette(
        routes=_routes(served, metrics),
        middleware=_middleware(hosts, origins),
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        lifespan=_lifespan(served),
    )
    app.state.engine = engine
    app.state.metrics = metrics
    return app


def _lifespan(served: _Served) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine thread runs from its start to its end."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        served.engine.start()
        try:
            yield
        finally:
            served.engine.close()
            served.prompts.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _routes(served: _Served, metrics: ServeMetrics) -> list[Route]:
    """The OpenAI routes, ``/health``, ``/metrics`` and the chat page."""

    async def chat(request: Request) -> Response:
        return await _generate(served, request, chat=True)

    async def completions(request: Request) -> Response:
        return await _generate(served, request, chat=False)

    async def models(request: Request) -> Response:
        _authorize(served, request)
        card = {"id": served.name, "object": "model", "created": served.created,
                "owned_by": "portable_llm"}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **served.engine.health()})

    async def metrics_page(request: Request) -> Response:
        _authorize(served, request)
        return Response(metrics.render(), media_type=METRICS_TYPE)

    return [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route("/", chat_page, methods=["GET"]),
    ]


def _middleware(hosts: frozenset[str], origins: tuple[str, ...]) -> list[Middleware]:
    """The ``Host``/``Origin`` checks first (outermost), then CORS for ``origins`` (none: no
    CORS header is ever sent)."""
    out = [Middleware(HostGuard, hosts=hosts, origins=origins)]
    if origins:
        headers = ["Authorization", "Content-Type"]
        out.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(origins),
                allow_methods=["GET", "POST"],
                allow_headers=headers,
            )
        )
    return out


# -- errors -----------------------------------------------------------------------------------
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = error_body(f"{request.method} {request.url.path}: {exc.detail}", type=kind)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    body = error_body(f"internal error: {type(exc).__name__}", type="server_error")
    return JSONResponse(body, status_code=500)


def _authorize(served: _Served, request: Request) -> None:
    if served.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if not keys_equal(key.strip(), served.api_key) or scheme.lower() != "bearer":
        raise APIError(
            "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
            status=401, param=None, code="invalid_api_key",
        )  # fmt: skip


# -- one request ------------------------------------------------------------------------------
async def _generate(served: _Served, request: Request, *, chat: bool) -> Response:
    _authorize(served, request)
    check_json_body(request.headers.get("content-type"))
    body = await _read_json(request, MAX_BODY)
    sampling, source = (read_chat if chat else read_completion)(body, served.name)
    if sampling.model not in served.aliases:
        raise APIError(
            f"The model '{sampling.model[:200]}' does not exist (this server has "
            f"'{served.name}')",
            status=404, param="model", code="model_not_found",
        )  # fmt: skip
    engine = served.engine
    model = engine.model
    structure = read_structure(body, chat=chat)  # tools, tool_choice, response_format
    parser = answer_parser(model.tokenizer, structure)
    if chat and isinstance(source, list):  # read_chat's messages
        source = template_messages(source)
    loop = asyncio.get_running_loop()
    prompt = await loop.run_in_executor(
        served.prompts, _prompt_ids, model, source, chat, structure.tools
    )
    job = _job(served, sampling, prompt)
    job.response_format = structure.grammar(parser)
    if job.response_format is not None:  # compiled here, not on the engine thread
        await loop.run_in_executor(
            served.prompts, compile_grammar, model, job.response_format, job.stop, structure
        )
    if engine.in_flight >= served.max_batch + served.max_queue:
        raise APIError(
            f"{engine.in_flight} requests are running or waiting (--max-batch "
            f"{served.max_batch} plus --max-queue {served.max_queue}); retry later",
            status=429, type="rate_limit_exceeded", code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )  # fmt: skip
    runs = [_Run(served, job, sampling, chat, model.tokenizer, ToolAnswer(parser))
            for _ in range(job.n)]  # fmt: skip
    for i, one in enumerate(runs):
        one.index, one.queue = i, job.queue_of(i)
    run = runs[0]
    job.loop = loop
    engine.submit(job)  # from here on, every way out cancels the job (a no-op once it ended)
    watch = asyncio.create_task(_watch(request, engine, job))
    if sampling.stream:
        try:  # an error before the first token is still an HTTP error
            first = await run.next_event()
        except ClientGone:
            return Response(status_code=499)
        except BaseException:
            engine.cancel(job)
            watch.cancel()
            raise
        return StreamingResponse(
            run.sse(first, watch) if job.n == 1 else _choices_sse(runs, first, watch),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        if job.n == 1:
            return JSONResponse(await run.whole())
        return JSONResponse(_choices_whole(await asyncio.gather(*(r.whole() for r in runs))))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    finally:
        engine.cancel(job)  # a no-op once it finished
        watch.cancel()


async def _watch(request: Request, engine: Engine, job: Job) -> None:
    """Wait for the client to go away (the ASGI ``http.disconnect`` message, which arrives the
    moment the connection closes), then cancel ``job`` before the engine's next step and wake
    its handler with a ``("gone", None)`` event; cancelled once the response is complete."""
    with contextlib.suppress(Exception):
        while (await request.receive())["type"] != "http.disconnect":
            pass
    engine.cancel(job)
    for queue in (job.queue, *job.more):
        queue.put_nowait(("gone", None))


async def _read_json(request: Request, limit: int) -> Any:
    """The request's JSON body: 413 past ``limit`` bytes (read no further), 400 when it does not
    parse (nesting too deep included)."""
    too_large = APIError(
        f"the request body is larger than {limit} bytes", status=413, code="request_too_large"
    )
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise too_large
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(
            "We could not parse the JSON body of your request.", code="invalid_json"
        ) from None
    if not _is_text(body):
        raise APIError(
            "the JSON body holds a lone surrogate escape (such as \\udc80), which is not "
            "Unicode text", code="invalid_json",
        )  # fmt: skip
    return body


def check_model_name(name: Any, /, *, op: str) -> str:
    """``name`` when it is a model id a client can send (a non-empty string of Unicode text:
    no lone surrogate, which no JSON body or response can hold), else a ``ValueError`` naming
    ``model_name`` after ``op``: the rule of :func:`create_app` and of ``serve --model-name``
    (checked there before the model loads)."""
    if not isinstance(name, str) or not name or not _is_text(name):
        raise ValueError(
            f"{op}: model_name must be a non-empty string of Unicode text, got {name!r:.80}"
        )
    return name


def _is_text(value: Any) -> bool:
    """Whether every string in ``value`` (parsed JSON) is Unicode text: JSON's ``\\udc80``
    escape gives a lone surrogate, which no tokenizer or UTF-8 response can take."""
    try:  # the C encoder walks every string at once
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _prompt_ids(model: Any, source: Any, chat: bool, tools: Any = None) -> list[int]:
    tok = model.tokenizer
    if isinstance(source, list) and not chat:
        return list(source)
    if tok is None:
        raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
    try:
        text = (
            tok.apply_chat_template(source, add_generation_prompt=True, tools=tools)
            if chat
            else source
        )
        return list(tok.encode_prompt(text))
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc)[:1000], param="messages" if chat else "prompt") from None


def _job(served: _Served, s: Sampling, prompt: list[int]) -> Job:
    gen = served.engine.generator
    context = gen.max_seq_len
    if context is not None and len(prompt) >= context:
        raise APIError(
            f"the prompt has {len(prompt)} tokens; this model's context is {context} (prompt "
            "plus at least one new token)",
            param="messages", code="context_length_exceeded",
        )  # fmt: skip
    max_tokens = s.max_tokens
    if max_tokens is None:
        max_tokens = served.default_max_tokens
        if context is not None:
            max_tokens = min(max_tokens, context - len(prompt))
    elif context is not None and len(prompt) + max_tokens > context:
        raise APIError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) is more than "
            f"this model's context ({context})",
            param="max_tokens", code="context_length_exceeded",
        )  # fmt: skip
    vocab = vocab_size(served.engine.generator.model) or UNKNOWN_VOCAB  # None: not stated
    if min(prompt, default=0) < 0 or max(prompt, default=0) >= vocab:
        raise APIError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
    if not prompt:
        raise APIError("the prompt has no tokens", param="prompt")
    if s.top_k is not None and s.top_k > vocab:
        raise APIError(f"top_k: must be <= {vocab} (the vocabulary)", param="top_k")
    sampler = None
    sampling: dict[str, Any] | None = None  # make_sampler's keywords
    if s.temperature > 0:  # a seed drawn for an unseeded request: every rank draws alike
        seed = s.seed if s.seed is not None else secrets.randbits(63)
        sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                    "min_p": s.min_p, "seed": seed}  # fmt: skip
        sampler = make_sampler(**sampling)
    job = Job(prompt, max_tokens, sampler, s.top_logprobs, sampling=sampling)
    _sampling_fields(s, job, vocab, served.engine.generator.model.eos_token_ids)
    return job


def _sampling_fields(s: Sampling, job: Job, vocab: int, eos: Any) -> None:
    """``n``, the penalties, ``logit_bias``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``
    onto ``job``: 400 for a token id outside the vocabulary or ``min_tokens > max_tokens``."""
    for key in s.logit_bias:
        if key >= vocab:
            raise APIError(f"logit_bias: token id {key} is not in [0, {vocab})", param="logit_bias")
    if any(t >= vocab for t in s.stop_token_ids):
        raise APIError(f"stop_token_ids: token ids must lie in [0, {vocab})",
                       param="stop_token_ids")  # fmt: skip
    if s.min_tokens > job.max_tokens:
        raise APIError(f"min_tokens: must be <= max_tokens ({job.max_tokens}), got "
                       f"{s.min_tokens}", param="min_tokens")  # fmt: skip
    if s.stop_token_ids or s.ignore_eos:  # vLLM's rule: stop_token_ids and, unless ignored, EOS
        job.stop = tuple(sorted({*s.stop_token_ids, *(() if s.ignore_eos else eos)}))
    job.n = s.n
    job.more = [asyncio.Queue() for _ in range(s.n - 1)]
    job.options = {
        "frequency_penalty": s.frequency_penalty, "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty, "logit_bias": s.logit_bias or None,
        "min_tokens": s.min_tokens,
    }  # fmt: skip


class _Run:
    """A job's events as OpenAI objects: :meth:`whole` (one response) or :meth:`sse`."""

    def __init__(
        self, served: _Served, job: Job, s: Sampling, chat: bool, tokenizer: Any,
        tools: ToolAnswer,
    ) -> None:  # fmt: skip
        self.served, self.job, self.s, self.chat, self.tokenizer = served, job, s, chat, tokenizer
        self.tools = tools  # the answer's text and tool calls
        special = tools.parser is not None and tools.parser.special_tokens
        self.text = TextOut(tokenizer, s.stop, skip_special_tokens=not special)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tokens = 0
        self.finish: str | None = None
        self.logprobs: list[tuple[int, TokenEvent]] = []
        self.offset = 0  # characters of text so far (completions' text_offset)
        self.index = 0  # the choice (one of the job's n sequences)
        self.queue = job.queue  # its events

    async def next_event(self) -> tuple[str, Any]:
        """The job's next event; ``APIError`` for an error event, :class:`ClientGone` once the
        client went away (``_watch``'s event)."""
        while True:
            kind, payload = await self.queue.get()
            if kind == "gone":
                raise ClientGone
            if kind == "error":
                raise APIError(str(payload), status=400 if self.job.rid < 0 else 500,
                               type="invalid_request_error" if self.job.rid < 0
                               else "server_error")  # fmt: skip
            return kind, payload

    async def pieces(
        self, first: tuple[str, Any] | None = None
    ) -> AsyncIterator[tuple[str, list[TokenEvent]]]:
        """``(text, events)`` per token event (text may be ``""``), until the job finishes;
        :attr:`finish` is then set."""
        event = first
        while self.finish is None:
            if event is None:
                event = await self.next_event()
            kind, payload = event
            event = None
            if kind != "token":
                continue
            ev: TokenEvent = payload
            self.tokens += 1
            text = ""
            if ev.reason != "stop":  # a stop token is not part of the text
                text = self.text.step(ev.token)
            if ev.reason is not None or self.text.stopped:
                text += self.text.finish()  # may match a stop string in the last characters
                stopped = ev.reason == "stop" or self.text.stopped
                self.finish = "stop" if stopped else "length"
                if ev.reason is None:  # a stop string: the generator may stop now
                    self.job.finish_reason = self.finish  # counted as it ended, not as abort
                    self.served.engine.cancel(self.job, self.index)
            shown = [ev] if self.s.top_logprobs is not None and ev.reason != "stop" else []
            yield text, shown

    def usage(self) -> dict[str, Any]:
        prompt = len(self.job.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
            "prompt_tokens_details": {"cached_tokens": self.job.cached},
        }

    def timings(self) -> dict[str, Any]:
        """llama-server's ``timings``: prefill and decode times of this request."""
        job, end = self.job, time.perf_counter()
        prefill = max(0.0, job.first_token - job.admitted) if job.first_token else 0.0
        return {
            "cached_n": job.cached,
            "prompt_n": len(job.prompt) - job.cached,
            "prompt_ms": 1e3 * prefill,
            "predicted_n": self.tokens,
            "predicted_ms": 1e3 * (end - job.first_token) if job.first_token else 0.0,
            "queue_ms": 1e3 * max(0.0, job.admitted - job.submitted),
        }

    def _logprobs(self, events: list[TokenEvent], text: str) -> dict[str, Any] | None:
        if self.s.top_logprobs is None:
            return None
        tok = self.tokenizer

        def piece(t: int) -> str:
            return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

        records = [
            (_finite(lp), [(i, _finite(v)) for i, v in top])
            for lp, top in (ev.logprobs or (math.nan, []) for ev in events)
        ]
        if self.chat:
            return {
                "content": [
                    {
                        "token": piece(ev.token), "logprob": lp,
                        "bytes": list(piece(ev.token).encode()),
                        "top_logprobs": [
                            {"token": piece(i), "logprob": v, "bytes": list(piece(i).encode())}
                            for i, v in top
                        ],
                    }
                    for ev, (lp, top) in zip(events, records, strict=True)
                ]
            }  # fmt: skip
        out: dict[str, Any] = {
            "tokens": [piece(ev.token) for ev in events],
            "token_logprobs": [lp for lp, _ in records],
            "top_logprobs": [{piece(i): v for i, v in top} for _, top in records],
            "text_offset": [],
        }
        offset = self.offset
        for ev in events:
            out["text_offset"].append(offset)
            offset += len(piece(ev.token))
        return out

    async def whole(self) -> dict[str, Any]:
        texts: list[str] = []
        events: list[TokenEvent] = []
        async for text, shown in self.pieces():
            texts.append(text)
            events += shown
        text = "".join(texts)
        choice: dict[str, Any] = {"index": self.index, "logprobs": self._logprobs(events, text)}
        if self.chat:
            choice["message"] = {"role": "assistant", **self.tools.whole(text)}
        else:
            choice["text"] = text
        choice["finish_reason"] = self._reason()
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.name,
            "choices": [choice],
            "usage": self.usage(),
            "timings": self.timings(),
        }

    def _reason(self) -> str | None:
        """``finish_reason``: ``"tool_calls"`` for an answer that called tools."""
        return "tool_calls" if self.tools.called and self.finish == "stop" else self.finish

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None, logprobs: Any) -> str:
        choice: dict[str, Any] = {"index": self.index, "finish_reason": finish,
                                  "logprobs": logprobs}  # fmt: skip
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.name,
            "choices": [choice],
        }
        if self.s.include_usage:
            body["usage"] = None
        return _event(body)

    async def sse(
        self, first: tuple[str, Any] | None, watch: asyncio.Future[None]
    ) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield self._chunk({"role": "assistant", "content": ""}, None, None)
            async for text, shown in self.pieces(first):
                done = self.finish
                if self.chat:  # text and tool-call deltas (serve.tools.ToolAnswer)
                    lp = self._logprobs(shown, text) if shown else None
                    deltas = self.tools.delta(text, final=done is not None)
                    for delta in deltas or ([{"content": ""}] if lp is not None else []):
                        yield self._chunk(delta, None, lp)
                        lp = None
                elif text or shown:
                    lp = self._logprobs(shown, text)
                    self.offset += len(text)
                    yield self._chunk(text, None, lp)
                if done is not None:
                    yield self._chunk({} if self.chat else "", self._reason(), None)
            if self.s.include_usage:
                body: dict[str, Any] = {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.served.name, "choices": [],
                    "usage": self.usage(),
                }  # fmt: skip
                yield _event(body)
        except APIError as exc:  # after the headers went out: an error event ends the stream
            yield _event(exc.body())
        except ClientGone:
            return
        finally:
            self.served.engine.cancel(self.job, self.index)
            watch.cancel()
        yield "data: [DONE]\n\n"


def _choices_whole(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The answers of a job's choices (``n > 1``) as one: their choices in order, their
    ``completion_tokens`` summed."""
    out = dict(answers[0])
    out["choices"] = [a["choices"][0] for a in answers]
    usage = dict(out["usage"])
    usage["completion_tokens"] = sum(a["usage"]["completion_tokens"] for a in answers)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    out["usage"] = usage
    return out


async def _choices_sse(
    runs: list[_Run], first: tuple[str, Any], watch: asyncio.Future[None]
) -> AsyncIterator[str]:
    """One stream of every choice's chunks (``n > 1``), as they come; then the usage of all
    (with ``include_usage``) and ``[DONE]``."""
    merged: asyncio.Queue[str | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    async def pump(run: _Run, first: tuple[str, Any] | None) -> None:
        try:
            async for chunk in run.sse(first, loop.create_future()):
                if chunk != "data: [DONE]\n\n" and '"choices": []' not in chunk:  # ours below
                    await merged.put(chunk)
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(r, first if r.index == 0 else None)) for r in runs]
    try:
        left = len(runs)
        while left:
            chunk = await merged.get()
            if chunk is None:
                left -= 1
            else:
                yield chunk
        head = runs[0]
        if head.s.include_usage:
            usage = _choices_whole([{"choices": [None], "usage": r.usage()} for r in runs])
            body = {"id": head.id, "object": "chat.completion.chunk" if head.chat else
                    "text_completion", "created": head.created, "model": head.served.name,
                    "choices": [], "usage": usage["usage"]}  # fmt: skip
            yield _event(body)
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        watch.cancel()
        head = runs[0]
        head.served.engine.cancel(head.job)


def _finite(value: float) -> float | None:
    """``value``, or ``None`` (JSON ``null``) when it is not a finite number: ``-inf`` (a token
    the model rules out) or NaN are not JSON."""
    return value if math.isfinite(value) else None


def _event(body: dict[str, Any]) -> str:
    """One server-sent event of strict JSON (``NaN``/``Infinity`` raise, never go out)."""
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"
