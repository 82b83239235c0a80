"""Continuous batching with chunked prefill: :class:`BatchGenerator` and :func:`batch_generate`.

Requests (:class:`Request`) arrive at any time; each keeps its keys and values in pages of one
:class:`~portable_llm.caches.paged.PagePool` per layer. Each :meth:`BatchGenerator.step`:

1. admits waiting requests, first come first served, while fewer than ``max_batch`` requests
   are admitted and the pools have room for the next one's pages (its prompt plus
   ``max_new_tokens``, reserved at once, so a running request never runs out of pages);
2. decodes one token for every running request, in one batched forward (``B`` running
   requests, ``L = 1``; :mod:`~portable_llm.decoder.paged_step`);
3. advances the prefill of admitted requests by at most ``prefill_chunk`` prompt tokens in
   total, in arrival order, so a long prompt never stalls the others; a request whose prefill
   completes samples its first token in that step and joins the decode batch in the next.

A request ends at one of its stop tokens (``"stop"``) or after ``max_new_tokens`` tokens
(``"length"``); its pages are freed at once for the requests that wait.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from portable_llm.caches.paged import PagedKVCache, PagePool
from portable_llm.core.checks import check_int, check_optional_int
from portable_llm.decoder.paged_step import forward
from portable_llm.generation.generate import _ids, _stop_ids, stop_tokens
from portable_llm.generation.sampler import Sampler
from portable_llm.ops.sampling import greedy

__all__ = ["BatchGenerator", "Request", "batch_generate"]

OP = "BatchGenerator"


@dataclass
class Request:
    """One generation request for a :class:`BatchGenerator`.

    Parameters
    ----------
    prompt_ids : sequence or 1-D integer array of token ids, non-empty
    max_new_tokens : int, >= 1
        The most tokens to generate (a final stop token included).
    sampler : callable, optional
        ``sampler(logits (1, V)) -> ids (1,)`` (:func:`~portable_llm.make_sampler`), called
        once per token of this request; default :func:`~portable_llm.greedy`.
    stop : iterable of int, optional
        Stop token ids; default the model's EOS ids (:func:`~portable_llm.generation.generate.
        stop_tokens`, as :func:`~portable_llm.generate`). ``()``: none.
    """

    prompt_ids: Sequence[int] | Any
    max_new_tokens: int = 256
    sampler: Sampler | None = None
    stop: Iterable[int] | None = None


@dataclass
class _Seq:
    """A request inside the generator: its prompt, pages and progress."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler | None
    stops: frozenset[int]
    caches: list[PagedKVCache] = field(default_factory=list)  # one per layer, once admitted
    prefilled: int = 0  # prompt tokens in the caches
    generated: int = 0
    pending: int = -1  # the last token sampled, fed to the model by the next decode step


class BatchGenerator:
    """Generate for many requests at once: continuous batching with chunked prefill.

    See the module docstring for the scheduling rule. Each request's tokens are those it would
    get alone (greedy: the same ids as :func:`~portable_llm.generate`, up to ties within the
    dtype's rounding).

    Parameters
    ----------
    model : Model
    max_batch : int, >= 1
        The most requests admitted at once (decoding or in prefill).
    prefill_chunk : int, >= 1
        The most prompt tokens prefilled per step, over all requests.
    pool_pages : int, >= 1, optional
        Pages per layer's pool. Requests wait while the pool is full, and :meth:`add` refuses
        one that could never fit. ``None`` (default): the pools start with room for
        ``max_batch`` sequences of 256 tokens and grow (doubling) when a request needs more.
    page_size : int, >= 1
        Tokens per page.
    max_seq_len : int, >= 1, optional
        The longest sequence (prompt plus ``max_new_tokens``) :meth:`add` accepts; default the
        config's ``max_position_embeddings`` (no limit when it has none).

    Attributes
    ----------
    pools : list of PagePool
        One per layer, ``(pool_pages, H_kv, page_size, D)`` pages of the model's dtype; a
        sequence holds the same page ids in each.
    max_seq_len : int or None

    Notes
    -----
    An exception inside :meth:`step` (a sampler that raises, logits that are all NaN) frees
    every page and drops every request before it propagates: the generator is then empty.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_batch: int = 8,
        prefill_chunk: int = 512,
        pool_pages: int | None = None,
        page_size: int = 16,
        max_seq_len: int | None = None,
    ) -> None:
        self.model = model
        self.max_batch = check_int(OP, "max_batch", max_batch, low=1)
        self.prefill_chunk = check_int(OP, "prefill_chunk", prefill_chunk, low=1)
        page_size = check_int(OP, "page_size", page_size, low=1)
        fixed = check_optional_int(OP, "pool_pages", pool_pages, low=1)
        limit = model.config.max_position_embeddings if max_seq_len is None else max_seq_len
        self.max_seq_len = check_optional_int(OP, "max_seq_len", limit, low=1)
        self._grows = fixed is None
        pages = fixed if fixed is not None else self.max_batch * math.ceil(256 / page_size)
        cfg = model.config
        shape = (pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        where = {"backend": model.backend.name, "device": model.device}
        self.pools = [PagePool(*shape, model.dtype, **where) for _ in range(cfg.num_hidden_layers)]
        self._default_stops = frozenset(stop_tokens(model))
        self._next_id = 0
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        self._running: list[_Seq] = []

    @property
    def has_work(self) -> bool:
        """Whether a request waits, is in prefill or decodes."""
        return bool(self._waiting or self._prefilling or self._running)

    def add(self, request: Request, /) -> int:
        """Queue ``request``; return its id (0, 1, 2, ... in order of arrival).

        Every field is checked here, before anything is queued or allocated: a bad one is a
        ``TypeError`` or ``ValueError`` naming it, and so is a request longer than
        ``max_seq_len`` or than a fixed pool holds.
        """
        if not isinstance(request, Request):
            raise TypeError(f"{OP}.add: expected a Request, got {type(request).__name__}")
        prompt = _ids(request.prompt_ids)
        V = self.model.config.vocab_size
        if not prompt:
            raise ValueError(f"{OP}.add: prompt_ids has no tokens")
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(
                f"{OP}.add: prompt_ids must lie in [0, {V}) (vocab_size), got {min(prompt)} to "
                f"{max(prompt)}"
            )
        new = check_int(OP, "max_new_tokens", request.max_new_tokens, low=1)
        if request.sampler is not None and not callable(request.sampler):
            raise TypeError(
                f"{OP}.add: sampler must be callable or None, got {type(request.sampler).__name__}"
            )
        stops = self._default_stops if request.stop is None else frozenset(_stop_ids(request.stop))
        total = len(prompt) + new
        if self.max_seq_len is not None and total > self.max_seq_len:
            raise ValueError(
                f"{OP}.add: the prompt ({len(prompt)} tokens) plus max_new_tokens ({new}) is "
                f"{total} tokens, more than max_seq_len ({self.max_seq_len})"
            )
        need = self._pages(len(prompt), new)
        if not self._grows and need > self.pools[0].num_pages:
            raise ValueError(
                f"{OP}.add: the request needs {need} pages of {self.pools[0].page_size} tokens, "
                f"more than pool_pages ({self.pools[0].num_pages})"
            )
        seq = _Seq(self._next_id, prompt, new, request.sampler, stops)
        self._next_id += 1
        self._waiting.append(seq)
        return seq.rid

    def step(self) -> list[tuple[int, int, str | None]]:
        """Admit, decode one token per running request, advance the prefill (see the module
        docstring).

        Returns
        -------
        list of ``(request_id, token, finish_reason)``
            One entry per token generated in this step: the decoded requests in the order they
            joined the decode batch, then those whose prefill completed. ``finish_reason`` is
            ``None`` while the request runs, ``"stop"`` when ``token`` is one of its stop
            tokens, ``"length"`` on its ``max_new_tokens``-th token; the request then leaves.
        """
        try:
            return self._step()
        except BaseException:
            self._abort()
            raise

    # -- one step -----------------------------------------------------------------------------
    def _pages(self, prompt: int, new: int) -> int:
        """Pages for a sequence: the last token sampled is never fed back, so never stored."""
        return math.ceil((prompt + new - 1) / self.pools[0].page_size)

    def _admit(self) -> None:
        while self._waiting and len(self._prefilling) + len(self._running) < self.max_batch:
            seq = self._waiting[0]
            need = self._pages(len(seq.prompt), seq.max_new_tokens)
            if need > self.pools[0].num_free:
                if not self._grows:
                    return  # it waits for pages to be freed
                size = self.pools[0].num_pages
                while size - self.pools[0].num_pages + self.pools[0].num_free < need:
                    size *= 2
                for pool in self.pools:
                    pool.grow(size)
            tokens = len(seq.prompt) + seq.max_new_tokens - 1
            seq.caches = [PagedKVCache(pool) for pool in self.pools]
            for cache in seq.caches:
                cache.reserve(tokens)
            self._waiting.popleft()
            self._prefilling.append(seq)

    def _step(self) -> list[tuple[int, int, str | None]]:
        self._admit()
        events: list[tuple[int, int, str | None]] = []
        if self._running:
            running = self._running
            logits = forward(
                self.model, [s.caches for s in running], [[s.pending] for s in running]
            )
            for seq, token in zip(running, self._sample(running, logits), strict=True):
                events.append(self._emit(seq, token))
            self._running = [s for s in running if s.caches]
        budget = self.prefill_chunk
        for seq in list(self._prefilling):
            if budget == 0:
                break
            n = min(budget, len(seq.prompt) - seq.prefilled)
            chunk = seq.prompt[seq.prefilled : seq.prefilled + n]
            seq.prefilled += n
            budget -= n
            last = seq.prefilled == len(seq.prompt)  # only the last chunk needs logits
            logits = forward(self.model, [seq.caches], [chunk], logits=last)  # (1, V) or None
            if last:
                self._prefilling.remove(seq)
                (token,) = self._sample([seq], logits)
                events.append(self._emit(seq, token))
                if seq.caches:
                    self._running.append(seq)
        return events

    def _sample(self, seqs: list[_Seq], logits: Any) -> list[int]:
        """Each row's token: greedy rows with one call, each sampler on its own row ``(1, V)``
        (so that a seeded sampler draws as it would alone)."""
        to_numpy = self.model.backend.to_numpy
        top = None
        if any(s.sampler is None for s in seqs):
            top = to_numpy(greedy(logits)).reshape(-1)  # (B,)
        out = []
        for b, seq in enumerate(seqs):
            if seq.sampler is None:
                assert top is not None
                token = int(top[b])
            else:
                token = int(np.asarray(to_numpy(seq.sampler(logits[b : b + 1, :]))).reshape(-1)[0])
            if token < 0:  # sample's mark for a row with no distribution
                raise ValueError(
                    f"{OP}: the logits of request {seq.rid} after "
                    f"{seq.prefilled + seq.generated} tokens are NaN or all -inf; the weights or "
                    "the dtype overflowed"
                )
            out.append(token)
        return out

    def _emit(self, seq: _Seq, token: int) -> tuple[int, int, str | None]:
        seq.generated += 1
        reason = None
        if token in seq.stops:
            reason = "stop"
        elif seq.generated == seq.max_new_tokens:
            reason = "length"
        if reason is None:
            seq.pending = token
        else:
            self._release(seq)
        return seq.rid, token, reason

    def _release(self, seq: _Seq) -> None:
        for cache in seq.caches:
            cache.release()
        seq.caches = []

    def _abort(self) -> None:
        """Free every page and drop every request (after an exception inside a step)."""
        for seq in [*self._prefilling, *self._running]:
            if seq.caches:
                self._release(seq)
        self._waiting.clear()
        self._prefilling.clear()
        self._running.clear()


def batch_generate(
    model: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[Any],
    /,
    *,
    max_new_tokens: int = 256,
    sampler: Sampler | None = None,
    max_batch: int = 8,
    prefill_chunk: int = 512,
    stop: Iterable[int] | None = None,
) -> list[Any]:
    """Generate for every prompt at once with a :class:`BatchGenerator`.

    Parameters
    ----------
    model : Model
    prompts : list of str, or list of token-id sequences (or 1-D integer arrays)
        Strings are encoded as :func:`~portable_llm.generate` encodes them (the model's
        tokenizer).
    max_new_tokens : int, >= 0
    sampler : callable, optional
        Shared by every request (each row drawn with its own call); default greedy.
    max_batch, prefill_chunk
        As for :class:`BatchGenerator`.
    stop : iterable of int, optional
        Stop token ids; default the model's EOS ids. A stop token is not returned.

    Returns
    -------
    list, in prompt order
        Each prompt's new token ids (``list[int]``), or its decoded text for string prompts.
    """
    prompts = list(prompts)
    texts = [isinstance(p, str) for p in prompts]
    if any(texts) and not all(texts):
        raise TypeError("batch_generate: prompts must be all strings or all token-id sequences")
    text = bool(prompts) and all(texts)
    tokenizer = model.tokenizer
    if text and tokenizer is None:
        raise ValueError("batch_generate: a text prompt needs the checkpoint's tokenizer.json")
    new = check_int("batch_generate", "max_new_tokens", max_new_tokens, low=0)
    rows = [tokenizer.encode_prompt(p) if text else p for p in prompts]
    gen = BatchGenerator(model, max_batch=max_batch, prefill_chunk=prefill_chunk)
    out: list[list[int]] = [[] for _ in rows]
    if new > 0:
        ids = [gen.add(Request(r, new, sampler, stop)) for r in rows]
        index = {rid: i for i, rid in enumerate(ids)}
        while gen.has_work:
            for rid, token, reason in gen.step():
                if reason != "stop":
                    out[index[rid]].append(token)
    return [tokenizer.decode(ids) for ids in out] if text else out
