"""Paged KV cache: one sequence's block table over a shared :class:`PagePool`.

:class:`PagedKVCache` is one sequence of one layer, a drop-in for a batch-1
:class:`~portable_llm.KVCache`: ``model(ids, cache=[PagedKVCache(pool) for pool in pools])``.
Its keys live in the pages of its :attr:`~PagedKVCache.block_table`; pages are allocated as the
sequence grows and released by :meth:`~PagedKVCache.trim` and :meth:`~PagedKVCache.release`.
:meth:`~PagedKVCache.share` starts a sequence on pages another holder keeps (a prefix cache):
full pages are shared, and a page the sequence would write into while others hold it is copied
first (copy on write).
:func:`block_tables` packs the tables and lengths of a batch of such caches for
:func:`~portable_llm.paged_attention`, which reads the keys where they lie.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_llm.attn.visibility import visible
from portable_llm.caches.page_pool import PagePool, PagePoolExhausted
from portable_llm.core.checks import check_int, check_optional_int

__all__ = ["PagePool", "PagePoolExhausted", "PagedKVCache", "block_tables"]


class PagedKVCache:
    """One sequence of one layer, its keys and values in the pages of a :class:`PagePool`.

    Parameters
    ----------
    pool : PagePool
        The layer's pool (shared with the other sequences of the batch).

    Attributes
    ----------
    block_table : list of int
        The sequence's page ids, in order: token ``t`` is in page ``block_table[t // page_size]``
        at slot ``t % page_size``. Holds exactly ``ceil(offset / page_size)`` pages, plus any
        :meth:`reserve` added.
    pool : PagePool
    left_padding : None
        A paged sequence has no padding (the :class:`~portable_llm.KVCache` interface).

    Notes
    -----
    Every method that writes checks first and, on any error (a wrong dtype or shape, a pool
    with too few free pages), leaves the pool, the block table and the offset as they were.
    """

    left_padding: Any = None

    def __init__(self, pool: PagePool, /) -> None:
        if not isinstance(pool, PagePool):
            raise TypeError(f"PagedKVCache: pool must be a PagePool, got {type(pool).__name__}")
        self.pool = pool
        self.block_table: list[int] = []
        self._offset = 0
        self._last: int | None = None  # L of the last update (for make_mask)

    @property
    def offset(self) -> int:
        """Tokens held: the position of the next one."""
        return self._offset

    @property
    def capacity(self) -> int:
        """Tokens the pages of :attr:`block_table` can hold."""
        return len(self.block_table) * self.pool.page_size

    def __repr__(self) -> str:
        return f"PagedKVCache(offset={self._offset}, pages={self.block_table})"

    def _pages_for(self, end: int) -> int:
        """Pages to add so that positions ``0 .. end - 1`` are covered."""
        return max(0, -(-end // self.pool.page_size) - len(self.block_table))

    def share(self, pages: Sequence[int], length: int, /) -> None:
        """Start this (empty) cache with the first ``length`` tokens of a sequence whose pages,
        in order, are ``pages`` (kept by another holder, e.g. a prefix cache).

        The pages holding tokens ``0 .. length - 1`` get one more holder
        (:meth:`PagePool.share`); a partly filled last page is copied at once (copy on write:
        the next token is written there), so this cache writes only into pages of its own.
        :class:`PagePoolExhausted` (nothing changed) when no page is free for that copy.
        """
        op = "PagedKVCache.share"
        length = check_int(op, "length", length, low=0)
        if self.block_table or self._offset:
            raise ValueError(f"{op}: the cache already holds {self._offset} tokens")
        P = self.pool.page_size
        ids = self.pool.check_pages(op, pages, length)[: -(-length // P)]
        full = ids[: length // P]
        self.pool.share(full)
        if length % P:
            try:
                ids = [*full, self.pool.copy(ids[-1])]
            except BaseException:
                self.pool.free(full)
                raise
        self.block_table = list(ids)
        self._offset = length
        self._last = None

    def reserve(self, n_tokens: int, /) -> None:
        """Allocate the pages for ``n_tokens`` more tokens now; :class:`PagePoolExhausted`
        (nothing allocated) when they do not fit."""
        n = check_int("PagedKVCache.reserve", "n_tokens", n_tokens, low=0)
        self.block_table += self.pool.allocate(self._pages_for(self._offset + n))

    def append(self, k: Any, v: Any, /) -> None:
        """Store a chunk ``k, v`` ``(1, H_kv, L, D)`` after the tokens held (allocating pages as
        needed), without gathering the keys back: for a batched forward that then calls
        :func:`~portable_llm.paged_attention` over :func:`block_tables`."""
        self._append("PagedKVCache.append", k, v)

    def pages_needed(self, tokens: int, /) -> int:
        """Free pages of the pool an update of ``tokens`` more tokens takes: the new pages, and
        a copy of each shared page it would write into (copy on write)."""
        start, end, P = self._offset, self._offset + tokens, self.pool.page_size
        touched = self.block_table[start // P : -(-end // P)]
        return self._pages_for(end) + sum(self.pool.refcount(p) > 1 for p in touched)

    def check_update(
        self, backend: Any, shape: tuple[int, ...], dtype: Any, /, *, op: str | None = None
    ) -> None:
        """Raise what :meth:`update_and_fetch` of a chunk of this ``shape`` ``(1, H_kv, L,
        D)``, ``dtype`` and ``backend`` would raise, changing nothing (as
        :meth:`KVCache.check_update <portable_llm.KVCache.check_update>`): the pool's layout,
        and :class:`PagePoolExhausted` when the pool has too few free pages for it."""
        op = op or "PagedKVCache.update_and_fetch"
        self.pool.check_layout(op, backend, tuple(shape), dtype, heads_axis=1)
        need = self.pages_needed(int(shape[2]))
        if need > self.pool.num_free:
            raise PagePoolExhausted(
                f"{op}: {shape[2]} more tokens need {need} free pages, the pool has "
                f"{self.pool.num_free} of {self.pool.num_pages}"
            )

    def _append(self, op: str, k: Any, v: Any) -> int:
        pool = self.pool
        k, v = pool.check_chunk(op, k, v, heads_axis=1)
        L = int(k.shape[2])
        start = self._offset
        self._own_pages(start, start + L)
        new = pool.allocate(self._pages_for(start + L))  # raises before any change
        try:
            pool.write_checked(self.block_table + new, start, k[0, ...], v[0, ...])
        except BaseException:
            pool.free(new)
            raise
        self.block_table += new
        self._offset = start + L
        self._last = L
        return L

    def _own_pages(self, start: int, end: int) -> None:
        """Copy on write: each page of the block table that positions ``start .. end - 1``
        touch and that others also hold is replaced by a copy of its own."""
        P, pool = self.pool.page_size, self.pool
        for i in range(start // P, min(len(self.block_table), -(-end // P))):
            page = self.block_table[i]
            if pool.refcount(page) > 1:
                self.block_table[i] = pool.copy(page)
                pool.free([page])

    def update_and_fetch(self, k: Any, v: Any, /) -> tuple[Any, Any]:
        """Append a chunk; return every key and value so far.

        Parameters
        ----------
        k, v : array, shape ``(1, H_kv, L, D)``, the pool's dtype and backend

        Returns
        -------
        (k_all, v_all) : arrays, shape ``(1, H_kv, S, D)``, ``S = offset``
            Gathered from the pages (a copy): attend with ``mask="causal"``.
        """
        self._append("PagedKVCache.update_and_fetch", k, v)
        k_all, v_all = self.pool.gather(self.block_table, self._offset)
        xp = self.pool.backend.xp
        return xp.expand_dims(k_all, axis=0), xp.expand_dims(v_all, axis=0)  # (1, H_kv, S, D)

    def trim(self, n: int, /) -> int:
        """Forget the last ``n`` tokens (speculative decoding's rewind) and release the pages no
        longer needed; return ``n``. ``ValueError`` when ``n`` exceeds :attr:`offset`."""
        n = check_int("PagedKVCache.trim", "n", n, low=0)
        if n > self._offset:
            raise ValueError(
                f"PagedKVCache.trim: n={n} exceeds the tokens in the cache (offset {self._offset})"
            )
        self._offset -= n
        keep = -(-self._offset // self.pool.page_size)
        if keep < len(self.block_table):
            self.pool.free(self.block_table[keep:])
            self.block_table = self.block_table[:keep]
        self._last = None
        return n

    def release(self) -> None:
        """Free every page; the cache is then empty (offset 0)."""
        self.pool.free(self.block_table)
        self.block_table = []
        self._offset = 0
        self._last = None

    def make_mask(
        self, *, window: int | None = None, chunk: int | None = None
    ) -> tuple[Any, int | None]:
        """``("causal", window)``: the keys :meth:`update_and_fetch` returns are positions
        ``0 .. offset - 1`` in order, so the last update's queries attend bottom-right causal
        (within ``window`` when given), as with :meth:`KVCache.make_mask
        <portable_llm.KVCache.make_mask>`; with Llama 4's ``chunk``, the boolean ``(1, 1, L,
        S)`` mask of :func:`~portable_llm.attn.visibility.visible`."""
        name = "PagedKVCache.make_mask"
        window = check_optional_int(name, "window", window, low=1)
        chunk = check_optional_int(name, "chunk", chunk, low=1)
        if self._last is None:
            raise ValueError(f"{name}: no update since the cache was made or trimmed")
        if chunk is None:
            return "causal", window
        L, S, bk = self._last, self._offset, self.pool.backend
        mask = visible(bk.xp, L, S, window=window, chunk=chunk, device=self.pool.device)
        return bk.xp.reshape(mask, (1, 1, L, S)), None

    def reuse_mask(self) -> None:
        """As :meth:`KVCache.reuse_mask <portable_llm.KVCache.reuse_mask>`: the last update's
        queries attend with a mask built for another cache; nothing to note here (no guard)."""


def block_tables(caches: Sequence[PagedKVCache], /) -> tuple[Any, Any]:
    """The block tables and lengths of a batch of sequences, for
    :func:`~portable_llm.paged_attention`.

    Parameters
    ----------
    caches : sequence of B PagedKVCache
        One layer's caches, all over one pool.

    Returns
    -------
    (tables, context_lens)
        int32 arrays ``(B, max_pages)`` (row ``b``: ``caches[b].block_table`` padded with 0)
        and ``(B,)`` (each cache's :attr:`~PagedKVCache.offset`), on the pool's backend and
        device.
    """
    op = "block_tables"
    caches = list(caches)
    if not caches:
        raise ValueError(f"{op}: caches is empty (give one PagedKVCache per row)")
    for i, c in enumerate(caches):
        if not isinstance(c, PagedKVCache):
            raise TypeError(f"{op}: caches[{i}] must be a PagedKVCache, got {type(c).__name__}")
        if c.pool is not caches[0].pool:
            raise ValueError(f"{op}: caches[{i}] uses another pool than caches[0] (one layer)")
    pool = caches[0].pool
    width = max(1, max(len(c.block_table) for c in caches))
    tables = np.zeros((len(caches), width), dtype=np.int32)
    for b, c in enumerate(caches):
        tables[b, : len(c.block_table)] = c.block_table
    lens = np.asarray([c.offset for c in caches], dtype=np.int32)
    bk = pool.backend
    return bk.from_numpy(tables, pool.device), bk.from_numpy(lens, pool.device)
