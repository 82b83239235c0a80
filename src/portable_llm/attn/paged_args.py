"""Argument checks of paged attention, and the options record its implementations receive.

:func:`paged_args` checks the public arguments (reading the block tables and lengths once on
the host) and turns them into the ``(arrays, {"opts": PagedOptions})`` every implementation
(portable, blocked, native) is called with:
``fn(xp, q, k_pages, v_pages, tables, context_lens, page_map, opts=o)``. The pool is duck-typed (its
``k_pages``, ``v_pages``): attention sits below the caches and never imports them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from portable_llm.attn.sdpa_args import SdpaOptions, check_window, int_option, real_option
from portable_llm.attn.visibility import visible
from portable_llm.backends import Backend
from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import check_float
from portable_llm.core.types import Array

__all__ = ["OP", "UNUSED", "PagedOptions", "paged_args"]

OP = "paged_attention"


@dataclasses.dataclass(frozen=True)
class PagedOptions:
    """The checked options of one paged-attention call (frozen, hashable: JAX compiles on it).

    Attributes
    ----------
    sdpa : SdpaOptions
        ``scale`` and ``softcap`` of the attention over the gathered keys (``causal`` is
        ``False``: :meth:`mask` holds the per-row causal rule).
    window : int >= 1 or None
        Sliding window.
    chunk : int >= 1 or None
        Llama 4's chunked attention (chunks of positions).
    block_pages : int >= 1
        Pages per block of the blocked path.
    """

    sdpa: SdpaOptions
    window: int | None = None
    block_pages: int = 16
    chunk: int | None = None

    # The native kernels (a lower layer than attn/) reach the gather and the one visibility
    # rule through the record they are given: these two methods.
    @staticmethod
    def gather(xp: Any, pages: Array, tables: Array) -> Array:
        """The pages ``tables`` ``(B, M)`` names, as contiguous keys ``(B, H_kv, M * P, D)``.

        One ``take`` of whole pages (contiguous rows of ``pages`` ``(N, H_kv, P, D)``), then the
        head axis moved forward: faster than a ``take`` from the head-major view on torch (12
        vs 17 ms for 16 MiB) and eager JAX (52 vs 127 ms), the same on NumPy and MLX (measured).
        """
        B, M = tables.shape
        _, H, P, D = pages.shape
        g = xp.reshape(xp.take(pages, xp.reshape(tables, (-1,)), axis=0), (B, M, H, P, D))
        return xp.reshape(xp.permute_dims(g, (0, 2, 1, 3, 4)), (B, H, M * P, D))

    def mask(self, xp: Any, context_lens: Array, L: int, S: int, first: Any, device: Any) -> Array:
        """Boolean ``(B, 1, L, S)``: query ``i`` of row ``b`` (at position
        ``context_lens[b] - L + i``) may see gathered key ``j`` (at position ``first + j``).

        Causal per row (bottom-right), within :attr:`window` and :attr:`chunk`: keys past a
        row's length are after its last query, so they are hidden too.
        """
        B = context_lens.shape[0]
        q0 = xp.reshape(context_lens, (B, 1, 1)) - (L + first)  # per-row q_start: (B, 1, 1)
        ok = visible(
            xp, L, S, q_start=q0, window=self.window, chunk=self.chunk, origin=-first,
            device=device,
        )  # (B, L, S); positions are columns + first  # fmt: skip
        return xp.reshape(ok, (B, 1, L, S))


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_int_array(op: str, name: str, x: Any, bk: Backend, ndim: int, layout: str) -> None:
    if bk.dtype_name(x.dtype) not in ("int8", "int16", "int32", "int64", "uint8", "uint16",
                                      "uint32", "uint64"):  # fmt: skip
        raise TypeError(
            f"{op}: {name} must be an integer array {layout}, got {bk.dtype_name(x.dtype)} "
            f"with shape {_shape(x)}"
        )
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have shape {layout}, got {_shape(x)}")


def _index(bk: Backend, x: Any) -> Any:
    """``x`` as a signed index array: int32 and int64 kept, any other integer dtype cast to
    int32 (its values already checked where they are on the host). The kernels compute
    ``context_lens - L - first`` (negative for the keys before a block) and index with the
    tables: unsigned dtypes wrap there, and torch has no arithmetic nor ``index_select`` for
    uint16/uint32."""
    if bk.dtype_name(x.dtype) in ("int32", "int64"):
        return x
    return bk.xp.astype(x, bk.xp.int32)


def _check_metadata(
    op: str, bk: Backend, tables: Any, lens: Any, L: int, P: int, N: int
) -> tuple[Any, np.ndarray, np.ndarray]:
    """Host checks of the block tables and lengths; the tables cut to the pages used (entries
    past a row's pages zeroed when they point outside the pool), and on the host the table
    entries and which of them the lengths use."""
    t, n = to_numpy(tables).astype(np.int64), to_numpy(lens).astype(np.int64)
    B, M = t.shape
    for b in range(B):
        if n[b] < 0:
            raise ValueError(
                f"{op}: context_lens[{b}] = {n[b]} is negative (context_lens {n.shape})"
            )
        if n[b] < L:
            raise ValueError(
                f"{op}: context_lens[{b}] = {n[b]} is shorter than the query length L={L}: the "
                f"{L} queries are the last L tokens of each row's context"
            )
    need = -(-n // P)  # (B,) pages each row uses
    width = int(need.max()) if B else 0
    if width > M:
        b = int(np.argmax(need))
        raise ValueError(
            f"{op}: context_lens[{b}] = {n[b]} needs {need[b]} pages of {P} tokens, but "
            f"block_tables has shape {(B, M)}"
        )
    used = np.arange(M)[None, :] < need[:, None]  # (B, M)
    bad = used & ((t < 0) | (t >= N))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{op}: block_tables[{b}, {j}] = {t[b, j]} is not a page of the pool (0 .. {N - 1}, "
            f"k_pages has {N} pages); block_tables has shape {(B, M)}"
        )
    width = max(width, 1)
    if ((~used[:, :width]) & ((t[:, :width] < 0) | (t[:, :width] >= N))).any():
        # Unused entries are never read, but a gather must not see them out of range.
        t = np.where(used, t, 0)
        tables = bk.from_numpy(t[:, :width].astype(np.int32), bk.device_of(tables))
    elif width < M:
        tables = tables[:, :width]
    return tables, t, used


#: Position of the first slot of a page no row uses, in a page map: after every query.
UNUSED = 1 << 30


def _page_map(t: np.ndarray, used: np.ndarray, N: int, P: int) -> np.ndarray | None:
    """``(2, N)`` int32: the row that owns each page of the pool and the position of its first
    slot (:data:`UNUSED` for pages no row uses); ``None`` when a page is in two rows."""
    ids = t[used]
    if np.unique(ids).size != ids.size:
        return None
    rows, cols = np.nonzero(used)  # the same (row-major) order as t[used]
    out = np.zeros((2, N), dtype=np.int64)
    out[1] = UNUSED
    out[0, ids], out[1, ids] = rows, cols * P
    return out.astype(np.int32)


def paged_args(
    op: str,
    bk: Backend,
    q: Any,
    k_pages: Any,
    v_pages: Any,
    tables: Any,
    lens: Any,
    *,
    scale: Any,
    window: Any,
    softcap: Any,
    block_pages: Any,
    impl: str,
    chunk: Any = None,
) -> tuple[tuple[Any, ...], dict[str, PagedOptions]]:
    """Validate a paged-attention call before any compute; the arrays and options to run.

    The arrays are ``(q, k_pages, v_pages, tables, context_lens, page_map)``; ``page_map``
    (``(2, N)`` int32, see :func:`_page_map`) is given when the pool-wide path is to run
    (``impl="pool"``, or ``"auto"`` where it pays), else ``None``.
    """
    _check_arrays(op, bk, q, k_pages, v_pages, tables, lens)
    opts = _options(
        op, q.shape[-1], scale=scale, window=window, softcap=softcap, block_pages=block_pages,
        chunk=chunk,
    )  # fmt: skip
    page_map = None
    if not (bk.is_traced(tables) or bk.is_traced(lens)):
        tables, page_map = _checked_tables(op, bk, impl, q, k_pages, tables, lens)
    tables, lens = _index(bk, tables), _index(bk, lens)
    return (q, k_pages, v_pages, tables, lens, page_map), {"opts": opts}


def _check_arrays(
    op: str, bk: Backend, q: Any, k_pages: Any, v_pages: Any, tables: Any, lens: Any
) -> None:
    """The shapes and dtypes of a paged-attention call's arrays (no host read)."""
    check_float(op, "q", q, bk)
    if q.ndim != 4:
        raise ValueError(f"{op}: q must have shape (B, H, L, D), got {_shape(q)}")
    for name, x in (("pool.k_pages", k_pages), ("pool.v_pages", v_pages)):
        check_float(op, name, x, bk)
        if x.ndim != 4:
            raise ValueError(
                f"{op}: {name} must have shape (num_pages, H_kv, page_size, D), got {_shape(x)}"
            )
    if _shape(k_pages) != _shape(v_pages):
        raise ValueError(
            f"{op}: pool.k_pages {_shape(k_pages)} and pool.v_pages {_shape(v_pages)} differ"
        )
    if q.dtype != k_pages.dtype or q.dtype != v_pages.dtype:
        raise TypeError(
            f"{op}: q ({bk.dtype_name(q.dtype)}, {_shape(q)}) and the pool's pages "
            f"({bk.dtype_name(k_pages.dtype)}, {_shape(k_pages)}) must share one dtype"
        )
    B, H, _, D = _shape(q)
    _, H_kv, P, D_k = _shape(k_pages)
    if D_k != D:
        raise ValueError(f"{op}: q {_shape(q)} and pool.k_pages {_shape(k_pages)} differ in D")
    if P < 1:
        raise ValueError(
            f"{op}: the pool's pages must hold page_size >= 1 tokens, got page_size={P} "
            f"(pool.k_pages {_shape(k_pages)} is (num_pages, H_kv, page_size, D))"
        )
    if H_kv == 0 or H % H_kv:
        raise ValueError(
            f"{op}: q's heads H={H} must be a multiple of the pool's H_kv={H_kv}; q {_shape(q)}, "
            f"pool.k_pages {_shape(k_pages)}"
        )
    _check_int_array(op, "block_tables", tables, bk, 2, "(B, max_pages)")
    _check_int_array(op, "context_lens", lens, bk, 1, "(B,)")
    if tables.shape[0] != B or lens.shape[0] != B:
        raise ValueError(
            f"{op}: block_tables {_shape(tables)} and context_lens {_shape(lens)} must have q's "
            f"batch size B={B} (q {_shape(q)})"
        )


def _options(
    op: str, D: int, *, scale: Any, window: Any, softcap: Any, block_pages: Any, chunk: Any
) -> PagedOptions:
    """The checked options of a paged-attention call (``D``: the head dim, for the scale)."""
    window = check_window(op, window)
    chunk = int_option(op, "chunk", chunk, low=1, optional=True)
    if softcap is not None:
        softcap = real_option(op, "softcap", softcap, "a positive finite number or None", low=0.0)
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D else 1.0
    else:
        scale = real_option(op, "scale", scale, "a finite number or None")
    block_pages = int_option(op, "block_pages", block_pages, low=1)
    return PagedOptions(
        sdpa=SdpaOptions(scale=scale, softcap=softcap), window=window, block_pages=block_pages,
        chunk=chunk,
    )  # fmt: skip


def _checked_tables(
    op: str, bk: Backend, impl: str, q: Any, k_pages: Any, tables: Any, lens: Any
) -> tuple[Any, Any]:
    """The tables checked against the lengths and the pool (one host read), and the page map
    of the pool-wide path where it runs (``impl="pool"``, or ``"auto"`` where it pays), else
    ``None``."""
    _, H, L, _ = _shape(q)
    N, H_kv, P, _ = _shape(k_pages)
    tables, t, used = _check_metadata(op, bk, tables, lens, L, P, N)
    # The pool-wide path reads every page of the pool once, and copies q once per page:
    # it pays when the rows' pages fill most of the pool and G * L <= P (decode).
    dense = 2 * int(used.sum()) >= N and (H // H_kv) * L <= P
    if not (impl == "pool" or (impl == "auto" and dense)):
        return tables, None
    host = _page_map(t, used, N, P)
    if host is None and impl == "pool":
        raise ValueError(
            f"{op}: impl='pool' needs each page in at most one row; block_tables "
            f"{_shape(tables)} gives a page to two rows"
        )
    return tables, None if host is None else bk.from_numpy(host, bk.device_of(q))
