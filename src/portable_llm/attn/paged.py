"""Paged attention: queries over keys scattered across the pages of a pool, per block table.

Row ``b`` of a batch holds ``context_lens[b]`` tokens, token ``t`` in page
``block_tables[b, t // P]`` at slot ``t % P`` of the pool's ``(N, H_kv, P, D)`` pages. Its ``L``
queries are its last ``L`` tokens (positions ``context_lens[b] - L .. context_lens[b] - 1``) and
attend causally, bottom-right per row, so one call serves a decode batch of unequal lengths
(``L = 1``) and chunked prefill (``L > 1``).

Implementations (all called ``fn(xp, q, k_pages, v_pages, tables, context_lens, page_map,
opts=o)``; with attention sinks, ``sinks`` ``(H,)`` is an eighth array, as in
:mod:`portable_llm.attn.sdpa_args`):

- ``"portable"``: gather the pages each row uses into contiguous keys with one ``take``, then the
  direct attention of :mod:`portable_llm.attn.sdpa` under the per-row mask (scores, softmax and
  sum in float32, rounded once to q's dtype);
- ``"blocked"``: flash attention's online softmax over blocks of ``block_pages`` pages, gathering
  one block at a time (the tiled SDPA's block step): memory ``O(L x block)`` per head;
- ``"pool"``: no gather: every page attended where it lies in the pool, the pages of each row
  then combined (:mod:`portable_llm.attn.paged_pool`); ``auto`` takes it for decode batches
  whose pages fill most of the pool;
- ``"native"``: a backend's fused attention kernel over the gathered keys, with the same mask;
  a native kernel may also take the page map ``auto`` builds (torch's: the pool-wide path with
  its steps in place), where its ``prefer`` does not decline it.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.attn import paged_pool  # noqa: F401  (registers impl="pool")
from portable_llm.attn.paged_args import OP, PagedOptions, paged_args
from portable_llm.attn.sdpa import (
    empty,
    sdpa_direct,
    sink_rows,
    sink_step,
    tiled_block,
    tiled_finish,
)
from portable_llm.attn.sdpa_args import check_sinks
from portable_llm.backends import backend_of, resolve
from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import float_compute_dtype
from portable_llm.core.dispatch import auto_portable, pick, portable

__all__ = ["BLOCKED_MIN_KEYS", "OP", "PagedOptions", "paged_attention"]

#: ``impl="auto"`` without an applicable native kernel takes the blocked path once a row's
#: gathered keys times the queries reach this many scores (as the tiled SDPA's threshold).
BLOCKED_MIN_KEYS = 1 << 20


def _device(x: Any) -> Any:
    return getattr(x, "device", None)  # MLX arrays have none (unified memory)


@portable(OP, pure=True)
def _paged_direct(
    xp: Any,
    q: Any,
    k_pages: Any,
    v_pages: Any,
    tables: Any,
    lens: Any,
    page_map: Any,
    sinks: Any = None,
    *,
    opts: PagedOptions,
) -> Any:
    """Gather every page used, then the direct attention under the per-row causal mask."""
    k = opts.gather(xp, k_pages, tables)  # (B, H_kv, S, D)
    v = opts.gather(xp, v_pages, tables)
    mask = opts.mask(xp, lens, q.shape[2], k.shape[2], 0, _device(q))  # (B, 1, L, S)
    return sdpa_direct(xp, q, k, v, mask, sinks, opts=opts.sdpa)


_BLOCKED = OP + ".blocked"


@portable(_BLOCKED, "start", pure=True)
def _blocked_start(xp: Any, q: Any, k_pages: Any, *, scale: float) -> tuple[Any, ...]:
    """The grouped, scaled queries ``(B, H_kv, G*L, D)`` and the empty running state."""
    B, H, L, D = q.shape
    h_kv = k_pages.shape[1]
    qg = xp.reshape(q, (B, h_kv, (H // h_kv) * L, D))  # (B, H_kv, G*L, D)
    qg = xp.astype(qg, float_compute_dtype(xp, q.dtype)) * scale
    run_max = xp.full_like(qg[..., :1], -math.inf)  # (B, H_kv, G*L, 1)
    return qg, run_max, xp.zeros_like(run_max), xp.zeros_like(qg)


@portable(_BLOCKED, "block", pure=True)
def _blocked_block(
    xp: Any,
    qg: Any,
    k_pages: Any,
    v_pages: Any,
    tables: Any,
    lens: Any,
    first: Any,
    run_max: Any,
    total: Any,
    acc: Any,
    *,
    grid: tuple[int, ...],
    opts: PagedOptions,
) -> tuple[Any, Any, Any]:
    """One online-softmax step over the pages ``tables`` ``(B, n)`` (keys from ``first``)."""
    kb = opts.gather(xp, k_pages, tables)  # (B, H_kv, n * P, D)
    vb = opts.gather(xp, v_pages, tables)
    B, S, L = kb.shape[0], kb.shape[2], grid[-1]
    mb = opts.mask(xp, lens, L, S, first, _device(qg))  # (B, 1, L, n * P)
    mb = xp.reshape(mb, (B, 1, 1, L, S))  # the grouped layout (B, H_kv, G, L, S)
    return tiled_block(xp, qg, kb, vb, mb, run_max, total, acc, 0, grid=grid, opts=opts.sdpa)


@portable(OP, "blocked")
def _paged_blocked(
    xp: Any,
    q: Any,
    k_pages: Any,
    v_pages: Any,
    tables: Any,
    lens: Any,
    page_map: Any,
    sinks: Any = None,
    *,
    opts: PagedOptions,
) -> Any:
    """Flash attention's online softmax over blocks of ``opts.block_pages`` pages.

    Each block gathers only its own pages; the step is the tiled SDPA's
    (:func:`portable_llm.attn.sdpa.tiled_block`). With a window, the blocks left of every
    row's window are skipped.
    """
    bk = backend_of(q)
    assert bk is not None
    start_fn, block_fn, finish_fn = (pick(bk, _BLOCKED, n) for n in ("start", "block", "finish"))
    qg, run_max, total, acc = start_fn(xp, q, k_pages, scale=opts.sdpa.scale)
    B, H, L, _ = q.shape
    P, M, n = k_pages.shape[2], tables.shape[1], opts.block_pages
    h_kv = k_pages.shape[1]
    grid = (B, h_kv, H // h_kv, L)  # the grouped layout of the query rows
    lo = 0
    if opts.window is not None and not bk.is_traced(lens):  # the oldest key any query sees
        lo = max(0, int(to_numpy(lens).min()) - L - opts.window + 1) // P
    for j in range(lo, M, n):
        tb = tables[:, j : min(j + n, M)]  # (B, <= n)
        run_max, total, acc = block_fn(
            xp, qg, k_pages, v_pages, tb, lens, j * P, run_max, total, acc, grid=grid, opts=opts
        )
    if sinks is not None:  # gpt-oss: one more step, a key of score sink and value 0
        total, acc = pick(bk, _BLOCKED, "sink")(xp, run_max, total, acc, sinks, grid=grid)
    return finish_fn(xp, acc, total, q)


@portable(_BLOCKED, "sink", pure=True)
def _blocked_sink(
    xp: Any, run_max: Any, total: Any, acc: Any, sinks: Any, *, grid: tuple[int, ...]
) -> tuple[Any, Any]:
    return sink_step(xp, run_max, total, acc, sink_rows(xp, sinks, grid, acc.dtype))


@portable(_BLOCKED, "finish", pure=True)
def _blocked_finish(xp: Any, acc: Any, total: Any, q: Any) -> Any:
    return tiled_finish(xp, acc, total, q)


@auto_portable(OP)
def _auto(
    q: Any, k_pages: Any, v_pages: Any, tables: Any, lens: Any, page_map: Any, sinks: Any = None,
    **options: Any,
) -> str:  # fmt: skip
    if page_map is not None:  # paged_args found that the pool-wide path pays
        return "pool"
    scores = q.shape[2] * (q.shape[1] // k_pages.shape[1]) * tables.shape[1] * k_pages.shape[2]
    return "blocked" if scores >= BLOCKED_MIN_KEYS else "portable"


# Over 80 lines for its docstring (the pool's layout, every option, the errors); the code is ~25
# lines: the metadata checks live in paged_args (attn/paged_args.py).
def paged_attention(
    q: Any,
    pool: Any,
    block_tables: Any,
    context_lens: Any,
    /,
    *,
    scale: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    block_pages: int = 16,
    impl: str = "auto",
    backend: str | None = None,
) -> Any:
    """Attention of each row's last ``L`` tokens over its keys, read from a page pool.

    Parameters
    ----------
    q : array, shape ``(B, H, L, D)``, float dtype
        Query ``i`` of row ``b`` sits at position ``context_lens[b] - L + i``.
    pool : PagePool or any object with ``k_pages`` and ``v_pages``
        Arrays ``(N, H_kv, P, D)`` of q's dtype (:class:`~portable_llm.PagePool`); ``H`` must
        be a multiple of ``H_kv`` (query head ``h`` reads key head ``h // (H / H_kv)``).
    block_tables : integer array, shape ``(B, M)``
        Row ``b``'s token ``t`` is in page ``block_tables[b, t // P]``, slot ``t % P``. Only the
        first ``ceil(context_lens[b] / P)`` entries of a row are read (the rest may be any
        padding); see :func:`~portable_llm.caches.paged.block_tables`.
    context_lens : integer array, shape ``(B,)``
        Tokens of each row, the ``L`` new ones included (``>= L``).
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(D)``.
    window : int, >= 1, optional
        Sliding window: query at position ``p`` sees keys at ``p - window + 1 .. p``.
    chunk : int, >= 1, optional
        Llama 4's chunked attention: query at position ``p`` sees the keys of its own chunk,
        ``p // chunk * chunk .. p``.
    softcap : float, > 0, optional
        Gemma-2's ``softcap * tanh(scores / softcap)``, before the mask.
    sinks : array, shape ``(H,)``, optional
        gpt-oss's attention sinks (see :func:`~portable_llm.scaled_dot_product_attention`):
        every path takes them but torch's native kernel, which auto then passes over.
    block_pages : int, >= 1
        Pages per block of ``impl="blocked"``.
    impl : {"auto", "portable", "blocked", "pool", "native"}
        ``"auto"``: ``"pool"`` when ``G * L <= P`` and the rows use at least half of the pool's
        pages, each page in one row (decode; on torch, the native kernel's in-place form of
        it); else the backend's native kernel where it keeps
        this meaning; else ``"blocked"`` when a row's ``G * L * M * P`` scores reach
        :data:`BLOCKED_MIN_KEYS`; else ``"portable"``. ``"pool"`` needs each page in at most
        one row.
    backend : str, optional

    Returns
    -------
    array, shape ``(B, H, L, D)``, q's dtype
        Equal to :func:`~portable_llm.scaled_dot_product_attention` of each row over its
        gathered keys with ``mask="causal"`` (and ``window``, ``softcap``): scores, softmax and
        sum in float32 (float64 for float64), rounded once.

    Raises
    ------
    ValueError
        Before any compute, for metadata that does not fit: shapes, negative lengths or lengths
        below ``L``, a table too narrow for a length, a used table entry outside the pool.
    TypeError
        q and the pool of different dtypes, non-integer tables or lengths.
    """
    for name in ("k_pages", "v_pages"):
        if not hasattr(pool, name):
            raise TypeError(f"{OP}: pool must have k_pages and v_pages (a PagePool), got {pool!r}")
    bk, (*arrays, sinks) = resolve(
        OP, backend, q, pool.k_pages, pool.v_pages, block_tables, context_lens, sinks
    )
    args, opts = paged_args(
        OP,
        bk,
        *arrays,
        scale=scale,
        window=window,
        chunk=chunk,
        softcap=softcap,
        block_pages=block_pages,
        impl=impl,
    )
    if sinks is not None:  # the eighth array
        q = args[0]
        sinks = check_sinks(OP, bk, sinks, q, q.shape[1], f"query head H of q {tuple(q.shape)}")
        args = (*args, sinks)
    fn = pick(bk, OP, impl, *args, **opts)
    if empty(args[0]):
        return bk.xp.zeros(q.shape, dtype=q.dtype, device=bk.device_of(args[0]))
    return fn(bk.xp, *args, **opts)
