"""The one float product under :func:`~portable_llm.linear` and the quantized ops: ``affine``.

Kept below ``ops/linear.py`` and ``ops/quant/`` so that both call it without importing each
other.
"""

from __future__ import annotations

from portable_llm.core.checks import is_half
from portable_llm.core.types import Array, Namespace

__all__ = ["affine"]


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
