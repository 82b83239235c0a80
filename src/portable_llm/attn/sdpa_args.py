"""Argument checks of scaled dot-product attention, shared by the op and the attention block.

:func:`sdpa_args` turns the public arguments into the ``(arrays, options)`` every
implementation (portable, tiled, native) is called with: ``fn(xp, q, k, v, mask, opts=o)``,
``o`` one :class:`SdpaOptions`; a call with attention sinks has a fifth array, ``fn(xp, q, k,
v, mask, sinks, opts=o)``, and so does each kernel's ``applies`` (a kernel that cannot take
sinks refuses them there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from portable_llm.attn.visibility import visible, zero_unseen
from portable_llm.backends import Backend
from portable_llm.core.checks import (
    check_float,
    check_int,
    check_real,
    check_same_dtype,
    match_weight,
)
from portable_llm.core.types import Array

__all__ = [
    "OP",
    "SdpaOptions",
    "check_sdpa",
    "check_sinks",
    "check_window",
    "int_option",
    "real_option",
    "sdpa_args",
]

OP = "scaled_dot_product_attention"


@dataclasses.dataclass(frozen=True)
class SdpaOptions:
    """The checked options of one attention call, as every implementation receives them.

    Frozen and hashable: a backend that compiles (JAX) keys its compilations on it.

    Attributes
    ----------
    scale : float
        Multiplies the scores (the default ``1 / sqrt(D)`` already resolved).
    causal : bool
        The bottom-right causal rule applies (``mask="causal"`` or ``window=``).
    window : int >= 1 or None
        Sliding window (only with ``causal``).
    softcap : float > 0 or None
        ``softcap * tanh(scores / softcap)``.
    block_size : int >= 1
        Keys per block of the tiled path.
    """

    scale: float
    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    block_size: int = 256

    # The native kernels (a lower layer than attn/) reach the one visibility rule through the
    # record they are given: these two methods.
    def combined_mask(self, xp: Any, mask: Array | None, L: int, S: int, device: Any) -> Any:
        """``mask`` and-ed with the causal/window rule (``None`` when there is neither).

        A boolean mask stays boolean; an additive one gets ``-inf`` where the rule forbids.
        """
        if not self.causal:
            return mask
        keep = visible(xp, L, S, window=self.window, device=device)  # (L, S)
        if mask is None:
            return keep
        if mask.dtype == xp.bool:
            return xp.logical_and(mask, keep)
        return xp.where(keep, mask, xp.full_like(mask, -math.inf))

    @staticmethod
    def zero_unseen(xp: Any, out: Array, mask: Array) -> Array:
        """:func:`portable_llm.attn.visibility.zero_unseen`: zeros in rows that see no key."""
        return zero_unseen(xp, out, mask)


def int_option(op: str, name: str, value: Any, *, low: int, optional: bool = False) -> Any:
    """``value`` as a Python int ``>= low`` (``None`` too when ``optional``), else a ValueError.

    :func:`~portable_llm.core.checks.check_int`'s policy (NumPy integers accepted, bools and
    floats refused), with the ValueError these options always raised.
    """
    if optional and value is None:
        return None
    try:
        return check_int(op, name, value, low=low)
    except (TypeError, ValueError):
        either = " or None" if optional else ""
        raise ValueError(f"{op}: {name} must be an int >= {low}{either}, got {value!r}") from None


def check_window(op: str, window: Any) -> int | None:
    """``window`` as a Python int >= 1 (NumPy integers accepted), or ``None``; else ValueError."""
    return int_option(op, "window", window, low=1, optional=True)


def real_option(op: str, name: str, value: Any, what: str, *, low: float | None = None) -> float:
    """``value`` as a finite Python float (``> low``), else ``ValueError: {op}: {name} must be
    {what}``."""
    try:
        return check_real(op, name, value, low=low, low_open=True)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: {name} must be {what}, got {value!r}") from None


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
    scale: Any,
) -> float:
    """Validate the arrays of an attention call (and the scale); return the scale to use."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, x, bk)
        if x.ndim < 3:
            raise ValueError(f"{op}: {name} must have at least 3 dimensions, got {_shape(x)}")
    check_same_dtype(op, bk, q=q, k=k, v=v)
    if _shape(k)[:-1] != _shape(v)[:-1]:  # v's head dim D_v may differ (latent attention)
        raise ValueError(
            f"{op}: k (B.., H_kv, S, D) and v (B.., H_kv, S, D_v) must agree but in the last "
            f"dimension, got {_shape(k)} and {_shape(v)}"
        )
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
    if scale is None:
        return 1.0 / math.sqrt(d) if d else 1.0  # D = 0: every score is 0 whatever the scale
    return real_option(op, "scale", scale, "a finite number or None")


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
    sinks: Any = None,
) -> tuple[tuple[Any, ...], dict[str, SdpaOptions]]:
    """The ``(arrays, {"opts": SdpaOptions})`` every implementation of the op is called with:
    ``(q, k, v, mask)``, and ``sinks`` (in q's dtype) fifth when given.

    An array mask of fewer than 2 dimensions (``(S,)``: one row for every query) is given the
    query axis, ``(1, S)``: the NumPy broadcasting the docs promise, which fused kernels do not
    all follow.
    """
    causal = isinstance(mask, str) or window is not None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"{op}: mask must be None, 'causal' or an array, got {mask!r}")
        mask = None
    block_size = int_option(op, "block_size", block_size, low=1)
    window = check_window(op, window)
    if softcap is not None:
        softcap = real_option(op, "softcap", softcap, "a positive finite number or None", low=0.0)
    scale = check_sdpa(op, bk, q, k, v, mask, causal=causal, scale=scale)
    if mask is not None and mask.ndim < 2:
        mask = bk.xp.reshape(mask, (1,) * (2 - mask.ndim) + _shape(mask))  # (S,) -> (1, S)
    if sinks is not None:
        sinks = check_sinks(op, bk, sinks, q, _shape(q)[-3], f"query head H of q {_shape(q)}")
    arrays = (q, k, v, mask) if sinks is None else (q, k, v, mask, sinks)
    opts = SdpaOptions(
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        block_size=block_size,
    )
    return arrays, {"opts": opts}


def check_sinks(op: str, bk: Backend, sinks: Any, like: Any, heads: int, per: str) -> Any:
    """The attention sinks ``(heads,)``, one logit per ``per`` (the message's words), in the
    dtype of ``like`` (the queries or the block's ``x``: the mixed-precision rule)."""
    check_float(op, "sinks", sinks, bk)
    if _shape(sinks) != (heads,):
        raise ValueError(
            f"{op}: sinks must have shape ({heads},) (one logit per {per}), got {_shape(sinks)}"
        )
    return match_weight(op, "sinks", sinks, like, bk)
