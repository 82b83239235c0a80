"""The compiled loops of :mod:`portable_llm.native.numba_cpu` (imported only when numba is).

Module-level functions so that numba's on-disk cache (``cache=True``) hits in the next process:
defined inside a function, each kernel held its callee (``quantize``) as a closure cell, and the
cache's key changed with every process (each run compiled again, ~5-10 s, and saved one more
entry). The layout and the arithmetic are described in :mod:`~portable_llm.native.numba_cpu`.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

__all__ = ["bytes_", "nibbles", "quantize"]


# Not fastmath: true divisions and half-to-even rounding, as the portable path's codes.
@numba.njit(cache=True)
def quantize(x: Any, a: int) -> tuple[Any, Any, Any]:  # pragma: no cover - compiled
    m, k = x.shape
    j = k // a
    xq = np.empty((m, k), np.int8)
    d = np.empty((m, j), np.float32)
    sums = np.empty((m, j), np.float32)
    for r in range(m):
        for blk in range(j):
            amax = np.float32(0.0)
            for t in range(blk * a, (blk + 1) * a):
                v = abs(x[r, t])
                amax = v if v > amax else amax
            # numba divides float32 by float32 in float64: rounded back to float32, the
            # correctly rounded float32 quotient the portable path forms
            scale = np.float32(amax / np.float32(127.0))
            d[r, blk] = scale
            inv = scale if scale > 0 else np.float32(1.0)
            total = 0
            for t in range(blk * a, (blk + 1) * a):
                q = np.round(np.float32(x[r, t] / inv))
                xq[r, t] = np.int8(q)
                total += int(q)
            sums[r, blk] = np.float32(total)
    return xq, d, sums


# No fastmath anywhere: numba compiles a callee (quantize) with its caller's flags, and
# fastmath turns quantize's true divisions into products by a reciprocal (codes one off at
# a rounding boundary: tested). Every loop below runs across lanes without a reduction, so
# LLVM vectorizes it as it is.
@numba.njit(cache=True)
def nibbles(w: Any, s: Any, b: Any, x: Any, a: int, g: int) -> Any:  # pragma: no cover
    xq, d, sums = quantize(x, a)
    nt, j = w.shape[0], w.shape[1]
    m = xq.shape[0]
    per = j // g  # activation blocks per weight group
    out = np.empty((m, nt * 64), np.float32)
    acc = np.empty(64, np.int16)
    y = np.empty(64, np.float32)
    for tile in range(nt):
        for r in range(m):
            y[:] = 0
            for blk in range(j):
                acc[:] = 0
                for t in range(a):
                    xv = np.int16(xq[r, blk * a + t])
                    wt = w[tile, blk, t]
                    for lane in range(32):
                        byte = wt[lane]
                        # the nibble's two's complement: (v ^ 8) - 8 sign-extends 4 bits
                        lo = np.int16((byte & 15) ^ 8) - np.int16(8)
                        hi = np.int16((byte >> 4) ^ 8) - np.int16(8)
                        acc[lane] += lo * xv
                        acc[lane + 32] += hi * xv
                grp = blk // per
                dd = d[r, blk]
                ds = dd * sums[r, blk]
                sg = s[tile, grp]
                bg = b[tile, grp]
                for lane in range(64):
                    y[lane] += (sg[lane] * dd) * np.float32(acc[lane]) + bg[lane] * ds
            out[r, tile * 64 : (tile + 1) * 64] = y
    return out


@numba.njit(cache=True)
def bytes_(w: Any, s: Any, b: Any, x: Any, a: int, g: int) -> Any:  # pragma: no cover
    xq, d, sums = quantize(x, a)
    nt, j = w.shape[0], w.shape[1]
    m = xq.shape[0]
    per = j // g
    out = np.empty((m, nt * 64), np.float32)
    acc = np.empty(64, np.int32)
    y = np.empty(64, np.float32)
    for tile in range(nt):
        for r in range(m):
            y[:] = 0
            for blk in range(j):
                acc[:] = 0
                for t in range(a):
                    xv = np.int32(xq[r, blk * a + t])
                    wt = w[tile, blk, t]
                    for lane in range(64):
                        acc[lane] += np.int32(wt[lane]) * xv
                grp = blk // per
                dd = d[r, blk]
                ds = dd * sums[r, blk]
                sg = s[tile, grp]
                bg = b[tile, grp]
                for lane in range(64):
                    y[lane] += (sg[lane] * dd) * np.float32(acc[lane]) + bg[lane] * ds
            out[r, tile * 64 : (tile + 1) * 64] = y
    return out
