"""MXFP4 weights from files: a transformers gpt-oss checkpoint's ``*_blocks``/``*_scales`` pairs
and a GGUF file's ``MXFP4`` tensors (ggml's block type 39), as
:class:`~portable_llm.MXFP4Weight` (kept quantized).

The two layouts of one block of 32 weights, codes ``c_0 .. c_31`` and exponent ``e``:

========================  ==============================================================
transformers (gpt-oss)    ``*_blocks`` ``(.., N, K / 32, 16)`` uint8: byte ``j`` holds ``c_2j``
                          (low nibble) and ``c_2j+1`` (high); ``*_scales`` ``(.., N, K / 32)``
                          uint8 ``e``. The bytes are MXFP4Weight's words as they are.
ggml ``MXFP4`` (GGUF)     17 bytes: ``e``, then 16 bytes; byte ``j`` holds ``c_j`` (low
                          nibble) and ``c_j+16`` (high). ggml writes the values doubled
                          (``0, 1, 2, 3, 4, 6, 8, 12``) with half the scale: the same weights.
========================  ==============================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.backends import get_backend
from portable_llm.checkpoint.files import CheckpointError
from portable_llm.checkpoint.gguf_blocks import BLOCK_SIZES
from portable_llm.checkpoint.gguf_header import read_gguf_header
from portable_llm.ops.quant.mxfp4 import BLOCK, MXFP4Weight

__all__ = ["mxfp4_from_blocks", "mxfp4_from_ggml", "read_gguf_mxfp4"]


def _weight(words: np.ndarray, e: np.ndarray, dtype: str, backend: Any, device: Any) -> Any:
    bk = get_backend(backend)
    arrays = (bk.from_numpy(np.ascontiguousarray(a), device) for a in (words, e))
    return MXFP4Weight(*arrays, dtype=dtype)


def mxfp4_from_blocks(
    blocks: Any, scales: Any, /, *, dtype: str = "float32", backend: Any = "numpy",
    device: Any = None,
) -> MXFP4Weight:  # fmt: skip
    """A transformers MXFP4 pair (gpt-oss's ``mlp.experts.gate_up_proj_blocks`` and
    ``_scales``, ``down_proj_*``) as an :class:`~portable_llm.MXFP4Weight`.

    Parameters
    ----------
    blocks : uint8 array (NumPy, or anything ``np.asarray`` reads), shape ``(.., N, K / 32, 16)``
    scales : uint8 array, shape ``(.., N, K / 32)``
        gpt-oss stores each expert's projection as ``(X, N, K)`` rows (``gate_up_proj``: ``N =
        2 I`` rows, gate and up interleaved; ``down_proj``: ``N = E``), the layout of
        :func:`~portable_llm.moe`'s experts; transformers transposes it after dequantizing.
    dtype, backend, device
        The weight's float dtype, and where its arrays go.

    Returns
    -------
    MXFP4Weight, shape ``(.., N, K)``
    """
    b, s = np.asarray(blocks), np.asarray(scales)
    op = "mxfp4_from_blocks"
    if b.dtype != np.uint8 or s.dtype != np.uint8:
        raise TypeError(f"{op}: blocks and scales must be uint8, got {b.dtype} and {s.dtype}")
    if b.ndim < 3 or b.shape[-1] != BLOCK // 2 or b.shape[:-1] != s.shape:
        raise ValueError(
            f"{op}: blocks must have shape (.., N, K/32, 16) and scales (.., N, K/32), got "
            f"{b.shape} and {s.shape}"
        )
    words = np.ascontiguousarray(b).reshape(*b.shape[:-2], -1).view("<u4")  # (.., N, K / 8)
    return _weight(words, s, dtype, backend, device)


def mxfp4_from_ggml(
    data: Any, shape: tuple[int, ...], /, *, dtype: str = "float32", backend: Any = "numpy",
    device: Any = None,
) -> MXFP4Weight:  # fmt: skip
    """ggml ``MXFP4`` blocks (17 bytes per 32 weights) of a weight of ``shape`` ``(.., N, K)``
    (row-major, ``K`` innermost) as an :class:`~portable_llm.MXFP4Weight`: the nibbles are
    reordered into the words' layout, the exponents taken as they are (no float on the way)."""
    raw = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(-1)
    per, nbytes = BLOCK_SIZES["MXFP4"]
    n = int(np.prod(shape))
    if len(shape) < 2 or shape[-1] % per or raw.size != n // per * nbytes:
        raise ValueError(
            f"mxfp4_from_ggml: {raw.size} bytes do not hold a weight of shape {tuple(shape)} in "
            f"blocks of {per} ({nbytes} bytes each), K a multiple of {per}"
        )
    blocks = raw.reshape(-1, nbytes)
    qs = blocks[:, 1:]  # (n, 16): c_j low, c_j+16 high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (n, 32), in order
    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)  # (n, 16): c_2j low, c_2j+1 high
    words = pairs.reshape(*shape[:-1], -1).view("<u4")  # (.., N, K / 8)
    return _weight(words, blocks[:, 0].reshape(*shape[:-1], -1), dtype, backend, device)


def read_gguf_mxfp4(
    path: str | Path, name: str, /, *, dtype: str = "float32", backend: Any = "numpy",
    device: Any = None,
) -> MXFP4Weight:  # fmt: skip
    """Tensor ``name`` of a GGUF file, of ggml type ``MXFP4``, as an
    :class:`~portable_llm.MXFP4Weight` (its shape in row-major order, ggml's ``ne`` reversed).

    Raises
    ------
    CheckpointError
        No such tensor, another type, or bytes that do not fit its shape.
    """
    file = Path(path)
    tensors = read_gguf_header(file).tensors
    if name not in tensors:
        raise CheckpointError(f"load: {str(file)!r} has no tensor {name!r}")
    t = tensors[name]
    if t.kind != "MXFP4":
        raise CheckpointError(f"load: {str(file)!r}: tensor {name} has GGUF type {t.kind}, "
                              "not MXFP4")  # fmt: skip
    try:
        return mxfp4_from_ggml(t.data, tuple(reversed(t.shape)), dtype=dtype, backend=backend,
                               device=device)  # fmt: skip
    except ValueError as exc:
        raise CheckpointError(f"load: {str(file)!r}: tensor {name}: {exc}") from None
