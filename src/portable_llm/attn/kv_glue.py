"""What the attention block asks of a KV cache, and its left padding without one.

The caches (:mod:`portable_llm.caches`) sit above this layer: the block never imports them. It
takes any object with the :class:`AttentionCache` interface, which both caches have.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, runtime_checkable

from portable_llm.attn.visibility import visible
from portable_llm.core.types import Array

__all__ = ["AttentionCache", "block_kv_mask", "block_offset"]


@runtime_checkable
class AttentionCache(Protocol):
    """A layer's KV cache as the attention block uses it (``KVCache``, ``RotatingKVCache``)."""

    @property
    def offset(self) -> int:
        """Tokens seen so far: the position of the first new one."""
        ...

    @property
    def left_padding(self) -> Any:
        """The ``(B,)`` pad counts, or ``None``."""
        ...

    def update_and_fetch(self, k: Array, v: Array, /) -> tuple[Array, Array]:
        """Store the chunk; return every key and value to attend."""
        ...

    def make_mask(
        self, *, window: int | None = None, chunk: int | None = None
    ) -> tuple[Any, int | None]:
        """``(mask, window)`` for the keys the last update returned."""
        ...

    def reuse_mask(self) -> None:
        """The last update's queries attend with a mask built for another cache of the same
        kind that saw the same updates (what :meth:`make_mask` would give)."""
        ...


def block_offset(op: str, cache: Any, offset: Any, left_padding: Any) -> int:
    """Check the block's ``cache=`` (and what may come with it); return its RoPE offset."""
    if not isinstance(cache, AttentionCache):
        raise TypeError(
            f"{op}: cache must be a KVCache or RotatingKVCache, got {type(cache).__name__}"
        )
    if left_padding is not None:
        raise ValueError(f"{op}: with a cache, give left_padding to the cache, not to {op}")
    if (
        isinstance(offset, bool)
        or not isinstance(offset, numbers.Integral)
        or int(offset) not in (0, cache.offset)
    ):
        raise ValueError(
            f"{op}: with a cache, positions start at cache.offset ({cache.offset}); leave offset "
            f"at 0, got {offset!r}"
        )
    return cache.offset


def block_kv_mask(
    op: str, xp: Any, cache: Any, pad: Any, k: Any, v: Any, mask: Any, window: Any, device: Any,
    *, chunk: int | None = None,
) -> tuple[Any, Any, Any, int | None]:  # fmt: skip
    """Store the chunk in ``cache`` (if any); the keys, values, ``mask`` and ``window`` to attend.

    Without a cache, ``pad`` (the left padding) masks the padded keys of ``k``. An array
    ``mask`` (over the ``S`` keys returned) is and-ed with the cache's or the padding's mask.
    ``chunk``: Llama 4's chunked attention, in the cache's mask or the padding's.
    """
    if (isinstance(mask, str) and mask != "causal") or mask is None:
        raise ValueError(
            f"{op}: with a cache or left_padding, mask must be 'causal' or an array, got {mask!r}"
        )
    L = k.shape[2]
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
        base, window = cache.make_mask(window=window, chunk=chunk)
    else:
        base = visible(xp, L, L, window=window, chunk=chunk, pad=pad, device=device)
        window = None
    if isinstance(mask, str):
        return k, v, base, window
    S = k.shape[2]
    if mask.ndim < 2 or mask.shape[-1] not in (1, S) or mask.shape[-2] not in (1, L):
        raise ValueError(
            f"{op}: the mask of shape {tuple(mask.shape)} must broadcast to (B, H, L, S) = "
            f"(.., .., {L}, {S}): the {L} queries over the {S} keys the cache returned"
        )
    if base is None:
        return k, v, mask, None
    if isinstance(base, str):  # bottom-right causal, with the window
        base = visible(xp, L, S, window=window, device=device)
    if mask.dtype == xp.bool:
        return k, v, xp.logical_and(base, mask), None
    return k, v, xp.where(base, mask, -math.inf), None
