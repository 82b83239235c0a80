"""CPU kernels written with numba: quantized codes times 8-bit activations (``activations="int8"``).

``quantized_linear_int8`` (:mod:`portable_llm.ops.quant.int8`) as llama.cpp computes it: each
row of x rounded to Q8_0 blocks (``d = max|x| / 127`` per block of ``A = min(32, group_size)``,
codes in [-127, 127], the same true division and half-to-even rounding as the portable path),
then integer dots of those codes with the weight's centred codes ``q - c``, scaled back in
float32 per block: ``y[m, n] = sum_j d[m, j] (s I[m, n, j] + (b + c s) S[m, j])``.

The weight is repacked once (:func:`prepack`; cached per weight, or at bind time through
``Native.specialize``) into tiles of 64 output rows, so that the kernel runs *across* the rows
with whole vectors and never sums inside one (no horizontal reduction per block):

- up to 4 bits (``nibbles``): ``w[tile, j, t, l]`` is one byte holding the codes of rows ``l``
  (low nibble) and ``l + 32`` (high nibble) at position ``t`` of block ``j``: the same 0.5 byte
  a code as the packed words. Each block's dots accumulate in int16: ``|q - c| <= 8`` and
  ``|xq| <= 127`` over at most 32 positions give ``|I| <= 32512 < 2**15``, exact;
- 5 to 8 bits (``bytes``): ``w[tile, j, t, l]`` is the centred code of row ``l`` (int8), and
  the dots accumulate in int32.

Per position the kernel multiplies a vector of codes by one broadcast activation code and adds
(LLVM lowers the int16 loop to ``vpmullw``/``vpaddw`` on 32 lanes with AVX-512, 16 with AVX2,
8 with NEON: numba compiles for the CPU it runs on, nothing is built at install time). The
integer dots equal the portable path's (exact integers both); the float32 combination sums the
blocks in another order, so the two agree within float32's tolerance (tested). Serial: one
thread, like the decode it serves (the caller's threads are the model's). Registered for NumPy
arrays and, through their buffers, CPU torch tensors (``native/numpy.py``, ``native/torch.py``).
numba is optional (the ``numba`` extra): without it the portable path runs.
"""

from __future__ import annotations

import importlib.util
import sys
import weakref
from collections.abc import Callable
from functools import cache
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "PREFILL_ROWS",
    "Prepacked",
    "available",
    "int8_applies",
    "linear",
    "prepack",
    "prepacked",
    "q8_values",
    "run",
]

#: Output rows per tile: 32 bytes of nibbles (two rows each) or 64 int8 codes per position.
TILE = 64


#: From this many rows of x on (a prompt), the native paths multiply the Q8_0 blocks' values
#: ``d * xq`` by the dequantized weight with the exact mode's dense product instead (see
#: :func:`q8_values`): measured faster from here (``benchmarks/README.md``).
PREFILL_ROWS = 64


@cache
def available() -> bool:
    """Whether numba is installed (checked once, without importing it)."""
    return importlib.util.find_spec("numba") is not None


def int8_applies(bits: int, group_size: int) -> bool:
    """Whether the kernel computes this format: every width of the affine format, codes read
    from the words' bytes (a little-endian CPU)."""
    return available() and sys.byteorder == "little" and 1 <= bits <= 8 and group_size >= 16


class Prepacked(NamedTuple):
    """A weight ``(N, K)`` in the kernel's layout (see the module docstring)."""

    w: np.ndarray  # (T, J, A, 32) uint8 nibbles, or (T, J, A, 64) int8 centred codes
    s: np.ndarray  # (T, G, 64) float32 scales
    b: np.ndarray  # (T, G, 64) float32 b + c * s: the centred codes' bias
    n: int  # the output rows (the tiles pad them to a multiple of 64)
    block: int  # A
    nibbles: bool


def prepack(packed: Any, scales: Any, biases: Any, *, bits: int, group_size: int) -> Prepacked:
    """The kernel's layout of a weight given as NumPy arrays (``packed`` uint32 ``(N, W)``,
    ``scales``/``biases`` ``(N, G)``); done once per weight."""
    n, g = scales.shape
    codes = _codes(np.asarray(packed), bits)  # (N, K) int32 in [0, 2**bits)
    k = codes.shape[1]
    a = activation_block(group_size)
    half = 1 << (bits - 1)
    t = -(-n // TILE)
    pad = t * TILE - n
    centred = np.pad(codes - half, ((0, pad), (0, 0)))  # (T*64, K): padded rows are zeros
    s = np.pad(np.asarray(scales, np.float32), ((0, pad), (0, 0)))  # (T*64, G)
    b = np.pad(np.asarray(biases, np.float32), ((0, pad), (0, 0))) + np.float32(half) * s
    tiles = centred.reshape(t, TILE, k // a, a).transpose(0, 2, 3, 1)  # (T, J, A, 64)
    nibbles = bits <= 4
    if nibbles:  # rows l and l + 32 in one byte, each nibble the centred code's low 4 bits
        lo, hi = tiles[..., :32] & 15, tiles[..., 32:] & 15
        w = np.ascontiguousarray((lo | (hi << 4)).astype(np.uint8))  # (T, J, A, 32)
    else:
        w = np.ascontiguousarray(tiles.astype(np.int8))  # (T, J, A, 64)

    def per_tile(v: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(v.reshape(t, TILE, g).transpose(0, 2, 1))  # (T, G, 64)

    return Prepacked(w, per_tile(s), per_tile(b), n, a, nibbles)


def activation_block(group_size: int) -> int:
    """``A = min(32, group_size)``: ``ops.quant.int8.activation_block``'s rule, which these
    kernels (a layer below ops) are handed as a weight's group size."""
    return min(32, group_size)


def _codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words ``(N, W)`` -> int32 codes ``(N, W * 32 / bits)``: the little-endian bit
    stream of ``ops.quant.codes`` read through the words' bytes, a slab of rows at a time."""
    n = packed.shape[0]
    by = np.ascontiguousarray(packed).view(np.uint8)  # (N, 4W)
    if bits == 8:
        return by.astype(np.int32)
    out = np.empty((n, by.shape[1] * 8 // bits), np.int32)
    weights = (1 << np.arange(bits, dtype=np.int32))[:, None]  # (bits, 1)
    for r in range(0, n, 1024):  # the bits of 1024 rows at a time: a few MiB
        stream = np.unpackbits(by[r : r + 1024], axis=1, bitorder="little")  # (R, 32W)
        bits3 = stream.reshape(stream.shape[0], -1, bits).astype(np.int32)  # (R, K, bits)
        out[r : r + 1024] = (bits3 @ weights)[..., 0]
    return out


# id(owner) -> (weakref to owner, scales, biases, Prepacked): one repack
# per weight for the calls that do not bind it; an entry goes with its owner (the packed array).
_CACHE: dict[int, tuple[Any, Any, Any, Prepacked]] = {}


def prepacked(owner: Any, scales: Any, biases: Any, build: Callable[[], Prepacked]) -> Prepacked:
    """``build()`` (a :func:`prepack`) for this weight, built once per ``owner`` (the caller's
    packed array: a NumPy array or a torch tensor) and the caller's ``scales``/``biases``."""
    key = id(owner)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is owner and hit[1] is scales and hit[2] is biases:
        return hit[3]
    pre = build()
    if hit is None:
        weakref.finalize(owner, _CACHE.pop, key, None)
    _CACHE[key] = (weakref.ref(owner), scales, biases, pre)
    return pre


def run(pre: Prepacked, x: np.ndarray) -> np.ndarray:
    """``quantized_linear_int8`` of float32 ``x`` ``(M, K)`` (C-contiguous) with a prepacked
    weight: ``(M, N)`` float32."""
    nibbles, bytes_, _ = _kernels()
    kernel = nibbles if pre.nibbles else bytes_
    y: np.ndarray = kernel(pre.w, pre.s, pre.b, x, pre.block, pre.s.shape[1])
    return y if pre.n == y.shape[1] else y[:, : pre.n]


def linear(pre: Prepacked, x: np.ndarray, bias: Any) -> np.ndarray:
    """``quantized_linear_int8`` of NumPy ``x`` ``(N.., K)`` (float16/32) with a prepacked weight
    and a bias (or ``None``): ``(N.., O)`` in x's dtype."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    y = run(pre, np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32))  # (M, O)
    if bias is not None:
        y += np.asarray(bias, dtype=np.float32)
    return y.astype(x.dtype, copy=False).reshape(*lead, pre.n)  # (N.., O)


def q8_values(x: np.ndarray, block: int) -> np.ndarray:
    """The values ``d * xq`` of float32 ``x`` ``(M, K)``'s Q8_0 blocks (the codes and scales the
    kernel forms), float32: a prompt's rows for a dense product.

    ``q8_values(x) @ dequantize(w).T`` is the int8 mode's product in exact arithmetic (the
    activations are the same 8-bit blocks); in float32 each ``d * xq`` is rounded once and the
    products are summed in float32 instead of in integers, a difference within float32's
    accumulation tolerance (tested against the portable path). A GEMM over the dequantized
    weight beats the integer kernel at many rows (it reads the weight once per row of tiles).
    """
    quantize = _quantize()
    xq, d, _ = quantize(x, block)
    m, k = xq.shape
    out: np.ndarray = (xq.reshape(m, -1, block) * d[:, :, None]).reshape(m, k)  # float32
    return out


@cache
def _quantize() -> Any:
    return _kernels()[2]


@cache
def _kernels() -> tuple[Any, Any, Any]:
    from portable_llm.native import numba_kernels

    return numba_kernels.nibbles, numba_kernels.bytes_, numba_kernels.quantize
