"""NumPy kernels: ``quantized_linear`` over 4- and 8-bit codes, block by block through BLAS.

NumPy has no quantized product, and dequantizing a whole weight per call costs several full-size
float passes (measured 0.08x the dense GEMV on SmolLM2). These kernels turn one block of output
rows at a time into float32 codes in a buffer that stays in the CPU's cache, then multiply it
with BLAS:

- few rows of x (decode, ``M * 4 <= group_size``): the centred codes ``q - c`` (``c = 2**(bits-1)``)
  of each group go straight into one batched product per block, ``d[g, m, n] = x_g . (q - c)``;
  the scales multiply the ``(G, M, n)`` partial sums and the biases ``b + c * s`` meet the
  per-group sums of x once (``ops.quant``'s grouped formula, no pass over the weight for them);
- more rows (prefill): the block's weight ``s * q + b`` exactly as ``dequantize`` rounds it, then
  one GEMM per block.

The products accumulate in float32 and are rounded once to x's dtype. With half-precision scales
or x the weight is formed (dequantized blocks) and rounded as ``dequantize`` rounds it, then to
x's dtype: the one mixed-precision rule; the grouped form serves float32 x and scales.
The codes are read as the bytes of the little-endian uint32 words: 8-bit code ``k`` is byte
``k``, 4-bit code ``2j`` the low nibble of byte ``j`` and ``2j + 1`` its high nibble.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import numpy as np

from portable_llm.core.dispatch import native
from portable_llm.native import numba_cpu

#: Bytes of the float32 block buffer (measured best of 128 KiB-2 MiB on a 1 MiB L2).
BLOCK_BYTES = 1 << 20
#: The grouped form while ``rows * GROUPED_ROWS <= group_size`` (as ``ops.quant``'s rule).
GROUPED_ROWS = 4


def _applies(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> bool:
    return (
        bits in (4, 8)
        and packed.ndim == 2
        and sys.byteorder == "little"  # the codes are read as the words' bytes
        and x.dtype != np.float64  # float64 keeps the portable path's float64 arithmetic
        and scales.dtype != np.float64
    )


@native("numpy", "quantized_linear", kernel="float32 blocks of codes + BLAS", applies=_applies)
def quantized_linear(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x2 = np.asarray(x.reshape(-1, k), dtype=np.float32)  # (M, K)
    codes = np.ascontiguousarray(packed).view(np.uint8)  # (N, K * bits / 8)
    s = np.asarray(scales, dtype=np.float32)  # (N, G)
    b = np.asarray(biases, dtype=np.float32)
    rows = x2.shape[0]
    # The grouped sums never form the weight, so they cannot round it to a half dtype: they
    # serve float32 x and scales only (as ops.quant's auto rule for its grouped path).
    wide = x.dtype == np.float32 and scales.dtype == np.float32
    if wide and rows * GROUPED_ROWS <= group_size:
        y = _grouped(x2, codes, s, b, bits=bits, group_size=group_size)
    else:
        rounds = tuple(dt for dt in (scales.dtype, x.dtype) if dt != np.float32)
        y = _dequantized_blocks(
            x2, codes, s, b, bits=bits, group_size=group_size, rounds=tuple(dict.fromkeys(rounds))
        )
    if bias is not None:
        y += np.asarray(bias, dtype=np.float32)
    return y.astype(x.dtype, copy=False).reshape(*lead, y.shape[-1])  # (N.., O)


def _block_rows(n: int, k: int) -> int:
    return max(16, min(n, BLOCK_BYTES // (4 * k)))


def _grouped(x: Any, codes: Any, s: Any, b: Any, *, bits: int, group_size: int) -> Any:
    """``sum_g s[n, g] * (x_g . (q - c)[n, g]) + (b + c * s)[n, g] * sum(x_g)``, float32."""
    (m, k), n = x.shape, codes.shape[0]
    g, half = k // group_size, 1 << (bits - 1)
    xs = x.reshape(m, g, group_size)  # (M, G, gs)
    nb = _block_rows(n, k)
    y = np.empty((m, n), np.float32)
    d = np.empty((g, m, nb), np.float32)  # per-group partial sums of one block
    signed = np.empty((nb, codes.shape[1]), np.uint8)  # the block's codes, centred (int8)
    # q ^ c read as int8 is q - c: a byte's two nibbles at once with 0x88. Measured per code:
    # the uint8/int8 ops ~0.03 ns, the int8 -> float32 cast ~0.2 ns, the batched product
    # ~0.1 ns (np.subtract with dtype=float32 casts through a buffer: 0.4-0.5 ns).
    flip = np.uint8(0x88 if bits == 4 else 0x80)
    if bits == 8:
        xg = np.ascontiguousarray(xs.transpose(1, 0, 2))  # (G, M, gs)
        buf = np.empty((nb, k), np.float32)
    else:  # the low nibbles hold the even codes, the high ones the odd codes
        xe = np.ascontiguousarray(xs[..., 0::2].transpose(1, 0, 2))  # (G, M, gs/2)
        xo = np.ascontiguousarray(xs[..., 1::2].transpose(1, 0, 2))
        low = np.empty((nb, k // 2), np.uint8)
        lo, hi = np.empty((nb, k // 2), np.float32), np.empty((nb, k // 2), np.float32)
        d2 = np.empty_like(d)
    for n0 in range(0, n, nb):
        w = min(nb, n - n0)
        dw = d[:, :, :w]
        t = np.bitwise_xor(codes[n0 : n0 + w], flip, out=signed[:w])
        if bits == 8:
            np.copyto(buf[:w], t.view(np.int8))  # (w, K) centred codes, float32
            q = buf[:w].reshape(w, g, group_size).transpose(1, 2, 0)  # (G, gs, w)
            np.matmul(xg, q, out=dw)
        else:
            # (t * 16) >> 4 (arithmetic, int8) is the low nibble's sign-extended value, t >> 4
            # the high one's (uint8 left_shift measured 20x slower than the multiply)
            np.multiply(t, np.uint8(16), out=low[:w])
            i8 = low[:w].view(np.int8)
            np.right_shift(i8, np.int8(4), out=i8)
            np.copyto(lo[:w], i8)
            i8 = t.view(np.int8)
            np.right_shift(i8, np.int8(4), out=i8)
            np.copyto(hi[:w], i8)
            half_gs = group_size // 2
            np.matmul(xe, lo[:w].reshape(w, g, half_gs).transpose(1, 2, 0), out=dw)
            d2w = d2[:, :, :w]
            np.matmul(xo, hi[:w].reshape(w, g, half_gs).transpose(1, 2, 0), out=d2w)
            dw += d2w  # (G, M, w)
        dw *= s[n0 : n0 + w].T[:, None, :]
        np.sum(dw, axis=0, out=y[:, n0 : n0 + w])
    y += xs.sum(axis=-1) @ (b + half * s).T  # (M, G) @ (G, N): the centred codes' biases
    return y


def _dequantized_blocks(
    x: Any, codes: Any, s: Any, b: Any, *, bits: int, group_size: int, rounds: tuple[Any, ...]
) -> Any:
    """``x @ w.T`` with ``w = s * q + b`` built block by block as ``dequantize`` rounds it: in
    float32, or rounded to the half dtype ``rounds[0]`` (the scales') after the multiply and
    after the add, then to each further dtype of ``rounds`` (x's: the weight cast to x's dtype).
    """
    (m, k), n = x.shape, codes.shape[0]
    g = k // group_size
    nb = _block_rows(n, k)
    y = np.empty((m, n), np.float32)
    buf = np.empty((nb, k), np.float32)
    halves = [np.empty((nb, k), dt) for dt in rounds]
    for n0 in range(0, n, nb):
        w = min(nb, n - n0)
        wb = buf[:w]
        blk = codes[n0 : n0 + w]
        if bits == 8:
            np.copyto(wb, blk)
        else:  # (w, K/2, 2): the low nibble is the even code
            pairs = wb.reshape(w, k // 2, 2)
            np.bitwise_and(blk, 15, out=pairs[..., 0], casting="unsafe")
            np.right_shift(blk, 4, out=pairs[..., 1], casting="unsafe")
        w3 = wb.reshape(w, g, group_size)  # (w, G, gs)
        w3 *= s[n0 : n0 + w, :, None]  # rounded, then the bias added: dequantize's order
        if halves:
            _round(wb, halves[0][:w])
        w3 += b[n0 : n0 + w, :, None]
        for h in halves:
            _round(wb, h[:w])
        np.matmul(x, wb.T, out=y[:, n0 : n0 + w])
    return y


def _round(w: Any, half: Any) -> None:
    """Round the float32 ``w`` to ``half``'s dtype in place (through ``half``)."""
    np.copyto(half, w, casting="unsafe")
    np.copyto(w, half)


# -- quantized codes times 8-bit activations (activations="int8"): numba's kernel --------------


def _numba_int8_applies(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> bool:
    return (
        numba_cpu.int8_applies(bits, group_size)
        and packed.ndim == 2
        and x.dtype != np.float64  # float64 keeps the portable path's float64 arithmetic
    )


def _numba_int8_specialize(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> Any:
    """The kernel for a weight bound once: repacked now, then one compiled call a product."""
    fmt = {"bits": bits, "group_size": group_size}
    if _numba_int8_dense(x, bits):
        return None  # the call's dense route: no repack to keep
    pre = numba_cpu.prepack(packed, scales, biases, **fmt)

    def run(xp: Any, x: Any, b: Any) -> Any:
        return numba_cpu.linear(pre, x, b)

    return run


@native(
    "numpy",
    "quantized_linear_int8",
    kernel="numba: int16/int32 dots of Q8_0 blocks with codes repacked across 64 output rows",
    applies=_numba_int8_applies,
    specialize=_numba_int8_specialize,
)
def quantized_linear_int8(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    fmt = {"bits": bits, "group_size": group_size}
    if _numba_int8_dense(x, bits):  # a prompt: the Q8_0 blocks' values times the floats
        return _int8_dense(x, packed, scales, biases, bias, **fmt)
    build = partial(numba_cpu.prepack, packed, scales, biases, **fmt)
    return numba_cpu.linear(numba_cpu.prepacked(packed, scales, biases, build), x, bias)


def _numba_int8_dense(x: Any, bits: int) -> bool:
    """Whether a product of these rows takes the dense route (:func:`numba_cpu.q8_values`):
    a prompt, at the widths the exact kernel above reads."""
    return bits in (4, 8) and x.size // x.shape[-1] >= numba_cpu.PREFILL_ROWS


def _int8_dense(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> Any:
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x2 = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)  # (M, K)
    xv = numba_cpu.q8_values(x2, numba_cpu.activation_block(group_size))
    s, b = (np.asarray(a, dtype=np.float32) for a in (scales, biases))
    y = quantized_linear(np, xv, packed, s, b, None, bits=bits, group_size=group_size)  # (M, O)
    if bias is not None:
        y += np.asarray(bias, dtype=np.float32)
    return y.astype(x.dtype, copy=False).reshape(*lead, y.shape[-1])  # (N.., O)
