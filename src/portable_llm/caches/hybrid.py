"""The cache of a layer that has both attention and a recurrent mixer (Falcon-H1: attention and
Mamba-2 side by side): :class:`HybridCache`, one KV cache and one recurrent state, with the one
contract of a layer's cache (``offset``, ``left_padding``, ``trim``, the KV caches' checks).

A model's ``make_cache()`` gives each layer what its token mixers need: a
:class:`~portable_llm.KVCache` (or :class:`~portable_llm.RotatingKVCache`) for attention, a
:class:`~portable_llm.RecurrentCache` for a recurrent mixer (LFM2's short convolution, the gated
delta rule, the Mamba-2 scan), a :class:`HybridCache` for a layer with both.
:func:`attention_cache` and :func:`recurrent_cache` read the part of a layer's cache each mixer
takes.
"""

from __future__ import annotations

from typing import Any

from portable_llm.caches.recurrent import RecurrentCache

__all__ = ["HybridCache", "attention_cache", "recurrent_cache"]


class HybridCache:
    """One layer's KV cache and recurrent state, advanced and rewound together.

    Parameters
    ----------
    attention : KVCache or RotatingKVCache
        The layer's keys and values.
    recurrent : RecurrentCache
        The layer's recurrent state (its ``max_rewind``: the rewinds :meth:`trim` can make).
    """

    def __init__(self, attention: Any, recurrent: RecurrentCache) -> None:
        if not isinstance(recurrent, RecurrentCache):
            raise TypeError(
                f"HybridCache: recurrent must be a RecurrentCache, got {type(recurrent).__name__}"
            )
        if isinstance(attention, RecurrentCache | HybridCache) or not hasattr(
            attention, "update_and_fetch"
        ):
            raise TypeError(
                "HybridCache: attention must be a KV cache (KVCache, RotatingKVCache), got "
                f"{type(attention).__name__}"
            )
        self.attention, self.recurrent = attention, recurrent

    def __repr__(self) -> str:
        return f"HybridCache({self.attention!r}, {self.recurrent!r})"

    @property
    def offset(self) -> int:
        """Tokens (columns) seen so far: the attention's, which the recurrent state follows."""
        return int(self.attention.offset)

    @property
    def left_padding(self) -> Any:
        """The ``(B,)`` pad counts of the attention cache, or ``None``."""
        return self.attention.left_padding

    def check_update(self, backend: Any, shape: Any, dtype: Any, *, op: str) -> None:
        """What the attention cache's ``update_and_fetch`` would refuse of a chunk of keys
        ``shape`` (the recurrent state takes any chunk)."""
        self.attention.check_update(backend, shape, dtype, op=op)

    def trim(self, n: int, /) -> int:
        """Take back the last ``n`` tokens of both: the recurrent state first, which refuses
        (changing nothing) a rewind it kept no state for, then the keys."""
        got = self.recurrent.trim(n)
        self.attention.trim(got)
        return got

    def reset(self) -> None:
        """Forget the recurrent state (a KV cache is made anew instead)."""
        self.recurrent.reset()


def attention_cache(cache: Any) -> Any:
    """The part of a layer's cache that attention reads: a :class:`HybridCache`'s KV cache,
    ``None`` for a :class:`~portable_llm.RecurrentCache`, else the cache itself."""
    if isinstance(cache, HybridCache):
        return cache.attention
    return None if isinstance(cache, RecurrentCache) else cache


def recurrent_cache(cache: Any) -> RecurrentCache | None:
    """The part of a layer's cache that a recurrent mixer reads: a
    :class:`~portable_llm.RecurrentCache` itself, a :class:`HybridCache`'s, else ``None``."""
    if isinstance(cache, HybridCache):
        return cache.recurrent
    return cache if isinstance(cache, RecurrentCache) else None
