"""The OpenAI-compatible ASGI app: :func:`create_app` (Starlette) over one :class:`~portable_llm.
serve.engine.Engine`.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and ``GET /health``.
Streams are server-sent events (``data: {...}`` chunks, then ``data: [DONE]``). Every error is
an OpenAI error body; a client that goes away is cancelled and its pages come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from portable_llm.generation.sampler import make_sampler
from portable_llm.serve.engine import Engine, Job, TokenEvent
from portable_llm.serve.protocol import APIError, Sampling, error_body, read_chat, read_completion
from portable_llm.serve.text import TextOut

__all__ = ["create_app"]

#: Seconds between checks that a waiting client is still connected.
POLL = 0.5
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
    default_max_tokens: int
    created: int
    prompts: ThreadPoolExecutor  # renders chat templates and tokenizes, off the event loop


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
        ``/health`` stays open.
    max_queue : int, >= 0
        Requests that may wait to join the batch; the next one gets 429 with ``Retry-After``.
    max_batch, prefill_chunk, pool_pages, page_size, prefix_cache
        As for :class:`~portable_llm.serve.engine.Engine`.
    default_max_tokens : int
        ``max_tokens`` of a request that gives none (less when the context is shorter).

    The engine thread starts with the app's lifespan (or at the first request when the app is
    mounted without one) and stops at its end; ``app.state.engine`` is the
    :class:`~portable_llm.serve.engine.Engine`.
    """
    engine = Engine(
        model, max_batch=max_batch, prefill_chunk=prefill_chunk, pool_pages=pool_pages,
        page_size=page_size, prefix_cache=prefix_cache,
    )  # fmt: skip
    served = _Served(
        engine, model_name, frozenset((model_name, *aliases)), api_key, max_queue,
        default_max_tokens, int(time.time()),
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="portable-llm-prompt"),
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        engine.start()
        try:
            yield
        finally:
            engine.close()
            served.prompts.shutdown(wait=False, cancel_futures=True)

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
        return JSONResponse({"status": "ok", **engine.health()})

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        lifespan=lifespan,
    )
    app.state.engine = engine
    return app


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
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        key.strip().encode(), served.api_key.encode()
    ):
        raise APIError(
            "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
            status=401, param=None, code="invalid_api_key",
        )  # fmt: skip


# -- one request ------------------------------------------------------------------------------
async def _generate(served: _Served, request: Request, *, chat: bool) -> Response:
    _authorize(served, request)
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
    loop = asyncio.get_running_loop()
    prompt = await loop.run_in_executor(served.prompts, _prompt_ids, model, source, chat)
    job = _job(served, sampling, prompt)
    if engine.queue_depth >= served.max_queue:
        raise APIError(
            f"{engine.queue_depth} requests are waiting (--max-queue {served.max_queue}); "
            "retry later",
            status=429, type="rate_limit_exceeded", code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )  # fmt: skip
    job.loop = loop
    engine.submit(job)
    run = _Run(served, job, sampling, chat, model.tokenizer)
    if sampling.stream:
        try:  # an error before the first token is still an HTTP error
            first = await run.next_event(request)
        except ClientGone:
            engine.cancel(job)
            return Response(status_code=499)
        except BaseException:
            engine.cancel(job)
            raise
        return StreamingResponse(
            run.sse(request, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        return JSONResponse(await run.whole(request))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    finally:
        engine.cancel(job)  # a no-op once it finished


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
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(
            "We could not parse the JSON body of your request.", code="invalid_json"
        ) from None


def _prompt_ids(model: Any, source: Any, chat: bool) -> list[int]:
    tok = model.tokenizer
    if isinstance(source, list) and not chat:
        return list(source)
    if tok is None:
        raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
    try:
        text = tok.apply_chat_template(source, add_generation_prompt=True) if chat else source
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
    vocab = served.engine.model.config.vocab_size
    if min(prompt, default=0) < 0 or max(prompt, default=0) >= vocab:
        raise APIError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
    if not prompt:
        raise APIError("the prompt has no tokens", param="prompt")
    if s.top_k is not None and s.top_k > vocab:
        raise APIError(f"top_k: must be <= {vocab} (the vocabulary)", param="top_k")
    sampler = None
    if s.temperature > 0:
        sampler = make_sampler(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed
        )
    return Job(prompt, max_tokens, sampler, s.top_logprobs)


class _Run:
    """A job's events as OpenAI objects: :meth:`whole` (one response) or :meth:`sse`."""

    def __init__(self, served: _Served, job: Job, s: Sampling, chat: bool, tokenizer: Any):
        self.served, self.job, self.s, self.chat, self.tokenizer = served, job, s, chat, tokenizer
        self.text = TextOut(tokenizer, s.stop)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tokens = 0
        self.finish: str | None = None
        self.logprobs: list[tuple[int, TokenEvent]] = []
        self.offset = 0  # characters of text so far (completions' text_offset)

    async def next_event(self, request: Request) -> tuple[str, Any]:
        """The job's next event, checking the client while it waits; ``APIError`` for an
        error event."""
        while True:
            try:
                kind, payload = await asyncio.wait_for(self.job.queue.get(), POLL)
            except asyncio.TimeoutError:
                if await _gone(request):
                    raise ClientGone from None
                continue
            if kind == "error":
                raise APIError(str(payload), status=400 if self.job.rid < 0 else 500,
                               type="invalid_request_error" if self.job.rid < 0
                               else "server_error")  # fmt: skip
            return kind, payload

    async def pieces(
        self, request: Request, first: tuple[str, Any] | None = None
    ) -> AsyncIterator[tuple[str, list[TokenEvent]]]:
        """``(text, events)`` per token event (text may be ``""``), until the job finishes;
        :attr:`finish` is then set."""
        event = first
        while self.finish is None:
            if event is None:
                event = await self.next_event(request)
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
                self.finish = "length" if ev.reason == "length" else "stop"
                text += self.text.finish()
                if ev.reason is None:  # a stop string: the generator may stop now
                    self.served.engine.cancel(self.job)
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

        records = [ev.logprobs or (float("nan"), []) for ev in events]
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

    async def whole(self, request: Request) -> dict[str, Any]:
        texts: list[str] = []
        events: list[TokenEvent] = []
        async for text, shown in self.pieces(request):
            texts.append(text)
            events += shown
        text = "".join(texts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish,
                                  "logprobs": self._logprobs(events, text)}  # fmt: skip
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.name,
            "choices": [choice],
            "usage": self.usage(),
            "timings": self.timings(),
        }

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None, logprobs: Any) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
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
        return f"data: {json.dumps(body)}\n\n"

    async def sse(self, request: Request, first: tuple[str, Any]) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield self._chunk({"role": "assistant", "content": ""}, None, None)
            async for text, shown in self.pieces(request, first):
                done = self.finish
                if text or shown:
                    lp = self._logprobs(shown, text)
                    self.offset += len(text)
                    yield self._chunk({"content": text} if self.chat else text, None, lp)
                if done is not None:
                    yield self._chunk({} if self.chat else "", done, None)
            if self.s.include_usage:
                body: dict[str, Any] = {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.served.name, "choices": [],
                    "usage": self.usage(),
                }  # fmt: skip
                yield f"data: {json.dumps(body)}\n\n"
        except APIError as exc:  # after the headers went out: an error event ends the stream
            yield f"data: {json.dumps(exc.body())}\n\n"
        except ClientGone:
            return
        finally:
            self.served.engine.cancel(self.job)
        yield "data: [DONE]\n\n"


async def _gone(request: Request) -> bool:
    with contextlib.suppress(Exception):
        return await request.is_disconnected()
    return False
