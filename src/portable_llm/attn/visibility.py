"""Which keys a query may see: the one rule behind every mask of the package.

Queries and keys carry *columns* (positions in the, possibly left-padded, sequence). Query
``i`` (of ``L``) sits at column ``q_start + i``; key ``j`` (of ``S``) at column ``k_pos[j]``.
By default ``q_start = S - L`` and ``k_pos[j] = j``: the bottom-right alignment, where the last
query meets the last key, as when ``L`` new tokens follow ``S - L`` cached ones. Key ``j`` is
visible to query ``i`` iff, with ``q = q_start + i`` and ``k = k_pos[j]``:

==========================  ===================================================================
``k <= q``                  causal (always)
``k > q - window``          a sliding window of ``window`` positions, the query's own included
``k // chunk == q // chunk``  chunked attention (Llama 4): the query's own chunk of ``chunk``
                            positions, chunks starting at position 0 (column ``origin``, and
                            ``origin + pad[b]`` in a left-padded row ``b``, as HF's mask)
``k < keep or k > q - ring``  a rotating cache's layout: the first ``keep`` columns (attention
                            sinks) and the last ``ring``
``k >= pad[b]``             left padding: row ``b``'s first ``pad[b]`` columns are pad tokens
==========================  ===================================================================

:func:`visible` is used by ``causal_mask``, the portable and tiled SDPA, every native kernel's
mask (through :class:`~portable_llm.attn.sdpa_args.SdpaOptions`), the KV caches' masks and the
attention block's left padding. :func:`zero_unseen` is the one fix-up of the native kernels for
rows that may see no key: they return zeros there, as the portable paths do.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.core.types import Array

__all__ = ["visible", "zero_unseen"]


def visible(
    xp: Any,
    L: int,
    S: int,
    /,
    *,
    q_start: Any = None,
    k_pos: Array | None = None,
    window: int | None = None,
    chunk: int | None = None,
    ring: int | None = None,
    keep: int = 0,
    pad: Array | None = None,
    origin: Any = 0,
    device: Any = None,
) -> Array:
    """Boolean mask: may query ``i`` attend key ``j`` (``True``: yes).

    Parameters
    ----------
    xp : namespace
        The array namespace of the result.
    L, S : int
        Number of queries and of keys.
    q_start : int or integer 0-d array, optional
        Column of the first query; default ``S - L`` (bottom-right). An array (a traced JAX
        scalar) lets one compiled program serve every offset.
    k_pos : integer array, shape ``(S,)``, optional
        Each key's column; default ``0 .. S - 1``.
    window : int >= 1, optional
        Sliding window: ``k > q - window``.
    chunk : int >= 1, optional
        Chunked attention (HF Llama 4's ``attention_chunk_size``): ``(k - o) // chunk == (q - o)
        // chunk`` with ``o = origin`` (``origin + pad[b]`` with left padding): chunks of
        positions, whatever the columns' offset.
    ring, keep : int, optional
        A rotating cache keeps the first ``keep`` columns and the last ``ring``:
        ``k < keep or k > q - ring``.
    pad : integer array, shape ``(B,)``, optional
        Left padding per row: ``k >= pad[b]``.
    origin : int or integer array broadcastable to ``(.., L, S)``, optional
        The column of position 0 (only the chunk rule reads it: the others are relative).
        A paged block whose keys start at position ``first`` passes ``-first``.
    device : optional
        Device of the index arrays (the backend's device object).

    Returns
    -------
    array of bool, shape ``(L, S)`` (``(N, L, S)`` for a ``(N, 1, 1)`` ``q_start`` or
    ``origin``), or ``(B, 1, L, S)`` with ``pad``
    """
    start = S - L if q_start is None else q_start
    q = xp.reshape(xp.arange(L, device=device), (L, 1)) + start  # query columns (L, 1)
    k = xp.reshape(xp.arange(S, device=device) if k_pos is None else k_pos, (1, S))  # (1, S)
    ok = k <= q  # (L, S)
    if window is not None:
        ok = xp.logical_and(ok, k > q - window)
    if ring is not None:
        ok = xp.logical_and(ok, xp.logical_or(k > q - ring, k < keep))
    if pad is None:
        if chunk is not None:
            ok = xp.logical_and(ok, (k - origin) // chunk == (q - origin) // chunk)
        return ok
    B = pad.shape[0]
    real = k >= xp.reshape(pad, (B, 1))  # (B, S): not a pad column
    ok = xp.logical_and(xp.reshape(ok, (1, 1, L, S)), xp.reshape(real, (B, 1, 1, S)))
    if chunk is not None:  # each row's chunks start at its first real column (HF's rule)
        o = xp.reshape(pad, (B, 1, 1, 1)) + origin  # (B, 1, 1, 1)
        q4, k4 = xp.reshape(q, (1, 1, L, 1)), xp.reshape(k, (1, 1, 1, S))
        ok = xp.logical_and(ok, (k4 - o) // chunk == (q4 - o) // chunk)  # (B, 1, L, S)
    return ok


def sees_any(xp: Any, mask: Array) -> Array:
    """Per query row, whether ``mask`` (boolean, or additive with ``-inf``) lets it see a key:
    ``mask``'s shape without the last axis."""
    if mask.dtype != xp.bool:
        mask = mask > -math.inf
    return xp.any(mask, axis=-1)


def zero_unseen(xp: Any, out: Array, mask: Array) -> Array:
    """``out`` (``(.., L, D)``) with zeros in the rows that ``mask`` (broadcastable to the scores
    ``(.., L, S)``) leaves no key: what the portable paths compute there (``0 / 1``), where fused
    kernels give NaN or the mean of the values."""
    sees = xp.expand_dims(sees_any(xp, mask), axis=-1)  # (.., L, 1)
    return xp.where(sees, out, xp.zeros_like(out))
