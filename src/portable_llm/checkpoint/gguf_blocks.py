"""GGUF (ggml) tensor blocks, decoded with NumPy on the host.

Each ggml block type stores a row of ``K`` weights as ``K / block`` blocks of bytes. The types
that are an affine code per group (``w = scale * q + bias``: of 32 weights, 16 for Q6_K) decode
to the triple ``(q, scales, biases)`` of :func:`affine_parts`, which is MLX's affine layout once
``q`` is packed (:func:`pack_codes`); the rest decode to floats only (:func:`dequantize_blocks`).

========  =====  ======  ==========================================  ===============
type      block  bytes   layout of one block                          affine (bits, group)
========  =====  ======  ==========================================  ===============
Q4_0      32     18      d f16, 16 bytes of nibbles                   4: d, -8 d
Q4_1      32     20      d f16, m f16, 16 bytes of nibbles            4: d, m
Q5_0      32     22      d f16, qh u32, 16 bytes of nibbles           5: d, -16 d
Q5_1      32     24      d f16, m f16, qh u32, 16 bytes               5: d, m
Q8_0      32     34      d f16, 32 int8                               8: d, -128 d
Q4_K      256    144     d, dmin f16, 12 bytes of 6-bit scales/mins,  4: d sc, -dmin m
                         128 bytes of nibbles
Q5_K      256    176     as Q4_K, then 32 bytes of fifth bits         5: d sc, -dmin m
Q6_K      256    210     128 bytes low nibbles, 64 bytes high pairs,  8, 16: d sc, -32 d sc
                         16 int8 scales, d f16
MXFP4     32     17      e8m0 exponent, 16 bytes of FP4 nibbles       (MXFP4Weight)
========  =====  ======  ==========================================  ===============

Nibbles: in a run of 32 weights, byte ``l`` holds weight ``l`` in its low nibble and weight
``l + 16`` (``l + 32`` in the K-quants' 64-weight chunks) in its high nibble. All arithmetic is
float32, as ggml's own ``dequantize_row_*``, and the affine triples give ggml's values exactly
(``d`` is a float16: ``d * sc``, ``-8 d``, ``-32 d sc`` and their products with the codes are
exact in float32).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "AFFINE_FORMATS",
    "BLOCK_SIZES",
    "FLOAT16_INF",
    "affine_parts",
    "dequantize_blocks",
    "float16_overflow",
    "pack_codes",
]

#: ggml type name -> (weights per block, bytes per block).
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "MXFP4": (32, 17),  # e8m0 exponent, 16 bytes of FP4 E2M1 nibbles (checkpoint/mxfp4.py)
}
#: The types that are exactly MLX's affine format: type -> (bits, group_size) kept. Q6_K's 6-bit
#: codes are kept as 8-bit ones: 1/3 more memory for its codes than packing them in 6 bits, but
#: the native kernels' byte paths take them (NumPy, torch: 0.07-0.75x the floats per decode
#: projection, against 0.01-0.06x for 6-bit codes, whose bit stream only the portable paths
#: unpack; benchmarks/README.md).
AFFINE_FORMATS: dict[str, tuple[int, int]] = {
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q5_0": (5, 32),
    "Q5_1": (5, 32),
    "Q8_0": (8, 32),
    "Q4_K": (4, 32),
    "Q5_K": (5, 32),
    "Q6_K": (8, 16),  # 6-bit codes held one a byte: the kernels' byte paths read them
}

_SIGNED = {"Q4_0": 8.0, "Q5_0": 16.0, "Q8_0": 128.0}  # codes stored with this offset


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row as a float16, widened to float32: ``(n, 2) -> (n, 1)``."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(n, 16)`` bytes -> ``(n, 32)`` codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """``(n, 4)`` bytes, a little-endian uint32 per row -> its 32 bits ``(n, 32)``."""
    word = np.ascontiguousarray(qh).view("<u4")  # (n, 1)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, ``(n, 8)`` each."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_codes(qs: np.ndarray) -> np.ndarray:
    """K-quants: 128 bytes -> 256 four-bit codes; chunk ``j`` of 64 weights is bytes
    ``32 j .. 32 j + 31``, low nibbles first."""
    n = qs.shape[0]
    chunks = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(n, 256)


def _q6_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: ``(q, scale)``, the 6-bit codes ``(n, 256)`` (0..63, ``w = scale * (q - 32)``) and
    one float32 scale ``d * sc`` per 16 weights ``(n, 16)``."""
    n = blocks.shape[0]
    ql, qh, sc = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = _f16(blocks[:, 208:210])
    # half h (128 weights) uses ql bytes 64 h .. 64 h + 63 and qh bytes 32 h .. 32 h + 31:
    # quarter r (32 weights) takes nibble r // 2 of ql[64 h + 32 (r % 2) + l] and bits
    # 2r, 2r+1 of qh[32 h + l].
    ql = ql.reshape(n, 2, 1, 2, 32)  # (n, half, nibble, byte run, l)
    low = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)) & 0x0F
    low = low.reshape(n, 2, 4, 32)  # quarters in order: r = 2 * nibble + run
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (qh.reshape(n, 2, 1, 32) >> shifts) & 3  # (n, half, r, l)
    q = (low | (high << 4)).reshape(n, 256)
    return q, d * sc.view(np.int8).astype(np.float32)


def affine_parts(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, scales, biases)`` of blocks of an :data:`AFFINE_FORMATS` type: ``w = scales * q +
    biases`` per group (of 32 weights; of 16 for Q6_K).

    Parameters
    ----------
    kind : str
        A key of :data:`AFFINE_FORMATS`.
    blocks : uint8 array, shape ``(n, bytes per block)``

    Returns
    -------
    q : uint8, shape ``(n, block)``; scales, biases : float32, shape ``(n, block / group)``
    """
    n = blocks.shape[0]
    if kind in ("Q4_0", "Q5_0", "Q8_0"):
        d = _f16(blocks[:, 0:2])
        if kind == "Q8_0":
            q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        elif kind == "Q4_0":
            q = _nibbles(blocks[:, 2:])
        else:
            q = _nibbles(blocks[:, 6:]) | (_bits32(blocks[:, 2:6]) << 4)
        return q, d, d * np.float32(-_SIGNED[kind])
    if kind in ("Q4_1", "Q5_1"):
        d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        if kind == "Q4_1":
            q = _nibbles(blocks[:, 4:])
        else:
            q = _nibbles(blocks[:, 8:]) | (_bits32(blocks[:, 4:8]) << 4)
        return q, d, m
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        if kind == "Q4_K":
            q = _k_codes(blocks[:, 16:])
        else:
            qh = blocks[:, 16:48]  # bit 2j of byte l: fifth bit of weight 64 j + l, 2j+1: +32
            high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            q = _k_codes(blocks[:, 48:]) | (high.reshape(n, 256) << 4)
        return q, d * sc, -(dmin * mn)
    if kind == "Q6_K":
        q, scale = _q6_parts(blocks)
        return q, scale, scale * np.float32(-32)
    raise ValueError(f"affine_parts: {kind} is not an affine type ({', '.join(AFFINE_FORMATS)})")


def dequantize_blocks(kind: str, blocks: np.ndarray) -> np.ndarray:
    """Float32 weights of blocks of any type in :data:`BLOCK_SIZES`.

    Parameters
    ----------
    kind : str
    blocks : uint8 array, shape ``(n, bytes per block)``

    Returns
    -------
    float32 array, shape ``(n, block)``
    """
    n = blocks.shape[0]
    if kind in _SIGNED:  # ggml's d * (q - offset): bit for bit, signed zeros included
        q, d, _ = affine_parts(kind, blocks)
        return d * (q.astype(np.float32) - np.float32(_SIGNED[kind]))
    if kind == "Q6_K":  # ggml's d * sc * (q - 32), in that order
        q, scale = _q6_parts(blocks)
        signed = q.astype(np.float32) - np.float32(32)
        return (scale.reshape(n, 16, 1) * signed.reshape(n, 16, 16)).reshape(n, 256)
    if kind in AFFINE_FORMATS:  # ggml's scale * q + bias (Q4_1, Q5_1, Q4_K, Q5_K)
        q, scales, biases = affine_parts(kind, blocks)
        groups, group = scales.shape[1], AFFINE_FORMATS[kind][1]
        w = scales.reshape(n, groups, 1) * q.reshape(n, groups, group).astype(np.float32)
        return (w + biases.reshape(n, groups, 1)).reshape(n, -1)
    if kind == "MXFP4":  # ggml's doubled E2M1 values times half the scale: exact in float32
        doubled = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # e = 255: 2**128, inf as ggml's
            half = np.ldexp(np.float32(1), blocks[:, :1].astype(np.int32) - 128)  # (n, 1)
            return doubled[_nibbles(blocks[:, 1:])] * half
    if kind == "F32":
        return np.ascontiguousarray(blocks).view("<f4").reshape(n, 1).copy()
    if kind == "F16":
        return np.ascontiguousarray(blocks).view("<f2").astype(np.float32).reshape(n, 1)
    if kind == "BF16":
        bits = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(n, 1)
    raise ValueError(f"dequantize_blocks: unsupported type {kind} ({', '.join(BLOCK_SIZES)})")


#: Float32 values of this magnitude and above round to infinity in float16 (its largest is
#: 65504; half an ulp above it rounds up).
FLOAT16_INF = 65520.0


def float16_overflow(kind: str, blocks: np.ndarray) -> tuple[str, float] | None:
    """``(what, magnitude)`` of the first of a tensor's finite float32 numbers that float16
    cannot hold, or ``None`` when all fit: for an affine type its scales, its biases and its
    values (``scales * q + biases`` at each group's smallest and largest code, where an
    affine group takes its extremes), else its values.

    The one rule of a tensor loaded as float16, kept quantized or dequantized alike: a
    ``d`` near float16's largest times a 6-bit scale is a finite float32 scale that float16
    turns into infinity (kept: its whole group ``inf``/``NaN``), while the dequantized values
    of the same group may fit, or overflow elsewhere. Non-finite numbers of the file itself
    are not counted: they decode to ``inf``/``NaN`` in every dtype, as in llama.cpp.
    """
    if kind == "F16":
        return None
    parts: tuple[tuple[str, np.ndarray], ...]
    with np.errstate(all="ignore"):  # a file's own inf/NaN: not counted, below
        if kind in AFFINE_FORMATS:
            q, scales, biases = affine_parts(kind, blocks)
            n, groups = scales.shape
            codes = q.reshape(n, groups, -1)
            low, high = codes.min(axis=-1), codes.max(axis=-1)  # (n, groups)
            ends = np.concatenate([scales * low + biases, scales * high + biases])
            parts = (("scales", scales), ("biases", biases), ("values", ends))
        else:
            parts = (("values", dequantize_blocks(kind, blocks)),)
    for what, a in parts:
        size = np.abs(a[np.isfinite(a)])
        biggest = float(size.max()) if size.size else 0.0
        if biggest >= FLOAT16_INF:
            return what, biggest
    return None


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes ``(N, K)`` of ``bits`` bits into MLX's uint32 layout ``(N, K * bits / 32)``.

    MLX's layout is one little-endian bit stream per row: code ``k`` occupies bits
    ``k * bits .. (k + 1) * bits - 1`` of the row, counted from the lowest bit of the first
    uint32 (for 4 bits: code ``8 i + j`` is bits ``4 j .. 4 j + 3`` of word ``i``).
    """
    N, K = q.shape
    q = q.astype(np.uint8)
    if bits == 8:  # the fast paths: whole codes per byte
        by = q
    elif bits == 4:
        by = q[:, 0::2] | (q[:, 1::2] << 4)
    else:
        stream = (q.reshape(N, K, 1) >> np.arange(bits, dtype=np.uint8)) & 1  # (N, K, bits)
        by = np.packbits(stream.reshape(N, K * bits), axis=1, bitorder="little")
    return np.ascontiguousarray(by).view("<u4").astype(np.uint32).reshape(N, K * bits // 32)
