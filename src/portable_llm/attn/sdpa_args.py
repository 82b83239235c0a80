"""Argument checks of scaled dot-product attention, shared by the op and the attention block.

:func:`sdpa_args` turns the public arguments into the ``(arrays, options)`` every
implementation (portable, tiled, native) is called with.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from portable_llm.attn.mask import check_window
from portable_llm.backends import Backend
from portable_llm.core.checks import check_float, check_same_dtype

__all__ = ["OP", "check_sdpa", "sdpa_args"]

OP = "scaled_dot_product_attention"


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


def check_sdpa(
    op: str,
    bk: Backend,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    *,
    causal: bool,
    window: Any,
    softcap: Any,
    scale: Any,
) -> float:
    """Validate the arguments of an attention call; return the scale to use."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, x, bk)
        if x.ndim < 3:
            raise ValueError(f"{op}: {name} must have at least 3 dimensions, got {_shape(x)}")
    check_same_dtype(op, bk, q=q, k=k, v=v)
    if _shape(k) != _shape(v):
        raise ValueError(f"{op}: k and v must have the same shape, got {_shape(k)} and {_shape(v)}")
    if k.ndim != q.ndim or _shape(k)[:-3] != _shape(q)[:-3]:
        raise ValueError(
            f"{op}: k (B.., H_kv, S, D) must have q's batch dimensions; "
            f"q has shape {_shape(q)}, k has shape {_shape(k)}"
        )
    (h, L, d), (h_kv, S, d_k) = _shape(q)[-3:], _shape(k)[-3:]
    if d != d_k:
        raise ValueError(f"{op}: q and k must share the head dim D; q {_shape(q)}, k {_shape(k)}")
    if h_kv == 0 or h % h_kv:
        raise ValueError(
            f"{op}: q's heads H={h} must be a multiple of k's heads H_kv={h_kv}; "
            f"q {_shape(q)}, k {_shape(k)}"
        )
    if S == 0:
        raise ValueError(f"{op}: k and v have no keys (S = 0), shape {_shape(k)}")
    check_window(op, window)
    if causal and L > S:
        raise ValueError(
            f"{op}: a causal mask (mask='causal' or window=) needs L <= S, got L={L} queries "
            f"(q {_shape(q)}) and S={S} keys (k {_shape(k)})"
        )
    if mask is not None:
        if mask.dtype != bk.dtypes["bool"] and mask.dtype not in bk.float_set:
            raise TypeError(
                f"{op}: mask must be 'causal', a boolean array or an additive float array, "
                f"got dtype {bk.dtype_name(mask.dtype)} with shape {_shape(mask)}"
            )
        target = (*_shape(q)[:-1], S)
        ms = _shape(mask)
        tail = target[len(target) - len(ms) :]
        if len(ms) > len(target) or any(m not in (1, t) for m, t in zip(ms, tail, strict=True)):
            raise ValueError(
                f"{op}: mask of shape {ms} does not broadcast to the scores (B.., H, L, S) = "
                f"{target} of q {_shape(q)} and k {_shape(k)}"
            )
    if softcap is not None and not (_real(softcap) and 0 < softcap < math.inf):
        raise ValueError(f"{op}: softcap must be a positive finite number or None, got {softcap!r}")
    if scale is None:
        return 1.0 / math.sqrt(d)
    if not (_real(scale) and math.isfinite(scale)):
        raise ValueError(f"{op}: scale must be a finite number or None, got {scale!r}")
    return float(scale)


def sdpa_args(
    op: str,
    bk: Backend,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    *,
    scale: Any,
    window: Any,
    softcap: Any,
    block_size: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``(arrays, options)`` every implementation of the op is called with."""
    causal = isinstance(mask, str) or window is not None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"{op}: mask must be None, 'causal' or an array, got {mask!r}")
        mask = None
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, numbers.Integral)
        or block_size < 1
    ):
        raise ValueError(f"{op}: block_size must be an int >= 1, got {block_size!r}")
    # NumPy scalars are accepted and become Python numbers (native kernels want those).
    block_size, window = int(block_size), check_window(op, window)
    softcap = float(softcap) if _real(softcap) else softcap
    scale = check_sdpa(
        op, bk, q, k, v, mask, causal=causal, window=window, softcap=softcap, scale=scale
    )
    opts = dict(scale=scale, causal=causal, window=window, softcap=softcap, block_size=block_size)
    return (q, k, v, mask), opts
