"""The server's engine: one :class:`~portable_llm.generation.batch.BatchGenerator` stepped by one
thread for every client.

HTTP handlers (on the event loop) :meth:`Engine.submit` a :class:`Job` and read its events from
an ``asyncio.Queue``; the engine thread takes new jobs and cancellations between steps (a job
joins the batch at the next step), steps the generator while it has work, and posts each job's
events back to its loop with ``call_soon_threadsafe``. Only that thread touches the generator,
its pools and its prefix cache; the handlers read :meth:`Engine.health`, a snapshot the thread
refreshes after every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from portable_llm.core.arrays import to_numpy
from portable_llm.generation.batch import BatchGenerator, Request
from portable_llm.generation.sampler import Sampler
from portable_llm.ops.sampling import greedy

__all__ = ["Engine", "Job", "TokenEvent"]


@dataclass
class TokenEvent:
    """One token of a job: its id, its finish reason (``None``, ``"stop"``, ``"length"``) and,
    when the job asked for log-probabilities, ``(logprob, [(id, logprob), ...])``."""

    token: int
    reason: str | None
    logprobs: tuple[float, list[tuple[int, float]]] | None = None


@dataclass(eq=False)  # compared by identity (the engine finds a job in its lists)
class Job:
    """One request as the engine runs it; its events go to ``queue`` on ``loop``.

    Events: ``("admitted", cached_tokens)``, ``("token", TokenEvent)``, ``("error", message)``.
    """

    prompt: list[int]
    max_tokens: int
    sampler: Sampler | None = None
    top_logprobs: int | None = None  # None: no log-probabilities; 0: the chosen token's only
    stop: tuple[int, ...] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    rid: int = -1
    submitted: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    cached: int = 0
    _records: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    def post(self, kind: str, payload: Any) -> None:
        """Hand an event to the job's loop (from the engine thread); dropped once it closed."""
        if self.loop is None:
            self.queue.put_nowait((kind, payload))
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


def _logprob_sampler(job: Job, to_np: Callable[[Any], np.ndarray]) -> Sampler:
    """``job.sampler`` (greedy when ``None``) that also records each draw's log-probability
    and the ``job.top_logprobs`` most likely ids, from the model's logits (before any
    temperature or filter)."""
    inner = job.sampler if job.sampler is not None else greedy
    k = job.top_logprobs or 0

    def sampler(logits: Any) -> Any:
        ids = inner(logits)
        row = np.asarray(to_np(logits), dtype=np.float64).reshape(-1)  # (V,)
        top = row.max()
        lp = row - (top + np.log(np.exp(row - top).sum()))
        token = int(np.asarray(to_np(ids)).reshape(-1)[0])
        best = np.argsort(-lp, kind="stable")[:k]
        chosen = float(lp[token]) if 0 <= token < lp.shape[0] else float("nan")
        job._records.append((chosen, [(int(i), float(lp[i])) for i in best]))
        return ids

    return sampler


class Engine:
    """One batch generator for every client, stepped by one thread.

    Parameters
    ----------
    model : Model
    max_batch, prefill_chunk, pool_pages, page_size
        As for :class:`~portable_llm.generation.batch.BatchGenerator`.
    prefix_cache : bool
        Reuse the pages of earlier prompts (default ``True``).

    Attributes
    ----------
    generator : BatchGenerator
        Touched by the engine thread only.
    max_decoded : int
        The most requests decoded in one step so far (tokens of requests past their first).
    steps : int
        Steps run so far.
    cancelled : int
        Requests dropped before they finished (clients gone, stop strings).
    """

    def __init__(
        self,
        model: Any,
        *,
        max_batch: int = 32,
        prefill_chunk: int = 512,
        pool_pages: int | None = None,
        page_size: int = 16,
        prefix_cache: bool = True,
    ) -> None:
        self.model = model
        self.generator = BatchGenerator(
            model, max_batch=max_batch, prefill_chunk=prefill_chunk, pool_pages=pool_pages,
            page_size=page_size, prefix_cache=prefix_cache,
        )  # fmt: skip
        self._to_np = to_numpy
        self._cond = threading.Condition()
        self._inbox: list[Job] = []
        self._cancels: list[Job] = []
        self._queued: set[int] = set()  # id() of jobs submitted and not yet admitted
        self._jobs: dict[int, Job] = {}  # by request id, engine thread only
        self._thread: threading.Thread | None = None
        self._stop = False
        self.max_decoded = 0
        self.steps = 0
        self.cancelled = 0
        self._health: dict[str, Any] = {}
        self._counted = 0.0  # when the idle cached pages were last counted
        self._snapshot()

    # -- the handlers' side ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (once; later calls do nothing while it runs)."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="portable-llm-engine")
            self._thread.daemon = True
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; running jobs get an ``("error", ...)`` event."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def queue_depth(self) -> int:
        """Jobs submitted and not yet admitted to the batch."""
        with self._cond:
            return len(self._queued)

    def submit(self, job: Job) -> None:
        """Queue ``job``; it joins the batch at the next step."""
        self.start()
        job.submitted = time.perf_counter()
        with self._cond:
            self._inbox.append(job)
            self._queued.add(id(job))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop ``job`` (a client went away, or a stop string ended it): its pages come back at
        the next step."""
        with self._cond:
            if job in self._inbox:
                self._inbox.remove(job)
            else:
                self._cancels.append(job)
            self._queued.discard(id(job))
            self._cond.notify()

    def health(self) -> dict[str, Any]:
        """``running``, ``queue_depth``, ``free_pages``, ``cached_pages``, ``pool_pages``,
        ``steps``: as of the last step."""
        with self._cond:
            return {**self._health, "queue_depth": len(self._queued)}

    # -- the engine thread ----------------------------------------------------------------------
    def _snapshot(self) -> None:
        """Refresh :meth:`health`; the idle cached pages (a walk over the prefix cache) only
        when the batch is empty or every 0.25 s."""
        gen = self.generator
        cache = gen.prefix_cache
        now = time.monotonic()
        cached = self._health.get("cached_pages", 0)
        if cache is not None and (not gen.has_work or now - self._counted >= 0.25):
            cached, self._counted = cache.num_idle, now
        free = min((p.num_free for p in gen.pools), default=0)  # no pools: a model without pages
        self._health = {
            "running": len(self._jobs),
            "free_pages": free,
            "cached_pages": cached,
            "pool_pages": min((p.num_pages for p in gen.pools), default=0),
            "steps": self.steps,
        }

    def _run(self) -> None:
        gen = self.generator
        while True:
            with self._cond:
                while not (self._stop or self._inbox or self._cancels or gen.has_work):
                    self._cond.wait()
                if self._stop:
                    break
                adds, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            try:
                for job in adds:
                    self._add(job)
                for job in cancels:
                    if job.rid in self._jobs:
                        gen.cancel(job.rid)
                        del self._jobs[job.rid]
                        self.cancelled += 1
                if gen.has_work:
                    self._step()
            except Exception as exc:  # a bug of ours: fail the requests, keep serving
                self._fail_all(f"internal error: {type(exc).__name__}: {str(exc)[:500]}")
            with self._cond:
                self._snapshot()
        self._fail_all("the server is shutting down")

    def _add(self, job: Job) -> None:
        sampler = job.sampler
        if job.top_logprobs is not None:
            sampler = _logprob_sampler(job, self._to_np)
        try:
            job.rid = self.generator.add(Request(job.prompt, job.max_tokens, sampler, job.stop))
        except (ValueError, TypeError) as exc:
            with self._cond:
                self._queued.discard(id(job))
            job.post("error", str(exc)[:1000])
            return
        self._jobs[job.rid] = job

    def _step(self) -> None:
        gen = self.generator
        start = time.perf_counter()
        try:
            events = gen.step()
        except Exception as exc:  # the generator freed every page and dropped every request
            self._fail_all(f"generation failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        self.steps += 1
        for rid, cached in gen.admitted:
            job = self._jobs[rid]
            job.admitted, job.cached = start, cached
            with self._cond:
                self._queued.discard(id(job))
            job.post("admitted", cached)
        decoded = 0
        for rid, token, reason in events:
            job = self._jobs[rid]
            if job.first_token:
                decoded += 1
            else:
                job.first_token = now
            record = job._records.pop(0) if job.top_logprobs is not None else None
            job.post("token", TokenEvent(token, reason, record))
            if reason is not None:
                del self._jobs[rid]
        self.max_decoded = max(self.max_decoded, decoded)

    def _fail_all(self, message: str) -> None:
        for job in self._jobs.values():
            job.post("error", message)
        for rid in list(self._jobs):
            with contextlib.suppress(Exception):  # the generator may be what failed
                self.generator.cancel(rid)
        self._jobs.clear()
        with self._cond:
            for job in self._inbox:
                job.post("error", message)
            self._inbox.clear()
            self._queued.clear()
