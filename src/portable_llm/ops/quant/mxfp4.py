"""MXFP4 (OCP Microscaling, gpt-oss's experts): :class:`MXFP4Weight` and its portable kernels.

A weight ``(N, K)`` is cut along K into blocks of 32; each element is a 4-bit float, FP4 E2M1
(1 sign bit, 2 exponent bits of bias 1, 1 mantissa bit: ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their
negatives), and each block shares an 8-bit power-of-two scale, E8M0 (``2 ** (e - 127)``)::

    W[n, k] = FP4_E2M1[code[n, k]] * 2 ** (e[n, k // 32] - 127)

4.25 bits per weight (0.53 bytes). The codes are held as MLX's ``mode="mxfp4"`` does: eight per
uint32 word, element ``k`` in bits ``4 (k % 8)``: the little-endian bytes of a transformers
``*_blocks`` tensor (low nibble first) as they are. A scale byte of 255 (NaN in the OCP spec) is
read as transformers, ggml and MLX read it, ``2 ** 128``: infinite in float32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from portable_llm.backends import Backend, backend_of, get_backend, resolve
from portable_llm.core.arrays import creation_device
from portable_llm.core.checks import check_ndim
from portable_llm.core.dispatch import auto_portable, portable
from portable_llm.ops.affine import affine
from portable_llm.ops.quant.codes import unpack_codes

__all__ = [
    "BLOCK",
    "DEQUANTIZE",
    "FP4_E2M1",
    "LINEAR",
    "MXFP4Weight",
    "e8m0",
    "mxfp4_dequantize",
]

#: Weights per block (one E8M0 scale each).
BLOCK = 32
#: FP4 E2M1's value of each 4-bit code (bit 3 the sign, bits 2-1 the exponent, bit 0 the
#: mantissa): ``(-1)**s * (m / 2 if e == 0 else 2**(e - 1) * (1 + m / 2))``.
FP4_E2M1: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
#: The op names of the kernels (the dispatcher's): dequantize, and ``x @ W.T + bias``.
DEQUANTIZE = "dequantize_mxfp4"
LINEAR = "quantized_linear_mxfp4"


def e8m0(dtype: Any = np.float64) -> np.ndarray:
    """E8M0's 256 scales ``2 ** (e - 127)`` in ``dtype`` (a NumPy dtype): exact powers of two,
    ``2 ** -127`` (subnormal in float32) to ``2 ** 128`` (infinite in float32)."""
    with np.errstate(over="ignore"):
        return np.ldexp(1.0, np.arange(256) - 127).astype(dtype)


class MXFP4Weight:
    """A weight of shape ``(.., N, K)`` in MXFP4: codes and one E8M0 scale per 32 weights.

    Parameters
    ----------
    packed : array, shape ``(.., N, K / 8)``, uint32
        The FP4 E2M1 codes, eight per word, element ``k`` in bits ``4 (k % 8) ..``.
    scales : array, shape ``(.., N, K / 32)``, uint8
        The E8M0 exponents ``e``: block scale ``2 ** (e - 127)``.
    dtype : str, keyword
        The float dtype of the dequantized weight (and of :func:`dequantize`'s result); the
        products of :func:`~portable_llm.quantized_linear` are in x's dtype.

    Attributes
    ----------
    shape, dtype, backend, bits (4), group_size (32) : as :class:`~portable_llm.QuantizedWeight`
    """

    __slots__ = ("backend", "dtype", "packed", "scales", "shape")
    bits = 4
    group_size = BLOCK

    def __init__(self, packed: Any, scales: Any, /, *, dtype: str = "float32") -> None:
        op = "MXFP4Weight"
        bk, (packed, scales) = resolve(op, None, packed, scales)
        for name, a, want in (("packed", packed, "uint32"), ("scales", scales, "uint8")):
            if backend_of(a) is not bk:
                raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}")
            if bk.dtype_name(a.dtype) != want:
                got = f"{bk.dtype_name(a.dtype)} with shape {tuple(a.shape)}"
                raise TypeError(f"{op}: {name} must have dtype {want}, got {got}")
        if dtype not in bk.float_dtypes():
            raise TypeError(
                f"{op}: dtype must be one of {bk.float_dtypes()} ({bk.name}), got {dtype!r}"
            )
        check_ndim(op, "packed", packed, 2, ".. x N x K/8")
        k = packed.shape[-1] * 8
        expected = (*packed.shape[:-1], k // BLOCK)
        if k % BLOCK or tuple(scales.shape) != expected:
            raise ValueError(
                f"{op}: packed {tuple(packed.shape)} holds K = {k} codes per row, in blocks of "
                f"{BLOCK}: scales must have shape {expected} (.. x N x K/32), got "
                f"{tuple(scales.shape)}"
            )
        self.packed, self.scales, self.backend = packed, scales, bk
        self.dtype = bk.dtypes[dtype]
        self.shape: tuple[int, ...] = (*packed.shape[:-1], k)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def arrays(self) -> tuple[Any, Any]:
        """``(packed, scales)``."""
        return self.packed, self.scales

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales: 17 per block of 32 weights (4.25 bits a weight)."""
        return math.prod(self.shape) // 2 + math.prod(self.shape) // BLOCK

    @property
    def device(self) -> Any:
        return self.backend.device_of(self.scales)

    def __getitem__(self, index: Any) -> MXFP4Weight:
        """Index the leading axes (one expert of a stacked ``(X, N, K)`` weight)."""
        if not isinstance(index, int | slice) or (len(self.shape) < 3 and isinstance(index, int)):
            raise TypeError("MXFP4Weight: an int or a slice indexes the leading axis of an "
                            f"(X, N, K) weight; got {index!r} for shape {self.shape}")  # fmt: skip
        name = self.backend.dtype_name(self.dtype)
        return MXFP4Weight(self.packed[index, ...], self.scales[index, ...], dtype=name)

    def to(self, backend: str | Backend, device: Any = None) -> MXFP4Weight:
        """The same weight as arrays of ``backend`` (on ``device``)."""
        bk = get_backend(backend)
        conv = [bk.convert(a, self.backend, device) for a in self.arrays]
        return MXFP4Weight(*conv, dtype=self.backend.dtype_name(self.dtype))

    def __repr__(self) -> str:
        return (f"MXFP4Weight(shape={self.shape}, dtype={self.backend.dtype_name(self.dtype)}, "
                f"backend={self.backend.name!r})")  # fmt: skip


def _table(xp: Any, values: np.ndarray, index: Any, dtype: Any, like: Any) -> Any:
    """``values[index]`` (a host table of ``dtype``'s NumPy type, any shape of integer index)."""
    table = xp.asarray(values, dtype=dtype, device=creation_device(like))
    flat = xp.reshape(xp.astype(index, xp.int32), (-1,))
    return xp.reshape(xp.take(table, flat, axis=0), tuple(index.shape))


def mxfp4_dequantize(xp: Any, packed: Any, scales: Any, *, dtype: Any) -> Any:
    """The weight ``(.., N, K)`` in ``dtype``: each value and scale exact in float32 (float64
    for float64), their product rounded once to ``dtype`` (exact unless it leaves ``dtype``'s
    range)."""
    wide = dtype == xp.float64
    ct, host = (xp.float64, np.float64) if wide else (xp.float32, np.float32)
    codes = unpack_codes(xp, packed, bits=4)  # (.., N, K) int32
    lead, k = tuple(codes.shape[:-1]), codes.shape[-1]
    values = _table(xp, np.asarray(FP4_E2M1, host), codes, ct, packed)  # (.., N, K)
    scale = _table(xp, e8m0(host), scales, ct, packed)  # (.., N, K / 32)
    w = xp.reshape(values, (*lead, k // BLOCK, BLOCK)) * scale[..., None]  # (.., N, K/32, 32)
    return xp.astype(xp.reshape(w, (*lead, k)), dtype)


@portable(DEQUANTIZE, pure=True)
def _dequantize(xp: Any, packed: Any, scales: Any, *, dtype: Any) -> Any:
    return mxfp4_dequantize(xp, packed, scales, dtype=dtype)


@portable(LINEAR, pure=True)
def _linear(xp: Any, x: Any, packed: Any, scales: Any, bias: Any) -> Any:
    """``x @ W.T + bias`` by dequantizing (to x's dtype) and multiplying as ``linear`` does
    (float16/bfloat16 accumulated in float32); JAX compiles the two into one program."""
    return affine(xp, x, mxfp4_dequantize(xp, packed, scales, dtype=x.dtype), bias)


#: ``auto`` multiplies through the pair table (:func:`_linear_lut`) while the rows of x are at
#: most this many (a decode step's): its ``(M, K/2, 256)`` table then stays small beside the
#: ``(N, K)`` weight it never forms.
LUT_ROWS = 4


def _pair_values(host: Any) -> tuple[np.ndarray, np.ndarray]:
    """E2M1's value of the low and of the high nibble of each byte ``0 .. 255``."""
    b = np.arange(256)
    values = np.asarray(FP4_E2M1, host)
    return values[b & 15], values[b >> 4]


@portable(LINEAR, "lut", pure=True)
def _linear_lut(xp: Any, x: Any, packed: Any, scales: Any, bias: Any) -> Any:
    """``x @ W.T + bias`` without forming ``W``: per row of x, a table of the 256 values each
    byte of codes (two weights) contributes at each pair of inputs, ``T[p, b] = x[2p] E2M1[b &
    15] + x[2p+1] E2M1[b >> 4]``, then each output sums its bytes' entries per block of 32,
    times the block's scale. Accumulated in float32 (float64 for float64 x): the order of the
    sums differs from the dequantize-then-multiply path's (within the tolerance table)."""
    wide = x.dtype == xp.float64
    ct, host = (xp.float64, np.float64) if wide else (xp.float32, np.float32)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    n, dev = packed.shape[0], creation_device(packed)
    xr = xp.reshape(xp.astype(x, ct), (-1, k // 2, 2))  # (M, K/2, 2): the pairs of inputs
    lo, hi = (xp.asarray(t, dtype=ct, device=dev) for t in _pair_values(host))  # (256,) each
    table = xr[..., 0:1] * lo + xr[..., 1:2] * hi  # (M, K/2, 256)
    m = table.shape[0]
    codes = unpack_codes(xp, packed, bits=8)  # (N, K/2) int32: the bytes
    place = xp.arange(k // 2, dtype=xp.int32, device=dev) * 256  # (K/2,)
    rows = xp.arange(m, dtype=xp.int32, device=dev) * ((k // 2) * 256)  # (M,)
    index = rows[:, None, None] + (codes + place)[None, ...]  # (M, N, K/2)
    picked = xp.take(xp.reshape(table, (-1,)), xp.reshape(index, (-1,)), axis=0)
    blocks = xp.sum(xp.reshape(picked, (m, n, k // BLOCK, BLOCK // 2)), axis=-1)  # (M, N, K/32)
    scale = _table(xp, e8m0(host), scales, ct, packed)  # (N, K / 32)
    y = xp.sum(blocks * scale, axis=-1)  # (M, N)
    if bias is not None:
        y = y + xp.astype(bias, ct)
    return xp.reshape(xp.astype(y, x.dtype), (*lead, n))  # (N.., N)


@auto_portable(LINEAR)
def _auto(x: Any, packed: Any, scales: Any, bias: Any) -> str:
    """The pair table for a few rows of float32 or float64 x (not traced: XLA fuses the
    dequantize into the product there); the dequantizing path otherwise (half dtypes keep it:
    their product of the weight rounded to x's dtype, as the kernels of MLX)."""
    bk = backend_of(x)
    if bk is None or bk.is_traced(x) or bk.dtype_name(x.dtype) not in ("float32", "float64"):
        return "portable"
    return "lut" if math.prod(x.shape[:-1]) <= LUT_ROWS else "portable"
