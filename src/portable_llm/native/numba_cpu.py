"""CPU kernels written with numba: quantized codes times 8-bit activations (``activations="int8"``).

``quantized_linear_int8`` (:mod:`portable_llm.ops.quant_int8`) as llama.cpp computes it: the
rows of x rounded to Q8_0 blocks (``d = max|x| / 127`` per block of 32, codes in [-127, 127]),
then per output row and block one integer dot of the int8 codes with the weight's centred codes
read straight from the packed bytes (2, 4 or 8 bits), scaled back in float32. numba compiles
the loops for the machine it runs on (LLVM, the CPU's own vector width: AVX2, AVX-512, NEON),
so nothing is built at install time; the output rows run in parallel over numba's threads.

The integer dots equal the portable path's (exact integers both); the float32 combination
sums the blocks in another order, so the two agree within float32's tolerance. Registered for
NumPy arrays and, through their shared buffers, CPU torch tensors (``native/numpy.py``,
``native/torch.py``). numba is optional (the ``numba`` extra): without it the portable path runs.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from typing import Any

import numpy as np

__all__ = ["available", "int8_applies", "quantized_linear_int8"]

#: The code widths whose codes never straddle a byte (2, 4 and 8 bits): read as bytes.
BYTE_BITS = (2, 4, 8)


@cache
def available() -> bool:
    """Whether numba is installed (checked once, without importing it)."""
    return importlib.util.find_spec("numba") is not None


def int8_applies(bits: int, group_size: int) -> bool:
    """Whether the kernel computes this format: byte-aligned codes on a little-endian CPU."""
    return available() and bits in BYTE_BITS and sys.byteorder == "little" and group_size >= 16


@cache
def _kernels() -> tuple[Any, Any]:
    import numba

    @numba.njit(cache=True, fastmath=False)
    def quantize_rows(x: Any, a: int) -> tuple[Any, Any, Any]:  # pragma: no cover - compiled
        m, k = x.shape
        j = k // a
        xq = np.empty((m, k), np.int8)
        d = np.empty((m, j), np.float32)
        sums = np.empty((m, j), np.float32)
        for r in range(m):
            for b in range(j):
                amax = np.float32(0.0)
                for t in range(b * a, (b + 1) * a):
                    v = abs(x[r, t])
                    amax = v if v > amax else amax
                scale = amax / np.float32(127.0)
                d[r, b] = scale
                inv = scale if scale > 0 else np.float32(1.0)
                total = 0
                for t in range(b * a, (b + 1) * a):
                    q = np.round(x[r, t] / inv)
                    xq[r, t] = q
                    total += int(q)
                sums[r, b] = np.float32(total)
        return xq, d, sums

    # fastmath: the products (|xq (q - c)| <= 127 * 128) and every partial sum of a block (at
    # most 32 of them, < 2**24) are integers that float32 holds exactly, so reassociating and
    # vectorizing their sums changes nothing; the float32 combination of the blocks may round
    # differently from the portable path's (within float32's tolerance).
    @numba.njit(parallel=True, cache=True, fastmath=True)
    def dots(
        planes: Any, d: Any, sums: Any, codes: Any, s: Any, b: Any, bits: int, a: int, per: int
    ) -> Any:  # pragma: no cover - compiled
        # planes[c, r, i]: the activation code (a float32 integer) that meets code c of byte i
        per_byte, m, nbytes = planes.shape
        n = codes.shape[0]
        mask = (1 << bits) - 1
        half = np.float32(1 << (bits - 1))
        bpb = a // per_byte  # bytes per activation block
        j = nbytes // bpb
        out = np.empty((m, n), np.float32)
        for o in numba.prange(n):
            row = codes[o]
            prod = np.empty(nbytes, np.float32)  # per byte: its codes times their activations
            for r in range(m):
                prod[:] = 0.0
                for c in range(per_byte):
                    shift = bits * c
                    xr = planes[c, r]
                    for i in range(nbytes):
                        q = np.float32((np.int32(row[i]) >> shift) & mask) - half
                        prod[i] += xr[i] * q
                acc = np.float32(0.0)
                for blk in range(j):
                    isum = np.float32(0.0)
                    for t in range(blk * bpb, (blk + 1) * bpb):
                        isum += prod[t]
                    g = blk // per
                    acc += d[r, blk] * (s[o, g] * isum + b[o, g] * sums[r, blk])
                out[r, o] = acc
        return out

    return quantize_rows, dots


def quantized_linear_int8(
    x: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bias: Any, *,
    bits: int, group_size: int,
) -> np.ndarray:  # fmt: skip
    """``quantized_linear_int8`` on NumPy arrays (x float16/32, any leading axes): the kernel's
    float32 result, in x's dtype."""
    quantize_rows, dots = _kernels()
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    a = min(32, group_size)
    x2 = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)  # (M, K)
    codes = np.ascontiguousarray(packed).view(np.uint8)  # (N, K * bits / 8)
    s = np.ascontiguousarray(scales, dtype=np.float32)  # (N, G)
    b = s * np.float32(1 << (bits - 1)) + np.asarray(biases, dtype=np.float32)  # b + c * s
    xq, d, sums = quantize_rows(x2, a)
    per_byte = 8 // bits
    # (8 / bits, M, K * bits / 8): code c of byte i multiplies activation per_byte * i + c
    planes = np.ascontiguousarray(
        xq.reshape(xq.shape[0], -1, per_byte).transpose(2, 0, 1), dtype=np.float32
    )
    y = dots(planes, d, sums, codes, s, b, bits, a, group_size // a)
    if bias is not None:
        y += np.asarray(bias, dtype=np.float32)
    return y.astype(x.dtype, copy=False).reshape(*lead, y.shape[-1])  # (N.., O)
