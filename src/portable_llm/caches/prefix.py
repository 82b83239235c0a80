"""Prefix caching: pages of token prefixes kept in the pools for the next sequence that starts
with them.

A :class:`PrefixCache` indexes pages by the tokens they hold, one page-sized block at a time,
each block keyed by its tokens and its parent's key (vLLM's hash chain, kept as exact token
tuples: no collisions). :meth:`PrefixCache.insert` registers the pages of a sequence (the cache
becomes one more holder of each, :meth:`~portable_llm.caches.page_pool.PagePool.share`), the last
block possibly partly filled; :meth:`PrefixCache.match` finds the longest registered prefix of a
prompt; :meth:`~portable_llm.caches.paged.PagedKVCache.share` then starts a sequence on those
pages (copying a partly filled last page before writing into it). :meth:`PrefixCache.evict`
frees the least recently used blocks that no sequence holds when the pools run short.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from portable_llm.caches.page_pool import PagePool
from portable_llm.core.checks import check_int

__all__ = ["PrefixCache"]

_Key = tuple[int, tuple[int, ...]]  # (the parent block's id, -1 at the start; the tokens)
_ROOT = -1


@dataclass
class _Block:
    id: int
    pages: tuple[int, ...]  # the block's page in each layer's pool
    tokens: tuple[int, ...]  # page_size tokens, or fewer for a partly filled last block
    parent: int  # the parent block's id (_ROOT: none)
    used: int = 0  # tick of the last match or insert (least recently used goes first)


class PrefixCache:
    """Pages of token prefixes, shared by reference counts with the sequences that use them.

    Parameters
    ----------
    pools : sequence of PagePool
        One per layer, all of one page size; a sequence holds its ``i``-th page in each.

    Notes
    -----
    Not thread-safe: the thread that steps the batch generator owns it. Blocks are keyed by
    exact token tuples, so two prompts share pages only where their tokens (and every token
    before them) are equal, and the keys and values in those pages are those the model computed
    for that very prefix: reusing them changes no output (up to the rounding of a batched
    forward, as :class:`~portable_llm.generation.batch.BatchGenerator` states).
    """

    def __init__(self, pools: Sequence[PagePool], /) -> None:
        self.pools = list(pools)
        if not self.pools or not all(isinstance(p, PagePool) for p in self.pools):
            raise TypeError("PrefixCache: pools must be a non-empty sequence of PagePool")
        self.page_size = self.pools[0].page_size
        if any(p.page_size != self.page_size for p in self.pools):
            raise ValueError("PrefixCache: the pools have different page sizes")
        self._blocks: dict[_Key, _Block] = {}
        self._children: dict[int, set[_Key]] = {}  # parent id -> the keys of its blocks
        self._tick = itertools.count(1)

    def __repr__(self) -> str:
        return f"PrefixCache(blocks={self.num_blocks}, idle={self.num_idle})"

    @property
    def num_blocks(self) -> int:
        """Blocks (one page per pool each) the cache holds."""
        return len(self._blocks)

    @property
    def num_idle(self) -> int:
        """Blocks that only the cache holds (:meth:`evict` can free them)."""
        pool = self.pools[0]
        return sum(pool.refcount(b.pages[0]) == 1 for b in self._blocks.values())

    def match(
        self, tokens: Sequence[int], /, *, limit: int | None = None
    ) -> tuple[int, list[list[int]]]:
        """The longest cached prefix of ``tokens`` (at most ``limit`` tokens).

        Returns
        -------
        (length, pages)
            ``length`` tokens are cached; ``pages[i]`` lists pool ``i``'s pages holding them,
            in order (the last one partly used when ``length % page_size``). ``(0, [])`` when
            nothing matches. The cache keeps its references: hand the pages to
            :meth:`~portable_llm.caches.paged.PagedKVCache.share` before anything may
            :meth:`evict`.
        """
        n = len(tokens) if limit is None else check_int("PrefixCache.match", "limit", limit)
        P, found, length, parent = self.page_size, [], 0, _ROOT
        for start in range(0, min(n, len(tokens)), P):
            block_tokens = tuple(int(t) for t in tokens[start : min(start + P, n)])
            key: _Key = (parent, block_tokens)
            block = self._blocks.get(key) if len(block_tokens) == P else None
            if block is not None:
                found.append(block)
                length += P
                parent = block.id
                continue
            # no full block: the sibling sharing the longest start with these tokens
            best, common = None, 0
            for child in self._children.get(parent, ()):
                c = _common(self._blocks[child].tokens, block_tokens)
                if c > common:
                    best, common = self._blocks[child], c
            if best is not None:
                found.append(best)
                length += common
            break
        tick = next(self._tick)
        for block in found:
            block.used = tick
        if not found:
            return 0, []
        return length, [[b.pages[i] for b in found] for i in range(len(self.pools))]

    def insert(self, tokens: Sequence[int], pages: Sequence[Sequence[int]], /) -> int:
        """Register the pages of a sequence holding ``tokens`` (``pages[i]``: pool ``i``'s, in
        order, covering every token; the cache becomes one more holder of each page it keeps).
        Blocks already cached keep their pages. Returns the blocks added."""
        op = "PrefixCache.insert"
        if len(pages) != len(self.pools):
            raise ValueError(f"{op}: pages must hold one list per pool ({len(self.pools)})")
        P = self.page_size
        need = -(-len(tokens) // P)
        if any(len(p) < need for p in pages):
            raise ValueError(f"{op}: {len(tokens)} tokens need {need} pages per pool")
        added, tick, parent = 0, next(self._tick), _ROOT
        for j in range(need):
            block_tokens = tuple(int(t) for t in tokens[j * P : (j + 1) * P])
            key: _Key = (parent, block_tokens)
            block = self._blocks.get(key)
            if block is None:
                ids = tuple(int(p[j]) for p in pages)
                for pool, page in zip(self.pools, ids, strict=True):
                    pool.share([page])
                block = _Block(next(self._tick), ids, block_tokens, parent)
                self._blocks[key] = block
                self._children.setdefault(parent, set()).add(key)
                added += 1
            block.used = tick
            parent = block.id
        return added

    def evict(self, n_pages: int, /) -> int:
        """Free blocks that only the cache holds, least recently used first and children before
        their parents, until ``n_pages`` pages per pool came back or none is left; return the
        pages freed per pool."""
        want = check_int("PrefixCache.evict", "n_pages", n_pages, low=0)
        freed, pool0 = 0, self.pools[0]
        while freed < want:
            leaves = sorted(
                (b.used, i, key)
                for i, (key, b) in enumerate(self._blocks.items())
                if not self._children.get(b.id) and pool0.refcount(b.pages[0]) == 1
            )
            if not leaves:
                break
            for _, _, key in leaves[: want - freed]:
                self._drop(key)
                freed += 1
        return freed

    def _drop(self, key: _Key) -> None:
        block = self._blocks.pop(key)
        self._children.pop(block.id, None)
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[block.parent]
        for pool, page in zip(self.pools, block.pages, strict=True):
            pool.free([page])

    def clear(self) -> None:
        """Give every block's pages back (the sequences that share them keep theirs)."""
        for block in self._blocks.values():
            for pool, page in zip(self.pools, block.pages, strict=True):
                pool.free([page])
        self._blocks.clear()
        self._children.clear()


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the common start of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
