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
(``"length"``), or when :meth:`BatchGenerator.cancel` drops it; its pages are freed at once for
the requests that wait.

Each request may ask for its own penalties (``frequency_penalty``, ``presence_penalty``,
``repetition_penalty``, ``logit_bias``, ``min_tokens``): the rows of a step get theirs in one
pass of array ops over the batch's logits (:class:`~portable_llm.generation.penalties.
PenaltyRows`, which keeps each row's token counts on the device). A request with ``n > 1``
makes ``n`` sequences whose prompt is prefilled once: when the prefill completes, the other
``n - 1`` share its pages (copy on write for a partly filled last page) and each samples its
own first token from the same logits.

With ``prefix_cache=True`` the pages of each prompt's full blocks (once prefilled) and of each
finished sequence are kept in a :class:`~portable_llm.caches.prefix.PrefixCache`: a request
whose prompt starts with cached tokens shares those pages and prefills only the rest, and the
least recently used cached pages that no request holds are evicted when the pools run short.

The model is any :class:`~portable_llm.generation.LanguageModel`. One that is a
:class:`~portable_llm.generation.PagedLanguageModel` (:class:`~portable_llm.Model`) makes the
pools and runs the rows of a step in one forward (``forward_paged``); one that is a
:class:`~portable_llm.generation.BatchDecodingModel` keeps each request in its own
``make_cache()`` and decodes the rows of a step in one ``decode_batch``; any other runs each
request alone over its own ``make_cache()`` (no pools: ``max_batch`` bounds the memory), with
the same tokens. A model's own caches go back to its ``release_cache`` when the request ends.
:meth:`BatchGenerator.feed` hands a request tokens decoded elsewhere.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from portable_llm.backends import backend_of
from portable_llm.caches.paged import PagedKVCache, PagePool
from portable_llm.caches.prefix import PrefixCache
from portable_llm.caches.recurrent import RecurrentSlots
from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import check_int, check_optional_int
from portable_llm.generation.grammar import Constraint, grammar_engine, grammar_of, mask_logits
from portable_llm.generation.penalties import Penalties, PenaltyRows, Row
from portable_llm.generation.prompt import prompt_ids, stop_ids
from portable_llm.generation.protocol import (
    BatchDecodingModel,
    LanguageModel,
    PagedLanguageModel,
    array_library,
    check_logits,
    check_model,
    check_page_pools,
    check_paged_model,
    materialize,
    num_layers,
    release_cache,
    vocab_size,
)
from portable_llm.generation.sampler import Sampler
from portable_llm.generation.tokenizer import text_tokenizer
from portable_llm.ops.sampling import greedy

__all__ = ["DEFAULT_MAX_SEQ_LEN", "MAX_N", "BatchGenerator", "Request", "batch_generate"]

OP = "BatchGenerator"

#: The longest sequence a :class:`BatchGenerator` takes when neither ``max_seq_len`` nor the
#: model states one (a config without ``max_position_embeddings``): a request's pages are
#: reserved when it is admitted, so a ``max_new_tokens`` of ``10**7`` must not reach the pools.
DEFAULT_MAX_SEQ_LEN = 32768
#: The most sequences one :class:`Request` may ask for (``n``; vLLM's and OpenAI's bound).
MAX_N = 16


@dataclass
class Request:
    """One generation request for a :class:`BatchGenerator`.

    Parameters
    ----------
    prompt_ids : sequence or 1-D integer array of token ids, non-empty
    max_new_tokens : int, >= 0
        The most tokens to generate (a final stop token included). ``0``: the request ends
        when :meth:`BatchGenerator.add` queues it (it gets an id, and no event).
    sampler : callable, optional
        ``sampler(logits (1, V)) -> ids (1,)`` (:func:`~portable_llm.make_sampler`), called
        once per token of this request; default :func:`~portable_llm.greedy`.
    stop : iterable of int, optional
        Stop token ids; default the model's EOS ids (``model.eos_token_ids``, as
        :func:`~portable_llm.generate`). ``()``: none.
    response_format : dict or Grammar, optional
        Constrained decoding, as for :func:`~portable_llm.generate`: each sequence of the
        request gets its own matcher, and its row's logits outside the grammar are ``-inf``
        before its sampler.
    frequency_penalty, presence_penalty : float in ``[-2, 2]``
    repetition_penalty : float, > 0
        Over every token of the prompt and the output (vLLM's); ``1``: none.
    logit_bias : mapping of token id to float in ``[-100, 100]``, optional
    min_tokens : int in ``[0, max_new_tokens]``
        The stop tokens are banned until this many tokens were generated.
        (These five: :func:`~portable_llm.apply_penalties`.)
    ignore_eos : bool
        With ``stop=None``, the EOS ids do not stop the request (nothing does but
        ``max_new_tokens``); an explicit ``stop`` is kept as given.
    n : int in ``[1, 16]``
        Sequences to generate from the prompt, prefilled once. :meth:`BatchGenerator.add`
        returns the first one's id; the others have the next ``n - 1`` ids.
    """

    prompt_ids: Sequence[int] | Any
    max_new_tokens: int = 256
    sampler: Sampler | None = None
    stop: Iterable[int] | None = None
    response_format: Any = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1


@dataclass
class _Seq:
    """A request inside the generator: its prompt, pages and progress."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler | None
    stops: frozenset[int]
    penalties: Penalties = field(default_factory=Penalties)
    siblings: list[_Seq] = field(default_factory=list)  # n > 1: forked when the prefill ends
    constraint: Constraint | None = None  # response_format: the grammar's state
    caches: list[Any] = field(default_factory=list)  # one per layer, once admitted
    slot: int = -1  # a hybrid model's: its recurrent layers' state slot, once admitted
    prefilled: int = 0  # prompt tokens in the caches
    generated: int = 0
    pending: int = -1  # the last token sampled, fed to the model by the next decode step
    out: list[int] = field(default_factory=list)  # the tokens sampled so far
    forced: deque[int] = field(default_factory=deque)  # BatchGenerator.feed: the next tokens


class BatchGenerator:
    """Generate for many requests at once: continuous batching with chunked prefill.

    See the module docstring for the scheduling rule. Each request's tokens are those it would
    get alone (greedy: the same ids as :func:`~portable_llm.generate`, up to ties within the
    dtype's rounding).

    Parameters
    ----------
    model : LanguageModel
        A :class:`~portable_llm.Model`, or any object that follows
        :class:`~portable_llm.generation.LanguageModel` (``docs/bring-your-own-model.md``);
        paged (one forward per step) when it follows
        :class:`~portable_llm.generation.PagedLanguageModel`.
    max_batch : int, >= 1
        The most requests admitted at once (decoding or in prefill).
    prefill_chunk : int, >= 1
        The most prompt tokens prefilled per step, over all requests.
    pool_pages : int, >= 1, optional
        Pages per layer's pool. Requests wait while the pool is full, and :meth:`add` refuses
        one that could never fit. ``None`` (default): the pools start with room for
        ``max_batch`` sequences of 256 tokens and grow (doubling) when a request needs more.
        Unused by a model without paged caches.
    page_size : int, >= 1
        Tokens per page.
    max_seq_len : int, >= 1, optional
        The longest sequence (prompt plus ``max_new_tokens``) :meth:`add` accepts; default the
        model's ``max_seq_len`` (a config's ``max_position_embeddings``), else
        :data:`DEFAULT_MAX_SEQ_LEN` (32768): a request's pages are reserved at once, so the
        length is always bounded.
    prefix_cache : bool
        Keep the pages of prompts and finished sequences for the requests that start with the
        same tokens (see the module docstring; paged models only, and not a hybrid model's:
        its recurrent states after a prefix are in no page, so it prefills every prompt).
        Default ``False``.

    Attributes
    ----------
    pools : list of PagePool
        One per layer, ``(pool_pages, H_kv, page_size, D)`` pages of the model's dtype; a
        sequence holds the same page ids in each. Empty for a model without paged caches.
    state_slots : list of RecurrentSlots or None, or None
        A paged hybrid model's (``make_state_slots``): per layer, the recurrent states of the
        requests, one slot each (``None`` for a layer of attention alone); ``None`` for a model
        without recurrent layers.
    max_seq_len : int
    prefix_cache : PrefixCache or None
    admitted : list of ``(request_id, cached_tokens)``
        The requests the last :meth:`step` admitted, each with the prompt tokens it took from
        the prefix cache (prefilled without computing them).

    Notes
    -----
    An exception inside :meth:`step` (a sampler that raises, logits that are all NaN, a pool
    that cannot grow) frees every page and drops every request before it propagates: the
    generator is then empty, and usable again.

    Threads: :meth:`add` and :attr:`has_work` are safe from any thread (a lock guards the
    queue), so a server can queue requests while another thread steps. :meth:`step` is not
    shared: while requests hold caches, it belongs to the thread that stepped them (as a
    :class:`~portable_llm.KVCache` belongs to the thread that first updates it: the caches are
    written in place, and MLX crashes when threads share them), and a call from another thread,
    or one while a step runs, raises ``RuntimeError`` and changes nothing. Once no request holds
    caches (none admitted, or all finished), any thread may step it.
    """

    def __init__(
        self,
        model: LanguageModel,
        *,
        max_batch: int = 8,
        prefill_chunk: int = 512,
        pool_pages: int | None = None,
        page_size: int = 16,
        max_seq_len: int | None = None,
        prefix_cache: bool = False,
    ) -> None:
        self.model = check_model(OP, model)
        self._paged: PagedLanguageModel | None = check_paged_model(self.model)
        self.max_batch = check_int(OP, "max_batch", max_batch, low=1)
        self.prefill_chunk = check_int(OP, "prefill_chunk", prefill_chunk, low=1)
        page_size = check_int(OP, "page_size", page_size, low=1)
        fixed = check_optional_int(OP, "pool_pages", pool_pages, low=1)
        limit = max_seq_len
        if limit is None and self._paged is not None:
            limit = self._paged.max_seq_len
        limit = DEFAULT_MAX_SEQ_LEN if limit is None else limit
        self.max_seq_len: int = check_int(OP, "max_seq_len", limit, low=1)
        self._grows = fixed is None
        pages = fixed if fixed is not None else self.max_batch * math.ceil(256 / page_size)
        self.pools: list[PagePool] = []
        if self._paged is not None:
            pools = self._paged.make_page_pools(pages, page_size)
            self.pools = check_page_pools(OP, model, pools, num_layers(model), page_size)
        self._lock = threading.Lock()  # guards the queue and the request ids
        self._owner: int | None = None  # the thread that steps the requests holding caches
        self._stepping = False  # a step() runs
        self._next_id = 0
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        self._running: list[_Seq] = []
        self._live: dict[int, _Seq] = {}  # every request holding caches, by id
        self.state_slots: list[RecurrentSlots | None] | None = None
        make_slots = getattr(self._paged, "make_state_slots", None)
        if make_slots is not None:  # a hybrid model's recurrent states, a slot per request
            slots = list(make_slots(self.max_batch))
            self.state_slots = slots if any(x is not None for x in slots) else None
        paged_prefix = prefix_cache and self.pools and self.state_slots is None
        self.prefix_cache = PrefixCache(self.pools) if paged_prefix else None
        self.admitted: list[tuple[int, int]] = []
        self._promised = 0  # pages held back for the siblings of requests in prefill (n > 1)
        self._V = vocab_size(self.model)  # None: the first logits tell
        self._penalties: PenaltyRows | None = None  # the decode batch's rows (once V is known)

    @property
    def has_work(self) -> bool:
        """Whether a request waits, is in prefill or decodes."""
        return bool(self._waiting or self._prefilling or self._running)

    def add(self, request: Request, /) -> int:
        """Queue ``request``; return its id (0, 1, 2, ... in order of arrival).

        Every field is checked here, before anything is queued or allocated: a bad one is a
        ``TypeError`` or ``ValueError`` naming it, and so is a request longer than
        ``max_seq_len`` or than a fixed pool holds. Safe from any thread.
        """
        op = f"{OP}.add"
        if not isinstance(request, Request):
            raise TypeError(f"{op}: expected a Request, got {type(request).__name__}")
        prompt = prompt_ids(self.model, request.prompt_ids, op=op, name="prompt_ids", text=False)
        new = check_int(op, "max_new_tokens", request.max_new_tokens, low=0)
        if request.sampler is not None and not callable(request.sampler):
            raise TypeError(
                f"{op}: sampler must be callable or None, got {type(request.sampler).__name__}"
            )
        stops = stop_ids(self.model, request.stop, op=op, ignore_eos=request.ignore_eos)
        penalties = Penalties.check(
            op, vocab_size=self._V, max_new_tokens=new,
            frequency_penalty=request.frequency_penalty,
            presence_penalty=request.presence_penalty,
            repetition_penalty=request.repetition_penalty, logit_bias=request.logit_bias,
            min_tokens=request.min_tokens,
        )  # fmt: skip
        n = check_int(op, "n", request.n, low=1, high=MAX_N)
        constraints = self._constraints(op, request.response_format, stops, n)
        total = len(prompt) + new
        if total > self.max_seq_len:
            raise ValueError(
                f"{op}: the prompt ({len(prompt)} tokens) plus max_new_tokens ({new}) is "
                f"{total} tokens, more than max_seq_len ({self.max_seq_len})"
            )
        if self.pools and not self._grows:
            need = self._pages(len(prompt), new) + (n - 1) * self._forked_pages(len(prompt), new)
            if need > self.pools[0].num_pages:
                raise ValueError(
                    f"{op}: the request needs {need} pages of {self.pools[0].page_size} tokens"
                    f"{f' for its {n} sequences' if n > 1 else ''}, more than pool_pages "
                    f"({self.pools[0].num_pages})"
                )
        with self._lock:
            rid = self._next_id
            if new == 0:  # nothing to generate: the request ends here
                self._next_id += n
                return rid
            seqs = [_Seq(rid + i, prompt, new, request.sampler, stops, penalties) for i in range(n)]
            for seq, constraint in zip(seqs, constraints, strict=True):
                seq.constraint = constraint
            self._next_id += n
            if self._paged is not None:  # one prefill; the others fork from it
                seqs[0].siblings = seqs[1:]
                seqs = seqs[:1]
            self._waiting.extend(seqs)
        return rid

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

        Raises
        ------
        RuntimeError
            While requests hold caches, a call from another thread than the one that stepped
            them, or a call while a step runs (see the class notes); nothing changes.
        """
        me = threading.get_ident()
        with self._lock:
            if self._stepping or (self._live and self._owner != me):
                raise RuntimeError(
                    f"{OP}.step: the generator is being stepped by thread {self._owner}, called "
                    f"from thread {me}; while requests hold caches, step() from one thread (add() "
                    "may come from any)"
                )
            self._owner, self._stepping = me, True
        try:
            return self._step()
        except BaseException:
            self._abort()
            raise
        finally:
            self._stepping = False

    def cancel(self, request_id: int, /) -> bool:
        """Drop a request, waiting or running, and free its pages now (from the thread that
        steps); ``False`` when no such request is queued or running (it finished)."""
        rid = check_int(f"{OP}.cancel", "request_id", request_id)
        with self._lock:
            for seq in self._waiting:
                if seq.rid == rid:
                    self._waiting.remove(seq)
                    return True
                if self._drop_sibling(seq, rid, admitted=False):
                    return True
        for seqs in (self._prefilling, self._running):
            for seq in seqs:
                if seq.rid == rid:
                    seqs.remove(seq)
                    self._unpromise(seq, len(seq.siblings))
                    self._finish(seq)
                    return True
        return any(self._drop_sibling(seq, rid, admitted=True) for seq in list(self._prefilling))

    def feed(self, request_id: int, tokens: Iterable[int], /) -> bool:
        """Hand request ``request_id`` its next tokens, decoded elsewhere (another model, a
        grammar's forced text, a user's edit): each of its next steps takes the next of
        ``tokens`` instead of sampling, and reports it as an event as it would a sampled one
        (stop tokens and ``max_new_tokens`` apply; penalties and ``response_format`` see it).
        The request's forward of that step still runs (it puts the previous token into the
        caches). Call it from the thread that steps, or before the request is admitted;
        ``False`` when no such request waits or runs. Ids must be ints ``>= 0`` (``< V``,
        checked when the token is taken)."""
        op = f"{OP}.feed"
        rid = check_int(op, "request_id", request_id)
        if isinstance(tokens, str | bytes) or not isinstance(tokens, Iterable):
            raise TypeError(f"{op}: tokens must be an iterable of token ids (ints)")
        ids = [check_int(op, f"tokens[{i}]", t, low=0) for i, t in enumerate(tokens)]
        V = self._V
        if V is not None and ids and max(ids) >= V:
            raise ValueError(f"{op}: tokens must lie in [0, {V}) (vocab_size), got {max(ids)}")
        with self._lock:
            waiting = [q for s in self._waiting for q in (s, *s.siblings)]
        for seq in (*waiting, *self._prefilling, *self._running):
            for q in (seq, *seq.siblings):
                if q.rid == rid:
                    q.forced.extend(ids)
                    return True
        return False

    def _drop_sibling(self, seq: _Seq, rid: int, *, admitted: bool) -> bool:
        """Drop the sibling ``rid`` of ``seq`` (``n > 1``, not yet forked); whether it was one."""
        for sib in seq.siblings:
            if sib.rid == rid:
                seq.siblings.remove(sib)
                if admitted:
                    self._unpromise(seq, 1)
                return True
        return False

    def _unpromise(self, seq: _Seq, count: int) -> None:
        """Give back the pages held back for ``count`` of ``seq``'s unforked siblings."""
        if self.pools and count:
            self._promised -= count * self._forked_pages(len(seq.prompt), seq.max_new_tokens)

    def _constraints(
        self, op: str, response_format: Any, stops: frozenset[int], n: int
    ) -> list[Constraint | None]:
        """One grammar state per sequence of a request (``None``: no ``response_format``)."""
        grammar = grammar_of(response_format)
        if grammar is None:
            return [None] * n
        if not stops:
            raise ValueError(f"{op}: response_format needs a stop token (ignore_eos or stop=())")
        if self._V is None:
            raise ValueError(f"{op}: response_format needs the model's vocab_size")
        engine = grammar_engine(self.model.tokenizer, vocab_size=self._V, stop_ids=sorted(stops))
        return [Constraint(engine.matcher(grammar)) for _ in range(n)]

    # -- one step -----------------------------------------------------------------------------
    def _pages(self, prompt: int, new: int) -> int:
        """Pages for a sequence: the last token sampled is never fed back, so never stored."""
        return math.ceil((prompt + new - 1) / self.pools[0].page_size)

    def _forked_pages(self, prompt: int, new: int) -> int:
        """Pages of its own for a sequence forked after the prompt's prefill (``n > 1``): all
        but the prompt's full pages, which it shares."""
        return self._pages(prompt, new) - prompt // self.pools[0].page_size

    def _room(self, need: int) -> bool:
        """Whether every pool has ``need`` free pages, growing the pools where they may.

        The pools hand out the same page ids as long as a sequence's pages come from the
        pages free in *every* pool (lowest first): hence the smallest pool's count, also after
        a growth that failed half-way (the pools then differ in size). Cached prefixes no
        request holds are evicted first."""
        free = min(pool.num_free for pool in self.pools)
        if need > free and self.prefix_cache is not None:
            self.prefix_cache.evict(need - free)
            free = min(pool.num_free for pool in self.pools)
        if need <= free:
            return True
        if not self._grows:
            return False  # it waits for pages to be freed
        smallest = min(pool.num_pages for pool in self.pools)
        size = smallest
        while size - smallest + free < need:
            size *= 2
        for pool in self.pools:
            if pool.num_pages < size:
                pool.grow(size)
        return True

    def _admit(self) -> None:
        while len(self._prefilling) + len(self._running) < self.max_batch:
            with self._lock:
                if not self._waiting:
                    return
                seq = self._waiting[0]
            cached, shared = self._match(seq)
            if self._paged is not None and not self._pinned_room(seq, cached, shared):
                return
            self._live[seq.rid] = seq  # from here on, _abort frees its pages
            with self._lock:
                self._waiting.popleft()
            if self.pools:
                self._promised += len(seq.siblings) * self._forked_pages(
                    len(seq.prompt), seq.max_new_tokens
                )
            if self._paged is not None:
                tokens = len(seq.prompt) + seq.max_new_tokens - 1
                seq.caches = [PagedKVCache(pool) for pool in self.pools]
                for cache, pages in zip(seq.caches, shared, strict=True):
                    cache.share(pages, cached)  # the cached prefix (copy on write: last page)
                    cache.reserve(tokens - cached)
                seq.prefilled = cached
                seq.slot = self._slot()
            else:
                seq.caches = self.model.make_cache()
            self._prefilling.append(seq)
            self.admitted.append((seq.rid, cached))

    def _match(self, seq: _Seq) -> tuple[int, list[list[int]]]:
        """The prompt tokens of ``seq`` in the prefix cache (all but the last, whose logits
        are needed) and each pool's pages holding them."""
        shared: list[list[int]] = [[] for _ in self.pools]
        if self.prefix_cache is None:
            return 0, shared
        cached, found = self.prefix_cache.match(seq.prompt, limit=len(seq.prompt) - 1)
        return cached, found or shared

    def _pinned_room(self, seq: _Seq, cached: int, shared: list[list[int]]) -> bool:
        """:meth:`_room` for ``seq``'s pages past its cached prefix, whose pages are held
        meanwhile so that eviction keeps them."""
        need = self._pages(len(seq.prompt), seq.max_new_tokens) - cached // self.pools[0].page_size
        forked = len(seq.siblings) * self._forked_pages(len(seq.prompt), seq.max_new_tokens)
        need += forked + self._promised  # the siblings' pages, and those of earlier requests
        for pool, pages in zip(self.pools, shared, strict=True):
            pool.share(pages)
        try:
            return self._room(need)
        finally:
            for pool, pages in zip(self.pools, shared, strict=True):
                pool.free(pages)

    def _forward(self, seqs: list[_Seq], chunks: list[list[int]], *, logits: bool = True) -> Any:
        """Logits ``(B, V)`` of each row's last position after its ``chunks[b]``; ``None``
        when not ``logits``.

        A paged model runs the rows in one ``forward_paged``; a
        :class:`~portable_llm.generation.BatchDecodingModel` runs a decode step's rows (one
        token each) in one ``decode_batch`` over their own caches; any other model, or a
        prefill chunk, runs each row alone (``__call__``)."""
        if self._paged is not None:
            caches = [s.caches for s in seqs]
            if self.state_slots is None:
                out = self._paged.forward_paged(chunks, caches=caches, logits=logits)
            else:  # a hybrid model: its recurrent layers' states in the rows' slots
                out = self._paged.forward_paged(  # type: ignore[call-arg]
                    chunks, caches=caches, logits=logits, state_slots=self.state_slots,
                    slot_ids=[s.slot for s in seqs],
                )  # fmt: skip
            if not logits:
                return None
            return self._checked(out, (len(seqs), self._V), "forward_paged")
        model = self.model
        if len(seqs) > 1 and isinstance(model, BatchDecodingModel) and max(map(len, chunks)) == 1:
            ids = np.asarray(chunks, dtype=np.int64)  # (B, 1)
            out = model.decode_batch(ids, caches=[s.caches for s in seqs])
            return self._checked(out, (len(seqs), None, self._V), "decode_batch")[:, -1, :]
        rows = []
        for s, chunk in zip(seqs, chunks, strict=True):
            out = model(np.asarray([chunk], dtype=np.int64), cache=s.caches, last_only=True)
            if not logits:  # a prefill chunk: computed now (MaterializingModel)
                materialize(model, out, s.caches)
                continue
            rows.append(self._checked(out, (1, None, self._V), "__call__")[:, -1, :])  # (1, V)
        if not logits:
            return None
        if len(rows) == 1:
            return rows[0]
        bk = backend_of(rows[0])
        assert bk is not None
        return bk.xp.concat(rows, axis=0)  # (B, V)

    def _checked(self, out: Any, shape: tuple[int | None, ...], call: str) -> Any:
        """The model's logits checked (:func:`~portable_llm.generation.protocol.check_logits`);
        the first ones give ``V`` to a model without ``vocab_size``."""
        if self._V is None and array_library(out) is not None:
            self._V = int(out.shape[-1])
            shape = (*shape[:-1], self._V)
        return check_logits(OP, self.model, out, shape, call)

    def _step(self) -> list[tuple[int, int, str | None]]:
        self.admitted = []
        self._admit()
        events: list[tuple[int, int, str | None]] = []
        if self._running:
            running = self._running
            logits = self._forward(running, [[s.pending] for s in running])
            if self._penalties is None:
                self._penalties = PenaltyRows(int(logits.shape[-1]))
            tokens = self._sample(running, logits, self._penalties)
            for seq, token in zip(running, tokens, strict=True):
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
            logits = self._forward([seq], [chunk], logits=last)  # (1, V) or None
            if last:
                if self.prefix_cache is not None:  # the prompt's full pages are final now
                    full = len(seq.prompt) - len(seq.prompt) % self.pools[0].page_size
                    self.prefix_cache.insert(seq.prompt[:full], [c.block_table for c in seq.caches])
                self._prefilling.remove(seq)
                group = [seq, *self._fork(seq)]
                if len(group) > 1:  # each sequence samples from the prompt's logits
                    bk = backend_of(logits)
                    assert bk is not None
                    logits = bk.xp.concat([logits] * len(group), axis=0)  # (n, V)
                first = PenaltyRows(int(logits.shape[-1]))  # fresh rows: nothing generated yet
                for s, token in zip(group, self._sample(group, logits, first), strict=True):
                    events.append(self._emit(s, token))
                    if s.caches:
                        self._running.append(s)
        return events

    def _fork(self, seq: _Seq) -> list[_Seq]:
        """``seq``'s siblings (``n > 1``), each on the prompt's pages now that they hold it."""
        siblings, seq.siblings = seq.siblings, []
        self._unpromise(seq, len(siblings))
        P = len(seq.prompt)
        for sib in siblings:
            self._live[sib.rid] = sib
            sib.caches = [PagedKVCache(pool) for pool in self.pools]
            for cache, parent in zip(sib.caches, seq.caches, strict=True):
                cache.share(parent.block_table, P)  # copy on write: a partly filled last page
                cache.reserve(sib.max_new_tokens - 1)  # the last token is never stored
            sib.prefilled = P
            sib.slot = self._slot(copy_of=seq.slot)
        return siblings

    def _sample(self, seqs: list[_Seq], logits: Any, penalties: PenaltyRows) -> list[int]:
        """Each row's token: the rows' penalties in one pass, then greedy rows with one call,
        each sampler on its own row ``(1, V)`` (so that a seeded sampler draws as it would
        alone)."""
        rows = [Row(s.rid, s.penalties, s.prompt, s.out, s.stops) for s in seqs]
        logits = penalties.apply(logits, rows)
        if any(s.constraint is not None for s in seqs):  # response_format
            masks = [None if s.constraint is None else s.constraint.allowed(s.out) for s in seqs]
            logits = mask_logits(logits, masks)
        top = None
        if any(s.sampler is None for s in seqs):
            top = to_numpy(greedy(logits)).reshape(-1)  # (B,)
        V = int(logits.shape[-1])
        out = []
        for b, seq in enumerate(seqs):
            if seq.forced:  # a token decoded elsewhere (feed): the row's logits are not used
                token = seq.forced.popleft()
                if token >= V:
                    raise ValueError(
                        f"{OP}.feed: request {seq.rid} was fed {token}, outside [0, {V}) (the "
                        "logits' vocabulary)"
                    )
                out.append(token)
                continue
            if seq.sampler is None:
                assert top is not None
                token = int(top[b])
            else:
                got = seq.sampler(logits[b : b + 1, :])
                if array_library(got) is None:
                    raise TypeError(
                        f"{OP}: the sampler of request {seq.rid} must return an integer array "
                        f"(one id), got {type(got).__name__} {repr(got)[:40]}"
                    )
                drawn = np.asarray(to_numpy(got)).reshape(-1)
                if drawn.shape != (1,) or drawn.dtype.kind not in "iu":
                    raise ValueError(
                        f"{OP}: the sampler of request {seq.rid} must return one integer id "
                        f"for logits of shape (1, {V}), got {drawn.dtype} with {drawn.size} values"
                    )
                token = int(drawn[0])
            if token == -1:  # sample's mark for a row with no distribution
                raise ValueError(
                    f"{OP}: the logits of request {seq.rid} after "
                    f"{seq.prefilled + seq.generated} tokens are NaN or all -inf; the weights or "
                    "the dtype overflowed"
                )
            if not 0 <= token < V:  # any other id outside the vocabulary: drawn so
                raise ValueError(
                    f"{OP}: the sampler of request {seq.rid} drew {token}, outside [0, {V}) "
                    "(vocab_size)"
                )
            out.append(token)
        penalties.advance(out)
        return out

    def _emit(self, seq: _Seq, token: int) -> tuple[int, int, str | None]:
        seq.generated += 1
        seq.out.append(token)
        reason = None
        if token in seq.stops:
            reason = "stop"
        elif seq.generated == seq.max_new_tokens:
            reason = "length"
        if reason is None:
            seq.pending = token
        else:
            self._finish(seq)
        return seq.rid, token, reason

    def _finish(self, seq: _Seq) -> None:
        """Release a request that ended, its tokens first kept by the prefix cache."""
        if self.prefix_cache is not None and seq.caches:
            tokens = (seq.prompt + seq.out)[: seq.caches[0].offset]
            self.prefix_cache.insert(tokens, [c.block_table for c in seq.caches])
        self._release(seq)

    def _slot(self, copy_of: int = -1) -> int:
        """A hybrid model's new request's state slot (zeros, or ``copy_of``'s state: a sibling
        forked after the prompt), the slots growing (doubling) when all are taken; ``-1`` for
        a model without recurrent layers."""
        if self.state_slots is None:
            return -1
        ids = set()
        for store in self.state_slots:
            if store is None:
                continue
            if store.num_free == 0:
                store.grow(2 * store.num_slots)
            slot = store.allocate()
            if copy_of >= 0:
                store.copy(copy_of, slot)
            ids.add(slot)
        assert len(ids) == 1, "the layers' slots are allocated in step"
        return ids.pop()

    def _release(self, seq: _Seq) -> None:
        if self._paged is not None:
            for cache in seq.caches:
                cache.release()
            if seq.slot >= 0 and self.state_slots is not None:
                for store in self.state_slots:
                    if store is not None:
                        store.release(seq.slot)
                seq.slot = -1
        elif seq.caches:  # the model's own caches (ReleasingModel)
            release_cache(self.model, seq.caches)
        seq.caches = []
        self._live.pop(seq.rid, None)

    def _abort(self) -> None:
        """Free every page and drop every request (after an exception inside a step): every
        request that holds caches, wherever the exception left it."""
        for seq in list(self._live.values()):
            self._release(seq)
        with self._lock:
            self._waiting.clear()
        self._prefilling.clear()
        self._running.clear()
        self._promised = 0


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
    model : LanguageModel
        As for :class:`BatchGenerator`.
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
    op = "batch_generate"
    model = check_model(op, model)
    prompts = list(prompts)
    texts = [isinstance(p, str) for p in prompts]
    if any(texts) and not all(texts):
        raise TypeError(f"{op}: prompts must be all strings or all token-id sequences")
    text = bool(prompts) and all(texts)
    new = check_int(op, "max_new_tokens", max_new_tokens, low=0)
    rows = [prompt_ids(model, p, op=op, name=f"prompts[{i}]") for i, p in enumerate(prompts)]
    tokenizer = text_tokenizer(model.tokenizer)
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
