"""Scaled dot-product attention: the direct path, the tiled (online-softmax) path, ``auto``.

Both portable paths fold the ``G = H / H_kv`` query heads that share a key/value head into the
query axis, ``(B.., H, L, D) -> (B.., H_kv, G * L, D)``, so grouped-query attention is one plain
batched matmul against ``(B.., H_kv, S, D)``: K and V are never repeated. The argument checks
live in :mod:`portable_llm.attn.sdpa_args`.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.attn.sdpa_args import OP, SdpaOptions, sdpa_args
from portable_llm.attn.visibility import visible
from portable_llm.backends import backend_of, resolve
from portable_llm.core.arrays import creation_device
from portable_llm.core.checks import float_compute_dtype
from portable_llm.core.dispatch import auto_portable, pick, portable

__all__ = [
    "OP",
    "TILED_MIN_SCORES",
    "SdpaOptions",
    "scaled_dot_product_attention",
    "sdpa_args",
    "out_shape",
    "sdpa_direct",
    "sink_rows",
    "sink_step",
    "softmax_finish",
    "tiled_block",
    "tiled_finish",
]

#: ``impl="auto"`` without an applicable native kernel takes the tiled path once one head's
#: score matrix has this many entries (``L * S >= 2**20``, 4 MiB in float32 per batch and head).
TILED_MIN_SCORES = 1 << 20


def _grid(q: Any, k: Any) -> tuple[int, ...]:
    """``(B.., H_kv, G, L)``: the grouped layout of the query rows."""
    *batch, h, n_q, _ = q.shape
    h_kv = k.shape[-3]
    return (*batch, h_kv, h // h_kv, n_q)


def _group(xp: Any, q: Any, k: Any, mask: Any) -> tuple[Any, Any, tuple[int, ...]]:
    """q as ``(B.., H_kv, G*L, D)``; the mask's head axis split as ``(H_kv, G)`` to match."""
    grid = _grid(q, k)
    *batch, h_kv, g, n_q = grid
    h, d = q.shape[-3], q.shape[-1]
    qg = xp.reshape(q, (*batch, h_kv, g * n_q, d))  # (B.., H_kv, G*L, D)
    if mask is not None:  # (.., H | 1, L | 1, S | 1) -> (.., H_kv | 1, G | 1, L | 1, S | 1)
        m = xp.reshape(mask, (1,) * (q.ndim - mask.ndim) + tuple(mask.shape))
        mh, ml, ms = m.shape[-3:]
        heads = (h_kv, g) if mh == h else (1, 1)
        mask = xp.reshape(m, (*m.shape[:-3], *heads, ml, ms))
    return qg, mask, grid


def _block_scores(
    xp: Any, qg: Any, kb: Any, mb: Any, shift: Any, *, grid: tuple[int, ...], opts: SdpaOptions
) -> Any:
    """Masked scores of one block of keys: ``(B.., H_kv, G*L, n)``, float32.

    ``kb``: the block's keys ``(B.., H_kv, n, D)``; ``mb``: the mask's columns for the block (or
    ``None``). ``shift``: the block's first key position minus the first query's, ``start - (S -
    L)``, so the block's keys sit at columns ``0 .. n - 1`` and the queries at ``-shift ..``. It
    is an argument, not baked in, so a compiled block serves every block.
    """
    kb = xp.astype(kb, qg.dtype, copy=False)
    s = xp.matmul(qg, xp.matrix_transpose(kb))  # (B.., H_kv, G*L, n)
    if opts.softcap is not None:
        s = opts.softcap * xp.tanh(s / opts.softcap)
    if mb is None and not opts.causal:
        return s
    n = kb.shape[-2]
    s = xp.reshape(s, (*grid, n))  # (B.., H_kv, G, L, n)
    if mb is not None:
        s = xp.where(mb, s, -math.inf) if mb.dtype == xp.bool else s + xp.astype(mb, s.dtype)
    if opts.causal:
        L = grid[-1]
        keep = visible(
            xp, L, n, q_start=-shift, window=opts.window, device=creation_device(s)
        )  # (L, n)
        s = xp.where(keep, s, -math.inf)
    return xp.reshape(s, (*grid[:-2], grid[-2] * grid[-1], n))


def _mask_block(mask: Any, start: int, stop: int) -> Any:
    return mask if mask is None or mask.shape[-1] == 1 else mask[..., start:stop]


def _safe_max(xp: Any, s: Any) -> Any:
    """Row max, with 0 for rows that see no key, so ``exp(s - max)`` is 0 there, not NaN."""
    m = xp.max(s, axis=-1, keepdims=True)
    return xp.where(m == -math.inf, 0.0, m)


def softmax_finish(xp: Any, acc: Any, total: Any, q: Any) -> Any:
    """The attention output from the weighted values ``acc`` and the softmax denominators
    ``total`` (float32 sums over the keys; rows that see no key give 0), reshaped to ``q``'s
    ``(B.., H, L)`` by the values' head dim ``D_v`` and rounded once to q's dtype. Shared by the
    direct, tiled and paged paths."""
    out = acc / xp.where(total == 0.0, 1.0, total)  # rows that see no key: 0 / 1
    return xp.astype(xp.reshape(out, out_shape(q, acc)), q.dtype)  # (B.., H, L, D_v)


def out_shape(q: Any, v: Any) -> tuple[int, ...]:
    """The attention's output shape ``(B.., H, L, D_v)``: q's but for the last axis, ``v``'s
    (the values' head dim; latent attention's differs from the keys')."""
    return (*q.shape[:-1], v.shape[-1])


def sink_rows(xp: Any, sinks: Any, grid: tuple[int, ...], dtype: Any) -> Any:
    """gpt-oss's per-head sink logits ``(H,)`` as one logit per grouped query row,
    ``(H_kv, G*L, 1)`` in ``dtype`` (broadcasts against the batch axes)."""
    *_, h_kv, g, n_q = grid
    s = xp.reshape(xp.astype(sinks, dtype), (h_kv, g, 1))  # (H_kv, G, 1)
    s = xp.broadcast_to(s, (h_kv, g, n_q))  # (H_kv, G, L)
    return xp.reshape(s, (h_kv, g * n_q, 1))  # (H_kv, G*L, 1)


def sink_step(xp: Any, run_max: Any, total: Any, acc: Any, sink: Any) -> tuple[Any, Any]:
    """The attention sink as one more online-softmax step: a key of score ``sink`` whose value
    is zero, so it joins the denominator ``total`` and adds nothing to ``acc``:
    ``softmax([scores, sink])[:-1]``. ``run_max``: the row max so far (``-inf`` or any finite
    value below it where no key was seen). Returns ``(total, acc)``; neither overflows, whatever
    the sink (every exponent is ``<= 0``)."""
    new_max = xp.maximum(run_max, sink)
    shift = xp.where(new_max == -math.inf, 0.0, new_max)  # a sink of -inf and no key: 0 / 0
    alpha = xp.exp(run_max - shift)
    return alpha * total + xp.exp(sink - shift), alpha * acc


def _prepare(xp: Any, q: Any, k: Any, mask: Any, scale: float) -> tuple[Any, Any, tuple[int, ...]]:
    qg, mask, grid = _group(xp, q, k, mask)
    qg = xp.astype(qg, float_compute_dtype(xp, q.dtype)) * scale
    return qg, mask, grid


@portable(OP, pure=True)
def sdpa_direct(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    sinks: Any = None,
    *,
    opts: SdpaOptions,
) -> Any:
    """The portable attention in one step (all ``S`` keys' scores at once): ``(B.., H, L, D_v)``
    in q's dtype, accumulated in float32 (float64 for float64); ``sinks`` ``(H,)``: the
    attention sinks (:func:`sink_step`)."""
    qg, mask, grid = _prepare(xp, q, k, mask, opts.scale)
    shift = q.shape[-2] - k.shape[-2]  # key 0 minus query 0's position: L - S
    s = _block_scores(xp, qg, k, mask, shift, grid=grid, opts=opts)
    m = _safe_max(xp, s)
    p = xp.exp(s - m)  # (B.., H_kv, G*L, S)
    total = xp.sum(p, axis=-1, keepdims=True)
    acc = xp.matmul(p, xp.astype(v, qg.dtype, copy=False))  # (B.., H_kv, G*L, D)
    if sinks is not None:
        total, acc = sink_step(xp, m, total, acc, sink_rows(xp, sinks, grid, qg.dtype))
    return softmax_finish(xp, acc, total, q)


# The tiled path is a Python loop over key blocks, so it is not one compiled program: JAX would
# unroll the loop, and compile time would grow with S / block_size. Its three steps are pure and
# compiled (Backend.compile) each on its own, once per block shape and option set: a call runs
# the start, one compiled block step per key block (every full block shares one compilation, a
# ragged last block adds one), and the finish.
_TILED = OP + ".tiled"


@portable(_TILED, "start", pure=True)
def _tiled_start(xp: Any, q: Any, k: Any, v: Any, mask: Any, *, scale: float) -> tuple[Any, ...]:
    """The grouped, scaled queries, the grouped mask and the empty running state."""
    qg, mask, _ = _prepare(xp, q, k, mask, scale)
    run_max = xp.full_like(qg[..., :1], -math.inf)  # (B.., H_kv, G*L, 1)
    acc = xp.zeros((*qg.shape[:-1], v.shape[-1]), dtype=qg.dtype, device=creation_device(qg))
    return qg, mask, run_max, xp.zeros_like(run_max), acc  # acc: (B.., H_kv, G*L, D_v)


@portable(_TILED, "block", pure=True)
def tiled_block(
    xp: Any,
    qg: Any,
    kb: Any,
    vb: Any,
    mb: Any,
    run_max: Any,
    total: Any,
    acc: Any,
    shift: Any,
    *,
    grid: tuple[int, ...],
    opts: SdpaOptions,
) -> tuple[Any, Any, Any]:
    """One online-softmax step over a block of keys: the updated ``run_max, total, acc``."""
    s = _block_scores(xp, qg, kb, mb, shift, grid=grid, opts=opts)
    new_max = xp.maximum(run_max, xp.max(s, axis=-1, keepdims=True))
    shift_max = xp.where(new_max == -math.inf, 0.0, new_max)
    alpha = xp.exp(run_max - shift_max)  # 0 while no key was seen (run_max = -inf)
    p = xp.exp(s - shift_max)
    total = alpha * total + xp.sum(p, axis=-1, keepdims=True)
    acc = alpha * acc + xp.matmul(p, xp.astype(vb, qg.dtype, copy=False))
    return new_max, total, acc


@portable(_TILED, "sink", pure=True)
def _tiled_sink(
    xp: Any, run_max: Any, total: Any, acc: Any, sinks: Any, *, grid: tuple[int, ...]
) -> tuple[Any, Any]:
    """The sinks as the tiled path's last online-softmax step (:func:`sink_step`)."""
    return sink_step(xp, run_max, total, acc, sink_rows(xp, sinks, grid, acc.dtype))


@portable(_TILED, "finish", pure=True)
def tiled_finish(xp: Any, acc: Any, total: Any, q: Any) -> Any:
    """The tiled path's last step: :func:`softmax_finish` of the running state."""
    return softmax_finish(xp, acc, total, q)


@portable(OP, "tiled")
def _sdpa_tiled(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    sinks: Any = None,
    *,
    opts: SdpaOptions,
) -> Any:
    """Flash-attention's online softmax over key blocks: memory O(G*L x block_size) per head.

    Per block: ``m' = max(m, rowmax(s))``, ``a = exp(m - m')``, ``p = exp(s - m')``,
    ``total = a * total + rowsum(p)``, ``acc = a * acc + p @ v_block``; the sinks (if any) one
    more step of one key of value 0; at the end ``acc / total``. Blocks that no query can see
    (left of every sliding window) are skipped.
    """
    bk = backend_of(q)  # q is an array: never None
    assert bk is not None
    start_fn, block_fn, finish_fn = (pick(bk, _TILED, n) for n in ("start", "block", "finish"))
    qg, mask, run_max, total, acc = start_fn(xp, q, k, v, mask, scale=opts.scale)
    grid = _grid(q, k)
    L, S, window = q.shape[-2], k.shape[-2], opts.window
    first = max(0, S - L - window + 1) if window is not None else 0
    # The block step reads only causal, window and softcap: one compilation serves every scale.
    step = SdpaOptions(scale=1.0, causal=opts.causal, window=window, softcap=opts.softcap)
    for start in range(first, S, opts.block_size):
        stop = min(start + opts.block_size, S)
        kb, vb = k[..., start:stop, :], v[..., start:stop, :]  # (B.., H_kv, n, D)
        mb = _mask_block(mask, start, stop)
        run_max, total, acc = block_fn(
            xp, qg, kb, vb, mb, run_max, total, acc, start - (S - L), grid=grid, opts=step
        )
    if sinks is not None:
        total, acc = pick(bk, _TILED, "sink")(xp, run_max, total, acc, sinks, grid=grid)
    return finish_fn(xp, acc, total, q)


@auto_portable(OP)
def _auto(q: Any, k: Any, v: Any, mask: Any, sinks: Any = None, **options: Any) -> str:
    return "tiled" if q.shape[-2] * k.shape[-2] >= TILED_MIN_SCORES else "portable"


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    /,
    *,
    scale: float | None = None,
    mask: Any = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    block_size: int = 256,
    impl: str = "auto",
    backend: str | None = None,
) -> Any:
    """``softmax(q @ k^T * scale + mask) @ v`` with grouped-query heads.

    Parameters
    ----------
    q : array, shape ``(B.., H, L, D)``, float dtype
    k : array, shape ``(B.., H_kv, S, D)``, q's dtype
        ``H`` must be a multiple of ``H_kv``; query head ``h`` uses key/value head
        ``h // (H / H_kv)`` (HF ``repeat_kv``), by broadcasting: K and V are never copied.
    v : array, shape ``(B.., H_kv, S, D_v)``, q's dtype
        The values' head dim ``D_v`` may differ from ``D`` (multi-head latent attention:
        ``D = qk_nope_head_dim + qk_rope_head_dim``, ``D_v = v_head_dim``).
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(D)``.
    mask : None, "causal", or array broadcastable to ``(B.., H, L, S)``
        Broadcast as NumPy does: a ``(S,)`` mask is one row shared by every query.
        ``"causal"``: bottom-right aligned (see :func:`causal_mask`; needs ``L <= S``). A boolean
        array: ``True`` where attending is allowed. A float array: added to the scores (``-inf``
        forbids).
    window : int, >= 1, optional
        Causal sliding window (implies ``"causal"``; combined with an array mask by "and").
    softcap : float, > 0, optional
        Gemma-2's cap, applied to the scaled scores before the mask:
        ``softcap * tanh(scores / softcap)``.
    sinks : array, shape ``(H,)``, float dtype, optional
        gpt-oss's attention sinks: one learned logit per query head that joins every softmax
        row's denominator and takes no value, ``softmax([scores, sinks[h]])[:-1] @ v``: the
        weights of a row sum to less than 1. Cast to q's dtype (the mixed-precision rule), then
        used in float32. A sink of ``-inf`` is plain attention. Native kernels that cannot
        take sinks (torch's, JAX's) are not chosen; MLX's takes them.
    block_size : int, >= 1
        Keys per block of ``impl="tiled"`` (ignored by the other paths).
    impl : {"auto", "portable", "tiled", "native"}
        ``"portable"``: the direct path (the whole ``(L, S)`` score matrix per head).
        ``"tiled"``: an online softmax over key blocks, memory ``O(L x block_size)`` per head.
        ``"auto"``: the backend's fused kernel when it keeps this meaning, else ``"tiled"``
        when ``L * S >=`` :data:`TILED_MIN_SCORES`, else ``"portable"``.
    backend : str, optional

    Returns
    -------
    array, shape ``(B.., H, L, D_v)``, q's dtype
        Scores, softmax and the weighted sum in float32 (float64 for float64 input), rounded
        once. A query row that sees no key (all masked) returns zeros, not NaN. An empty result
        (``L``, ``H``, ``D_v`` or a batch dimension 0) has that shape on every backend; ``D = 0``
        scores every key 0; ``S = 0`` (no keys) is a ValueError.
    """
    given = (q, k, v) if isinstance(mask, str) or mask is None else (q, k, v, mask)
    bk, (*arrays, sinks) = resolve(OP, backend, *given, sinks)
    q, k, v = arrays[:3]
    mask = arrays[3] if len(arrays) == 4 else mask
    args, opts = sdpa_args(
        OP, bk, q, k, v, mask, scale=scale, window=window, softcap=softcap, sinks=sinks,
        block_size=block_size,
    )  # fmt: skip
    fn = pick(bk, OP, impl, *args, **opts)
    shape = out_shape(q, v)
    if any(n == 0 for n in shape):  # L, H, D_v or a batch dim is 0: nothing to compute
        return bk.xp.zeros(shape, dtype=q.dtype, device=bk.device_of(q))
    return fn(bk.xp, *args, **opts)


def empty(x: Any) -> bool:
    """Whether ``x`` has a zero-size dimension."""
    return any(n == 0 for n in x.shape)
