"""The server's engine: one :class:`~portable_llm.generation.batch.BatchGenerator` stepped by one
thread for every client.

HTTP handlers (on the event loop) :meth:`Engine.submit` a :class:`Job` and read its events from
an ``asyncio.Queue``; the engine thread takes new jobs and cancellations between steps (a job
joins the batch at the next step), steps the generator while it has work, and posts each job's
events back to its loop with ``call_soon_threadsafe``. Only that thread touches the generator,
its pools and its prefix cache; the handlers read :meth:`Engine.health`, a snapshot the thread
refreshes after every step.

A model split over processes (torchrun or mlx.launch ranks) steps in lockstep: its forward is
a collective. Rank 0's engine (``broadcast=``) sends, before each step, the events it applied
since the last one (the requests it added, with their sampler's keywords and a drawn seed; the
sequences it cancelled), whether it steps, and at the end that it stopped; every other rank's
engine runs :meth:`Engine.follow`, which applies the same events to its own generator and steps
when rank 0 does, so every rank steps the same batch and draws the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from portable_llm.core.arrays import to_numpy
from portable_llm.generation.batch import BatchGenerator, Request
from portable_llm.generation.sampler import Sampler, make_sampler
from portable_llm.ops.sampling import greedy, log_softmax

__all__ = ["HEARTBEAT", "Engine", "EngineObserver", "Job", "TokenEvent"]

#: Seconds between the messages rank 0's engine sends to the other ranks while nothing runs (a
#: collective that waits longer may fail: torch's gloo gives up after 30 minutes).
HEARTBEAT = 60.0


@dataclass
class TokenEvent:
    """One token of a job: its id, its finish reason (``None``, ``"stop"``, ``"length"``) and,
    when the job asked for log-probabilities, ``(logprob, [(id, logprob), ...])``."""

    token: int
    reason: str | None
    logprobs: tuple[float, list[tuple[int, float]]] | None = None
    index: int = 0  # which of the job's n sequences (OpenAI's choice index)


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
    n: int = 1  # sequences from the prompt (prefilled once): the choices
    options: dict[str, Any] = field(default_factory=dict)  # Request's penalties, min_tokens
    response_format: Any = None  # a Grammar: constrained decoding (serve.tools)
    # make_sampler's keywords of ``sampler``, the seed drawn: what the other ranks of a model
    # split over processes rebuild it from (None: greedy)
    sampling: dict[str, Any] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    rid: int = -1
    submitted: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    cached: int = 0
    last_token: dict[int, float] = field(default_factory=dict)  # by choice index
    generated: int = 0  # tokens drawn so far (every choice's)
    finish_reason: str | None = None  # set by the app when a stop string ends the job
    _records: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    more: list[asyncio.Queue[tuple[str, Any]]] = field(default_factory=list)  # choices 1..n-1
    left: int = 0  # sequences running (engine thread)
    dropping: set[int] = field(default_factory=set)  # choices cancelled (cancel(job, index))

    def queue_of(self, index: int) -> asyncio.Queue[tuple[str, Any]]:
        """The events of choice ``index``: ``queue`` for the first, ``more`` for the others."""
        return self.queue if index == 0 else self.more[index - 1]

    def post(self, kind: str, payload: Any) -> None:
        """Hand an event to the job's loop (from the engine thread); dropped once it closed.
        A token goes to its choice's queue, anything else to every choice's."""
        queues = [self.queue, *self.more]
        if kind == "token" and self.more:
            queues = [self.queue_of(payload.index)]
        for queue in queues:
            if self.loop is None:
                queue.put_nowait((kind, payload))
                continue
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads any more
                self.loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))


def _logprob_sampler(job: Job, to_np: Callable[[Any], np.ndarray]) -> Sampler:
    """``job.sampler`` (greedy when ``None``) that also records each draw's log-probability
    and the ``job.top_logprobs`` most likely ids, from the model's logits (before any
    temperature or filter): :func:`~portable_llm.ops.sampling.log_softmax` in float64, whose
    values may be ``-inf`` (a token the model rules out) or NaN (logits holding ``+inf`` or
    NaN); the server shows those as ``null``."""
    inner = job.sampler if job.sampler is not None else greedy
    k = job.top_logprobs or 0

    def sampler(logits: Any) -> Any:
        ids = inner(logits)
        row = np.asarray(to_np(logits), dtype=np.float64).reshape(-1)  # (V,)
        with np.errstate(all="ignore"):  # inf - inf: NaN, shown as null
            lp = log_softmax(np, row)
        token = int(np.asarray(to_np(ids)).reshape(-1)[0])
        best = np.argsort(-lp, kind="stable")[:k]
        chosen = float(lp[token]) if 0 <= token < lp.shape[0] else float("nan")
        job._records.append((chosen, [(int(i), float(lp[i])) for i in best]))
        return ids

    return sampler


def _request_of(spec: dict[str, Any]) -> Request | None:
    """The :class:`Request` of an ``add`` event (the other ranks'): its sampler rebuilt from
    ``sampling`` (``make_sampler``'s keywords, the seed rank 0 drew); ``None`` when it does not
    build (rank 0 built it)."""
    options = dict(spec)
    sampling = options.pop("sampling")
    try:
        sampler = None if sampling is None else make_sampler(**sampling)
        return Request(sampler=sampler, **options)
    except (ValueError, TypeError):
        return None


class EngineObserver(Protocol):
    """What the engine thread tells about its jobs (times from ``time.perf_counter``), before
    the job's client may see it: :class:`~portable_llm.serve.metrics.ServeMetrics` listens."""

    def admitted(self, job: Job, now: float) -> None:
        """``job`` joined the batch (``job.cached`` prompt tokens from the prefix cache)."""

    def token(self, job: Job, now: float, gap: float | None) -> None:
        """``job`` drew a token (``job.generated`` so far, every choice's): ``gap`` s after its
        choice's token before, ``None`` for a choice's first."""

    def ended(self, job: Job, now: float, reason: str) -> None:
        """``job`` left the engine: ``stop``, ``length``, ``abort`` (cancelled) or ``error``."""


class Engine:
    """One batch generator for every client, stepped by one thread.

    Parameters
    ----------
    model : Model
    max_batch, prefill_chunk, pool_pages, page_size
        As for :class:`~portable_llm.generation.batch.BatchGenerator`.
    prefix_cache : bool
        Reuse the pages of earlier prompts (default ``True``).
    broadcast : callable, optional
        For a model split over processes: ``broadcast(message)`` returns rank 0's message on
        every rank (a collective, e.g. :meth:`portable_llm.partition.Engine.broadcast_object`).
        Rank 0's engine sends its events through it; the other ranks' engines, made with the
        same options, run :meth:`follow`.

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
        broadcast: Callable[[Any], Any] | None = None,
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
        self._live: set[int] = set()  # id() of jobs submitted and not yet finished or dropped
        self._jobs: dict[int, Job] = {}  # by request id, engine thread only
        self._thread: threading.Thread | None = None
        self._stop = False
        self.max_decoded = 0
        self.steps = 0
        self.cancelled = 0
        self.observer: EngineObserver | None = None  # told of each job's progress (/metrics)
        self._health: dict[str, Any] = {}
        self._counted = 0.0  # when the idle cached pages were last counted
        self._broadcast = broadcast
        self._events: list[tuple[Any, ...]] = []  # applied since the last message (rank 0)
        self._released = broadcast is None  # the other ranks were told to stop
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
            if self._thread.is_alive():  # still in a step: it tells the other ranks itself
                return
            self._thread = None
        self._release()  # a thread never started (or gone): the other ranks stop too

    @property
    def queue_depth(self) -> int:
        """Jobs submitted and not yet admitted to the batch."""
        with self._cond:
            return len(self._queued)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet finished, failed or cancelled (running or waiting)."""
        with self._cond:
            return len(self._live)

    def submit(self, job: Job) -> None:
        """Queue ``job``; it joins the batch at the next step."""
        self.start()
        job.submitted = time.perf_counter()
        with self._cond:
            self._inbox.append(job)
            self._queued.add(id(job))
            self._live.add(id(job))
            self._cond.notify()

    def cancel(self, job: Job, index: int | None = None) -> None:
        """Drop ``job`` (a client went away, or a stop string ended it): its pages come back at
        the next step. ``index``: only that choice of a job with ``n > 1``."""
        if index is not None and job.n > 1:
            with self._cond:
                job.dropping.add(index)
                self._cancels.append(job)
                self._cond.notify()
            return
        with self._cond:
            job.dropping.update(range(job.n))
            if job in self._inbox:
                self._inbox.remove(job)
            else:
                self._cancels.append(job)
            self._queued.discard(id(job))
            self._live.discard(id(job))
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
            "running": len({id(job) for job in self._jobs.values()}),  # jobs, not sequences
            "free_pages": free,
            "cached_pages": cached,
            "pool_pages": min((p.num_pages for p in gen.pools), default=0),
            "steps": self.steps,
        }

    def _run(self) -> None:
        gen = self.generator
        beat = None if self._broadcast is None else HEARTBEAT  # idle: tell the other ranks
        while True:
            with self._cond:
                while not (self._stop or self._inbox or self._cancels or gen.has_work):
                    if not self._cond.wait(beat):
                        break
                if self._stop:
                    break
                adds, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            try:
                for job in adds:
                    self._add(job)
                for job in cancels:
                    if self._drop(job):  # the job's last sequence went
                        self.cancelled += 1
                        self._ended(job, job.finish_reason or "abort")
                step = gen.has_work
                self._publish(step=step)
                if step:
                    self._step()
            except Exception as exc:  # a bug of ours: fail the requests, keep serving
                self._fail_all(f"internal error: {type(exc).__name__}: {str(exc)[:500]}")
            with self._cond:
                self._snapshot()
        self._fail_all("the server is shutting down")
        self._release()

    # -- the other ranks of a model split over processes ----------------------------------------
    def _publish(self, *, step: bool, stop: bool = False) -> None:
        """Rank 0: send the events applied since the last message, and whether it steps now
        (or stops), to the other ranks (nothing without ``broadcast``)."""
        if self._broadcast is None:
            return
        events, self._events = self._events, []
        self._broadcast((events, step, stop))

    def _release(self) -> None:
        """Rank 0: tell the other ranks to stop (once; they may be gone already)."""
        if self._released:
            return
        self._released = True
        with contextlib.suppress(Exception):
            self._publish(step=False, stop=True)

    def _cancel(self, rid: int) -> None:
        """Cancel sequence ``rid`` in the generator, and on the other ranks before their next
        step."""
        if self._broadcast is not None:
            self._events.append(("cancel", rid))
        self.generator.cancel(rid)

    def follow(self) -> None:
        """Run a rank other than 0 of a model split over processes: apply rank 0's events to
        this rank's generator, step when rank 0 steps, until rank 0 stops (its engine's close,
        or the end of its thread). Runs in the calling thread; a failed step is rank 0's too
        (same batch, same logits), so its requests go as they went there.

        Raises
        ------
        RuntimeError
            Without ``broadcast``, or when this rank's generator gave a request another id than
            rank 0's did (the ranks no longer hold the same batch).
        """
        if self._broadcast is None:
            raise RuntimeError("Engine.follow: needs broadcast= (rank 0's messages)")
        gen = self.generator
        while True:
            events, step, stop = self._broadcast(None)
            for kind, rid, *spec in events:
                if kind == "cancel":
                    gen.cancel(rid)
                    continue
                got = _request_of(spec[0])
                if got is None or gen.add(got) != rid:
                    raise RuntimeError(
                        f"Engine.follow: rank 0 added request {rid}, which this rank could not "
                        "add as the same id: the ranks no longer step the same batch"
                    )
            if stop:
                return
            if step:
                with contextlib.suppress(Exception):  # rank 0 failed it alike
                    gen.step()

    def _add(self, job: Job) -> None:
        sampler = job.sampler
        if job.top_logprobs is not None:
            sampler = _logprob_sampler(job, self._to_np)
        spec = {
            "prompt_ids": job.prompt, "max_new_tokens": job.max_tokens, "stop": job.stop,
            "response_format": job.response_format, "n": job.n, **job.options,
        }  # fmt: skip
        try:
            if self._broadcast is not None and job.sampler is not None and job.sampling is None:
                raise ValueError(
                    "a model split over processes needs the sampler's keywords (Job.sampling) "
                    "to draw the same tokens on every rank"
                )
            job.rid = self.generator.add(Request(sampler=sampler, **spec))
            job.left = job.n
        except (ValueError, TypeError) as exc:
            with self._cond:
                self._queued.discard(id(job))
                self._live.discard(id(job))
            job.post("error", str(exc)[:1000])
            return
        for i in range(job.n):
            self._jobs[job.rid + i] = job
        if self._broadcast is not None:
            self._events.append(("add", job.rid, {**spec, "sampling": job.sampling}))

    def _drop(self, job: Job) -> bool:
        """Cancel the sequences of ``job`` in ``job.dropping`` still running; whether that
        ended the job (none of its sequences runs any more)."""
        rids = [job.rid + i for i in sorted(job.dropping) if self._jobs.get(job.rid + i) is job]
        for rid in rids:
            self._cancel(rid)
            del self._jobs[rid]
        job.left -= len(rids)
        if not rids or job.left:
            return False
        with self._cond:
            self._live.discard(id(job))
        return True

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
            if self.observer is not None:
                self.observer.admitted(job, start)
            job.post("admitted", cached)
        decoded = 0
        for rid, token, reason in events:
            job = self._jobs[rid]
            if job.first_token:
                decoded += 1
            else:
                job.first_token = now
            index = rid - job.rid  # the choice: its own gaps between tokens
            gap = now - job.last_token[index] if index in job.last_token else None
            job.generated, job.last_token[index] = job.generated + 1, now
            if reason is not None:
                del self._jobs[rid]
                job.left -= 1
            if self.observer is not None:  # before the client may see the token
                self.observer.token(job, now, gap)
                if reason is not None and not job.left:
                    self.observer.ended(job, now, reason)
            record = job._records.pop(0) if job.top_logprobs is not None else None
            job.post("token", TokenEvent(token, reason, record, index))
            if reason is not None and not job.left:
                with self._cond:
                    self._live.discard(id(job))
        self.max_decoded = max(self.max_decoded, decoded)

    def _ended(self, job: Job, reason: str) -> None:
        """Tell the observer that ``job`` was dropped (``reason``: abort, error, or the app's)."""
        if self.observer is not None:
            self.observer.ended(job, time.perf_counter(), reason)

    def _fail_all(self, message: str) -> None:
        for job in {id(j): j for j in self._jobs.values()}.values():  # once per job
            job.post("error", message)
            self._ended(job, "error")
        for rid in list(self._jobs):
            with contextlib.suppress(Exception):  # the generator may be what failed
                self._cancel(rid)
        self._jobs.clear()
        with self._cond:
            for job in self._inbox:
                job.post("error", message)
            self._inbox.clear()
            self._queued.clear()
            self._live.clear()
