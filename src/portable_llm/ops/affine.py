"""The one float product under :func:`~portable_llm.linear` and the quantized ops: ``affine``;
and ``times``, the product with a Python float of HF's multipliers.

Kept below ``ops/linear.py`` and ``ops/quant/`` so that both call it without importing each
other.
"""

from __future__ import annotations

from portable_llm.core.checks import is_half
from portable_llm.core.types import Array, Namespace

__all__ = ["affine", "times"]


def affine(xp: Namespace, x: Array, weight: Array, bias: Array = None) -> Array:
    """``x @ weight.T + bias`` in x's dtype; float16/bfloat16 accumulated in float32, rounded once.

    Parameters
    ----------
    xp : namespace
    x : array, shape ``(N.., I)``
    weight : array, shape ``(O, I)``, x's dtype
    bias : array, shape ``(O,)``, x's dtype, optional

    Returns
    -------
    array, shape ``(N.., O)``, x's dtype
    """
    dtype = x.dtype
    if is_half(xp, dtype):  # accumulate half-precision products in float32, round once
        x, weight = xp.astype(x, xp.float32), xp.astype(weight, xp.float32)
        bias = None if bias is None else xp.astype(bias, xp.float32)
    y = xp.matmul(x, xp.matrix_transpose(weight))  # (N.., O)
    if bias is not None:
        y = y + bias
    return xp.astype(y, dtype)


def times(xp: Namespace, x: Array, c: float) -> Array:
    """``x * c`` for a Python float ``c``, as torch computes it (HF's multipliers: Granite's
    embedding, residual and logit scales, Cohere 2's logit scale, Falcon-H1's many): in float32
    for a narrower float (bfloat16, float16), rounded once to ``x``'s dtype; in ``x``'s own dtype
    otherwise."""
    if x.dtype in (xp.float32, xp.float64):
        return x * c
    return xp.astype(xp.astype(x, xp.float32) * c, x.dtype)
