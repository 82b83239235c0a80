"""The portable kernels of the quantized ops, registered by op name with the dispatcher:
``dequantize``, ``quantize``, ``quantized_linear`` (dequantize-then-multiply, and ``grouped``:
the codes multiplied group by group for few rows, with ``auto``'s choice between them) and
``quantized_embedding``. The public functions that validate and pick one are in
:mod:`portable_llm.ops.quant.public`; the native kernels in ``native/``.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.backends import backend_of
from portable_llm.core.checks import float_compute_dtype
from portable_llm.core.dispatch import auto_portable, portable
from portable_llm.ops.affine import affine
from portable_llm.ops.quant.codes import exact_divide, pack_codes, unpack_codes

__all__ = ["GROUPED_ROWS"]

#: MLX's floor on a group's step (``float eps = 1e-7``), so a constant group does not divide by 0.
_EPS = 1e-7


# Not compiled on JAX: XLA fuses the multiply and the add into one fma (rounded once, where MLX
# rounds twice: measured one ulp apart in 2% of float32 elements). Run op by op it equals
# mx.dequantize; inside quantized_linear (compiled) the fma is part of the matmul's rounding.
@portable("dequantize")
def _dequantize(
    xp: Any, packed: Any, scales: Any, biases: Any, *, bits: int, group_size: int
) -> Any:
    codes = unpack_codes(xp, packed, bits=bits)  # (.., N, K) int32
    lead, k = tuple(codes.shape[:-1]), codes.shape[-1]
    q = xp.reshape(xp.astype(codes, scales.dtype), (*lead, k // group_size, group_size))
    # MLX's order and dtype: multiply, then add, each rounded to the scales' dtype.
    w = q * scales[..., None] + biases[..., None]  # (.., N, K/group, group)
    return xp.reshape(w, (*lead, k))


@portable("quantize", pure=True)
def _quantize(xp: Any, w: Any, *, bits: int, group_size: int) -> tuple[Any, Any, Any]:
    """MLX's affine quantization (``mlx/backend/cpu/quantized.cpp``), step for step, in float32
    (float64 for float64 weights); scales and biases are rounded to w's dtype at the end only."""
    ct = xp.float64 if w.dtype == xp.float64 else xp.float32
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    g = xp.reshape(xp.astype(w, ct), (*lead, k // group_size, group_size))  # (.., N, G, gs)
    n_bins = float((1 << bits) - 1)
    w_max = xp.max(g, axis=-1, keepdims=True)  # (.., N, G, 1)
    w_min = xp.min(g, axis=-1, keepdims=True)
    # Anchor the group at the endpoint of larger magnitude, so that it is represented exactly.
    mask = xp.abs(w_min) > xp.abs(w_max)
    diff = w_max - w_min
    scale = exact_divide(xp, diff, xp.full_like(diff, n_bins))
    eps = xp.full_like(scale, _EPS)
    scale = xp.where(scale < eps, eps, scale)  # std::max(scale, eps): NaN stays NaN
    scale = xp.where(mask, scale, -scale)
    edge = xp.where(mask, w_min, w_max)
    q0 = xp.round(edge / scale)  # round half to even, as std::rint
    nonzero = q0 != 0
    one = xp.ones_like(q0)
    scale = xp.where(nonzero, edge / xp.where(nonzero, q0, one), scale)
    bias = xp.where(nonzero, edge, xp.zeros_like(edge))
    q = xp.clip(xp.round(exact_divide(xp, g - bias, scale)), 0.0, n_bins)  # (.., N, G, gs)
    codes = xp.reshape(xp.astype(q, xp.int32), (*lead, k))
    packed = pack_codes(xp, codes, bits=bits)
    return packed, xp.astype(scale[..., 0], w.dtype), xp.astype(bias[..., 0], w.dtype)


@portable("quantized_linear", pure=True)
def _quantized_linear(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    w = _dequantize(xp, packed, scales, biases, bits=bits, group_size=group_size)  # (O, I)
    if w.dtype != x.dtype:
        w = xp.astype(w, x.dtype)
    return affine(xp, x, w, bias)


@portable("quantized_linear", "grouped", pure=True)
def _quantized_linear_grouped(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    """The same product without the dequantized weight, for few rows of x (decode):
    ``y[m, n] = sum_g scales[n, g] * (x_g . q[n, g, :]) + biases[n, g] * sum(x_g)``.

    The codes go straight into one batched matmul per group (no scale-and-bias pass over the
    (O, I) weight); the bias term needs only the per-group sums of x. Accumulated in float32
    (float64 for float64 x) and returned in x's dtype. The weight is never rounded to scales'
    dtype, so ``auto`` takes this path only where that rounding cannot show: scales of x's
    dtype, float32 or float64.
    """
    ct = float_compute_dtype(xp, x.dtype)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    n, g = scales.shape[0], k // group_size
    # Centred codes q - c (c = 2**(bits-1), exact in any float) with the bias b + c * s, the
    # group's middle value: the two sums then cancel far less than s * (x . q) against
    # b * sum(x) would (measured on one projection: 4x less error, as small as the dequantizing
    # path's).
    half = float(1 << (bits - 1))
    codes = unpack_codes(xp, packed, bits=bits) - (1 << (bits - 1))  # (O, I) int32, centred
    q = xp.reshape(xp.astype(codes, ct), (n, g, group_size))  # (O, G, gs)
    xg = xp.reshape(xp.astype(x, ct), (-1, g, group_size))  # (M, G, gs)
    xg = xp.permute_dims(xg, (1, 0, 2))  # (G, M, gs)
    dots = xp.matmul(xg, xp.permute_dims(q, (1, 2, 0)))  # (G, M, O): x_g . (q - c)[n, g, :]
    s = xp.astype(xp.permute_dims(scales, (1, 0)), ct)  # (G, O)
    b = xp.astype(biases, ct) + half * xp.astype(scales, ct)  # (O, G): b + c * s
    y = xp.sum(dots * s[:, None, :], axis=0)  # (M, O)
    y = y + xp.matmul(xp.permute_dims(xp.sum(xg, axis=-1), (1, 0)), xp.matrix_transpose(b))
    if bias is not None:
        y = y + xp.astype(bias, ct)
    return xp.reshape(xp.astype(y, x.dtype), (*lead, n))  # (N.., O)


#: ``auto`` takes the grouped path while the rows of x are at most ``group_size / GROUPED_ROWS``
#: (its (G, M, O) partial sums then stay below a quarter of the (O, I) weight it avoids).
GROUPED_ROWS = 4
_WIDE = ("float32", "float64")


@auto_portable("quantized_linear")
def _auto(x: Any, packed: Any, scales: Any, biases: Any, bias: Any, **fmt: Any) -> str:
    rows = math.prod(x.shape[:-1])
    # Only where skipping the weight's rounding to scales' dtype cannot show: scales of x's
    # dtype, float32 or float64 (half dtypes keep the dequantized weight, rounded as MLX does).
    bk = backend_of(x)
    if bk is not None and bk.is_traced(x):
        # Traced into a compiled program (JAX's compiled decode step): XLA fuses the dequantize
        # into the product, 8x faster than the grouped path's batched per-group products
        # (measured on one SmolLM2 projection, 1536 x 576, one row).
        return "portable"
    exact = bk is not None and scales.dtype == x.dtype and bk.dtype_name(x.dtype) in _WIDE
    return "grouped" if exact and rows * GROUPED_ROWS <= fmt["group_size"] else "portable"


@portable("quantized_embedding")  # not compiled on JAX, as dequantize: rows equal dequantize's
def _quantized_embedding(
    xp: Any, ids: Any, packed: Any, scales: Any, biases: Any, *, bits: int, group_size: int
) -> Any:
    """Gather the rows of ``ids`` (any shape, in range), then dequantize those rows only."""
    flat = xp.reshape(ids, (-1,))  # (n,)
    rows = _dequantize(
        xp,
        xp.take(packed, flat, axis=0),
        xp.take(scales, flat, axis=0),
        xp.take(biases, flat, axis=0),
        bits=bits,
        group_size=group_size,
    )  # (n, E)
    return xp.reshape(rows, (*ids.shape, rows.shape[-1]))
