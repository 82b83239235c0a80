"""Paged attention without a gather: every page of the pool attended where it lies, then the
pages of each row summed.

The gather paths copy each row's pages into contiguous keys, then read the copy: three passes
over the keys where dense attention makes one. Here each page ``n`` of the pool meets the
queries of the row that owns it (``b = page_map[0, n]``) in one batched matmul over the pool's
own ``(N, H_kv, P, D)`` arrays: scores ``s_n``, masked by the one visibility rule at the page's
positions. Each row's max over its pages, ``M_b = max_{n in b} max s_n`` (a small read through
its block table), puts every page on its row's scale, and then

    out_b = sum_{n in b} exp(s_n - M_b) V_n / sum_{n in b} sum exp(s_n - M_b),

two sums over the pages a row owns: one matmul of the ``(B, N)`` ownership matrix with the
per-page partials.

The keys are read once; the copies are of q (once per page) and of the per-page partials, each
``G * L / P`` the size of the keys. So it pays when ``G * L <= P`` (decode) and the rows' pages
fill most of the pool (pages no row uses are attended too, then dropped); a page in two rows
cannot be owned by one. :func:`~portable_llm.attn.paged_args.paged_args` builds ``page_map``
where it pays.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.attn.paged_args import OP, UNUSED, PagedOptions
from portable_llm.attn.sdpa import sink_rows, sink_step, softmax_finish
from portable_llm.attn.visibility import visible
from portable_llm.core.checks import float_compute_dtype
from portable_llm.core.dispatch import portable

__all__: list[str] = []


def _device(x: Any) -> Any:
    return getattr(x, "device", None)  # MLX arrays have none (unified memory)


@portable(OP, "pool", pure=True)
def _paged_pool(
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
    B, H, L, D = q.shape
    N, h_kv, P, _ = k_pages.shape
    G, M = H // h_kv, tables.shape[1]
    dev = _device(q)
    qg = xp.reshape(q, (B, h_kv, G * L, D))  # (B, H_kv, G*L, D)
    qg = xp.astype(qg, float_compute_dtype(xp, q.dtype)) * opts.sdpa.scale
    owner, first = page_map[0, :], page_map[1, :]  # (N,), (N,)
    qo = xp.take(qg, owner, axis=0)  # (N, H_kv, G*L, D): each page's row's queries
    # Page n's slots sit at positions first[n] + 0 .. P - 1; its row's queries at
    # lens[owner[n]] - L + i. Pages no row uses have first = UNUSED: after every query.
    q0 = xp.reshape(xp.take(lens, owner, axis=0) - L - first, (N, 1, 1))  # (N, 1, 1)
    ok = visible(
        xp, L, P, q_start=q0, window=opts.window, chunk=opts.chunk,
        origin=-xp.reshape(first, (N, 1, 1)), device=dev,
    )  # (N, L, P); page n's slot j at position first[n] + j  # fmt: skip
    ok = xp.reshape(ok, (N, 1, 1, L, P))
    k = xp.astype(k_pages, qo.dtype, copy=False)
    # K @ q^T, then transposed: the pool's pages as the left operand is ~4x faster on torch's
    # CPU than q @ K^T (a batch of N * H_kv small products; measured), the same on NumPy.
    s = xp.matrix_transpose(xp.matmul(k, xp.matrix_transpose(qo)))  # (N, H_kv, G*L, P)
    if opts.sdpa.softcap is not None:  # Gemma-2's cap, before the mask (as every path)
        s = opts.sdpa.softcap * xp.tanh(s / opts.sdpa.softcap)
    s = xp.where(ok, xp.reshape(s, (N, h_kv, G, L, P)), -math.inf)
    s = xp.reshape(s, (N, h_kv, G * L, P))
    # Each row's running max over all its pages first (a small read through its table), so
    # that every page's probabilities are already on the row's scale: the combine is then a
    # plain sum of each row's pages, one matmul with the (B, N) ownership matrix.
    m = xp.max(s, axis=-1, keepdims=True)  # (N, H_kv, G*L, 1); -inf: the page hides all
    flat = xp.reshape(tables, (-1,))  # (B*M,)
    need = (lens + (P - 1)) // P  # (B,) pages each row uses
    used = xp.reshape(xp.arange(M, device=dev), (1, M)) < xp.reshape(need, (B, 1))  # (B, M)
    mr = xp.reshape(xp.take(m, flat, axis=0), (B, M, h_kv, G * L, 1))
    mr = xp.where(xp.reshape(used, (B, M, 1, 1, 1)), mr, -math.inf)  # drop table padding
    top = xp.max(mr, axis=1)  # (B, H_kv, G*L, 1): finite (a query sees itself)
    p = xp.exp(s - xp.take(top, owner, axis=0))  # (N, H_kv, G*L, P); 0 where hidden
    part = xp.matmul(p, xp.astype(v_pages, qg.dtype, copy=False))  # (N, H_kv, G*L, D)
    owned = xp.logical_and(
        xp.reshape(owner, (1, N)) == xp.reshape(xp.arange(B, device=dev), (B, 1)),
        xp.reshape(first, (1, N)) < UNUSED,
    )  # (B, N): row b owns page n
    sel = xp.astype(owned, qg.dtype)
    acc = xp.matmul(sel, xp.reshape(part, (N, h_kv * G * L * D)))  # (B, H_kv*G*L*D)
    # The denominators: each row's sum over its pages first (a matmul reading p once), then
    # over the P slots of that small (B, ...) array: a sum over the short last axis of every
    # page costs more than the matmul on NumPy (measured).
    tot = xp.matmul(sel, xp.reshape(p, (N, h_kv * G * L * P)))  # (B, H_kv*G*L*P)
    tot = xp.sum(xp.reshape(tot, (B, h_kv, G * L, P)), axis=-1, keepdims=True)
    acc = xp.reshape(acc, (B, h_kv, G * L, D))
    if sinks is not None:  # gpt-oss: a key of score sink and value 0, on the row's scale top
        tot, acc = sink_step(xp, top, tot, acc, sink_rows(xp, sinks, (B, h_kv, G, L), qg.dtype))
    return softmax_finish(xp, acc, tot, q)  # (B, H, L, D)
