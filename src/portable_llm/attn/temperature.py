"""Attention temperature tuning (Llama 4): the queries of the layers without RoPE are scaled by
a factor that grows with the logarithm of their position, so attention over long contexts stays
sharp where no rotation tells positions apart."""

from __future__ import annotations

from typing import Any

from portable_llm.backends import resolve
from portable_llm.core.arrays import creation_device
from portable_llm.core.checks import check_float, check_int, check_ndim, check_real
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace

__all__ = ["attention_temperature", "temperature_body"]


@portable("attention_temperature", pure=True)
def _attention_temperature(
    xp: Namespace, q: Array, *, offset: int, floor_scale: float, scale: float
) -> Array:
    return temperature_body(xp, q, offset, floor_scale, scale)


def temperature_body(
    xp: Namespace, q: Array, start: Any, floor_scale: float, scale: float
) -> Array:
    """The temperature tuning of checked arguments: the body of :func:`attention_temperature`
    and of the attention block's no-RoPE layers.

    ``q`` ``(N.., L, D)``; ``start``: the position of row 0, an int or 0-d integer array (a
    traced offset), or ``(B,)`` per row for ``q`` ``(B, H, L, D)`` (rows of other offsets; a
    left-padded row starts below 0, and its pad columns are taken at position 0).
    """
    ct = xp.float64 if q.dtype == xp.float64 else xp.float32
    L = q.shape[-2]
    device = creation_device(q)  # a tensor-parallel q's own sharding would not fit (L,)
    steps = xp.arange(L, device=device)  # (L,)
    if getattr(start, "ndim", 0) == 1:  # (B,) row starts: (B, 1, L, 1)
        pos = xp.reshape(start, (start.shape[0], 1, 1, 1))  # (B, 1, 1, 1)
        pos = pos + xp.reshape(steps, (1, 1, L, 1))  # (B, 1, L, 1)
        pos = xp.where(pos < 0, xp.zeros_like(pos), pos)  # pad columns (masked anyway)
    else:
        pos = xp.reshape(steps + start, (L, 1))  # (L, 1): one factor per query row
    positions = xp.astype(pos, ct)
    # HF Llama4TextAttention: log1p(floor((position + 1) / floor_scale)) * attn_scale + 1
    factor = xp.log1p(xp.floor((positions + 1.0) / floor_scale)) * scale + 1.0
    return xp.astype(xp.astype(q, ct) * factor, q.dtype)  # one rounding, as HF's .to(dtype)


def attention_temperature(
    q: Array,
    /,
    *,
    offset: int = 0,
    floor_scale: float = 8192.0,
    scale: float = 0.1,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """Llama 4's attention temperature tuning of the queries of a layer without RoPE.

    Row ``l`` of ``q`` (position ``p = offset + l``) is multiplied by
    ``log(floor((p + 1) / floor_scale) + 1) * scale + 1`` -- exactly 1 for ``p + 1 <
    floor_scale``, then growing with the logarithm of the position. The factor and the product
    are computed in float32 (float64 for float64 input) and rounded once to q's dtype, as HF's
    ``Llama4TextAttention`` does (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``).

    Parameters
    ----------
    q : array, shape ``(N.., L, D)`` (``(B, H, L, D)`` in the attention block), float dtype
    offset : int >= 0
        Position of q's first row (the cache's length before these queries).
    floor_scale : float > 0
        HF ``floor_scale`` (8192).
    scale : float
        HF ``attn_scale`` (0.1).
    impl : {"auto", "portable"}
        Portable only (compiled with ``jax.jit`` on JAX).
    backend : str, optional

    Returns
    -------
    array, shape ``(N.., L, D)``, q's dtype
    """
    bk, (q,) = resolve("attention_temperature", backend, q)
    op = "attention_temperature"
    check_float(op, "q", q, bk)
    check_ndim(op, "q", q, 2, "N.. x L x D")
    offset = check_int(op, "offset", offset, low=0)
    floor_scale = check_real(op, "floor_scale", floor_scale, low=0.0, low_open=True)
    scale = check_real(op, "scale", scale)
    opts: dict[str, Any] = {"offset": offset, "floor_scale": floor_scale, "scale": scale}
    return pick(bk, op, impl, q, **opts)(bk.xp, q, **opts)
