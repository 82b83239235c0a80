"""Quantized weights times 8-bit activations: llama.cpp's way of multiplying codes.

The exact mode (:func:`~portable_llm.ops.quant.public.quantized_linear`) multiplies the codes'
float weights by float activations. This mode (``activations="int8"``) rounds the activations
too, on the fly, as llama.cpp's Q8_0 blocks do, and multiplies integers:

1. each row of ``x`` ``(M, K)`` is cut into blocks of ``A = min(32, group_size)`` values; block
   ``j`` of row ``m`` gets the scale ``d[m, j] = max|x[m, block j]| / 127`` and the codes
   ``xq = round(x / d)`` in ``[-127, 127]`` (an all-zero block: ``d = 0``, codes 0);
2. with the weight's centred codes ``q - c`` (``c = 2**(bits-1)``), each block's integer dot
   ``I[m, n, j] = sum_k xq[m, k] (q[n, k] - c)`` and the block's code sum ``S[m, j] = sum_k xq``;
3. ``y[m, n] = sum_j d[m, j] (s[n, g(j)] I[m, n, j] + (b[n, g(j)] + c s[n, g(j)]) S[m, j])``, in
   float32 (float64 for float64 x), rounded once to x's dtype.

Every block lies inside one weight group (``group_size`` is a multiple of ``A``). The integer
dots are exact in float32: ``|I| <= 127 * 128 * 32 < 2**24``, so the portable path computes them
with a float32 matmul of integer-valued floats (every library has one; MLX has no integer
matmul) and gets the same integers as an int8 kernel. A native kernel (``native/numba_cpu.py``)
reads the packed codes and int8 activations directly.

This mode is judged as llama.cpp's is: by the KL divergence of the model's token distributions
from the exact mode's on real text (:func:`~portable_llm.perplexity`), not element by element.
"""

from __future__ import annotations

from typing import Any

from portable_llm.core.checks import float_compute_dtype
from portable_llm.core.dispatch import portable
from portable_llm.ops.quant.codes import exact_divide, unpack_codes

__all__ = [
    "ACTIVATIONS",
    "activation_block",
    "projection_op",
    "quantize_activations",
]

#: The activation modes of a quantized projection: ``"float"`` (exact: the codes' float weights
#: times float activations) and ``"int8"`` (the activations rounded to 8 bits per block).
ACTIVATIONS: tuple[str, ...] = ("float", "int8")
#: The largest activation block (llama.cpp's Q8_0: 32 values, one scale).
_BLOCK = 32


def projection_op(activations: Any, where: str) -> str:
    """The op of a quantized projection whose activations are ``activations``:
    ``quantized_linear`` (``"float"``) or ``quantized_linear_int8`` (``"int8"``); the one check
    of the mode's name, for :func:`~portable_llm.quantized_linear` and a model's bound weights.

    Raises
    ------
    ValueError
        ``activations`` not in :data:`ACTIVATIONS`, named with ``where`` (the caller).
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"{where}: activations must be one of {ACTIVATIONS}, got {activations!r}")
    return "quantized_linear" if activations == "float" else "quantized_linear_int8"


def activation_block(group_size: int) -> int:
    """``A``: the activation block of a weight with groups of ``group_size`` (32, or the group
    when smaller: Q6_K's 16), so that every block lies inside one weight group."""
    return min(_BLOCK, group_size)


def quantize_activations(xp: Any, x: Any, *, block: int) -> tuple[Any, Any]:
    """Q8_0 blocks of ``x`` ``(M, K)``: the codes ``(M, K / block, block)`` as integer-valued
    floats of the compute dtype in ``[-127, 127]`` and the scales ``d`` ``(M, K / block, 1)``."""
    ct = float_compute_dtype(xp, x.dtype)
    m, k = x.shape
    xb = xp.reshape(xp.astype(x, ct), (m, k // block, block))  # (M, J, A)
    amax = xp.max(xp.abs(xb), axis=-1, keepdims=True)  # (M, J, 1)
    # True divisions (exact_divide: XLA would multiply by a reciprocal, two roundings that move
    # codes near a rounding boundary), so every library rounds to the same codes.
    d = exact_divide(xp, amax, xp.full_like(amax, 127.0))
    safe = xp.where(d > 0, d, xp.ones_like(d))
    xq = xp.round(exact_divide(xp, xb, safe))  # half to even; |xb / d| <= 127: no clip
    return xq, d


@portable("quantized_linear_int8", pure=True)
def _quantized_linear_int8(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    ct = float_compute_dtype(xp, x.dtype)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    n = scales.shape[0]
    a = activation_block(group_size)
    per = group_size // a  # activation blocks per weight group
    j = k // a
    xq, d = quantize_activations(xp, xp.reshape(x, (-1, k)), block=a)  # (M, J, A), (M, J, 1)
    half = 1 << (bits - 1)
    codes = unpack_codes(xp, packed, bits=bits) - half  # (N, K) int32, centred
    q = xp.reshape(xp.astype(codes, ct), (n, j, a))  # (N, J, A): exact small integers
    # (J, M, A) @ (J, A, N): the blocks' integer dots, exact in float32 (|I| < 2**24)
    dots = xp.matmul(xp.permute_dims(xq, (1, 0, 2)), xp.permute_dims(q, (1, 2, 0)))  # (J, M, N)
    sums = xp.sum(xq, axis=-1)  # (M, J): the blocks' code sums
    s = xp.astype(scales, ct)  # (N, G)
    b = xp.astype(biases, ct) + float(half) * s  # (N, G): the centred codes' bias b + c * s
    if per > 1:  # each activation block takes its group's scale and bias
        s = xp.reshape(xp.broadcast_to(s[:, :, None], (n, k // group_size, per)), (n, j))
        b = xp.reshape(xp.broadcast_to(b[:, :, None], (n, k // group_size, per)), (n, j))
    dm = xp.permute_dims(d[..., 0], (1, 0))  # (J, M)
    scaled = dots * xp.permute_dims(s, (1, 0))[:, None, :]  # (J, M, N): s I
    y = xp.sum(scaled * dm[:, :, None], axis=0)  # (M, N)
    y = y + xp.matmul(d[..., 0] * sums, xp.matrix_transpose(b))  # (M, N): sum_j d S b
    if bias is not None:
        y = y + xp.astype(bias, ct)
    return xp.reshape(xp.astype(y, x.dtype), (*lead, n))  # (N.., O)
