"""The check a forward runs on every layer's cache before the first layer writes to any.

A forward updates its layers' caches one after another. A cache that refuses the chunk (another
batch size or dtype, a pool out of pages, another thread) used to raise once the layers before
it had already taken the chunk: ``model(ids, cache=c)`` with ``c[1]`` refusing left ``c[0]``
advanced (offsets ``[0, 2] -> [2, 2]``), and the caches no longer described one sequence.
:func:`check_caches` asks each cache first (its ``check_update``: what ``update_and_fetch``
would raise, changing nothing), so a refused update leaves every cache as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portable_llm.caches.page_pool import PagePoolExhausted
from portable_llm.caches.paged import PagedKVCache

__all__ = ["check_caches", "check_pool_pages"]


def check_caches(
    op: str,
    caches: Sequence[Any],
    /,
    *,
    backend: Any,
    shape: tuple[int, int, int, int] | Sequence[tuple[int, int, int, int]],
    dtype: Any,
    name: str = "cache",
) -> None:
    """Check that every layer's cache of one forward takes a chunk ``(B, H_kv, L, D)``.

    Parameters
    ----------
    op : str
        The caller, first in the errors.
    caches : sequence of caches, one per layer
        ``None`` entries (a layer without a cache) and caches without ``check_update`` (a
        user's own class) are skipped.
    backend, shape, dtype
        The library, shape ``(B, H_kv, L, D)`` and dtype of the keys each layer will write
        (``shape``: one per layer where they differ, DeepSeek V3's latent layers).
    name : str
        The argument that holds ``caches``, in the errors (``cache[1]: ...``).

    Raises
    ------
    ValueError
        The caches hold different offsets (one forward's positions start at one offset), or a
        cache refuses the chunk's shape.
    TypeError, RuntimeError, PagePoolExhausted
        What the refusing cache's ``update_and_fetch`` would raise.
    """
    offsets = [getattr(c, "offset", None) for c in caches]
    held = {o for o in offsets if o is not None}
    if len(held) > 1:
        raise ValueError(
            f"{op}: the caches of one forward must hold one offset (the new tokens' first "
            f"position), got {name} offsets {offsets}"
        )
    per_layer = [shape] * len(caches) if isinstance(shape[0], int) else list(shape)
    for i, c in enumerate(caches):
        check = getattr(c, "check_update", None)
        if check is not None:
            check(backend, per_layer[i], dtype, op=f"{op}: {name}[{i}]")
    if per_layer:
        check_pool_pages(op, [caches], per_layer[0][2], name=name)  # type: ignore[index]


def check_pool_pages(
    op: str, rows: Sequence[Sequence[Any]], tokens: int, /, *, name: str = "caches"
) -> None:
    """:class:`PagePoolExhausted` (nothing allocated) when the paged caches of ``rows`` (each
    row: one sequence's caches, one per layer) that share a pool need, for ``tokens`` more
    tokens each, more pages than it has free; other caches are skipped."""
    need: dict[int, int] = {}
    pools: dict[int, Any] = {}
    for seq in rows:
        for c in seq:
            if isinstance(c, PagedKVCache):
                key = id(c.pool)
                pools[key] = c.pool
                need[key] = need.get(key, 0) + c.pages_needed(tokens)
    for key, n in need.items():
        pool = pools[key]
        if n > pool.num_free:
            raise PagePoolExhausted(
                f"{op}: {len(rows)} sequence(s) of {name} need {n} free pages of one layer's "
                f"pool for {tokens} more tokens each; it has {pool.num_free} of {pool.num_pages}"
            )
