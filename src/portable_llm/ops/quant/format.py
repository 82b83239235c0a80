"""The weight format: MLX's affine quantization (``QuantizedWeight``, ``BITS``, ``GROUP_SIZES``).

The format (MLX's ``mx.quantize(mode="affine")``, mlx-lm's 4-bit checkpoints): a weight ``W`` of
shape ``(N, K)`` is cut along K into groups of ``group_size``; each group ``g`` of row ``n`` has a
float ``scales[n, g]`` and ``biases[n, g]`` and each element a ``bits``-bit code ``q``, so that
``W[n, k] ~= scales[n, k // group_size] * q[n, k] + biases[n, k // group_size]``. The codes of a
row are one little-endian bit stream packed into uint32 words (:mod:`portable_llm.ops.quant.codes`;
the layout is drawn in ``docs/ops/quantization.md``).
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.backends import Backend, backend_of, get_backend, resolve
from portable_llm.core.checks import check_float, check_int, check_ndim
from portable_llm.ops.quant.mxfp4 import MXFP4Weight

__all__ = ["BITS", "GROUP_SIZES", "QuantizedWeight", "check_format", "is_quantized", "k_unit"]

#: The code widths MLX's affine format supports.
BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
#: The group sizes of the format: MLX's 32, 64 and 128, and 16 (llama.cpp's Q6_K, an int8 scale
#: per 16 weights, kept exactly). MLX's kernels take groups of 32 to 128 only: a group of 16
#: runs the portable paths on MLX (and every backend's kernel that needs 32 or more).
GROUP_SIZES: tuple[int, ...] = (16, 32, 64, 128)


def k_unit(bits: int, group_size: int) -> int:
    """What K (and any split of a weight's columns) must be a multiple of.

    Whole groups, and for 3, 5 and 6 bits whole blocks of 32 codes (a block fills ``bits``
    words: the packing works block by block, and a split inside one would cut a word).

    Parameters
    ----------
    bits : int
    group_size : int

    Returns
    -------
    int
        ``group_size``, or ``lcm(group_size, 32)`` for 3, 5 and 6 bits (32 for 6 bits in
        groups of 16).
    """
    return group_size if 32 % bits == 0 else math.lcm(group_size, 32)


def check_format(op: str, bits: Any, group_size: Any) -> tuple[int, int]:
    """``(bits, group_size)`` as ints, or the error of ``op`` naming the one outside the format."""
    bits = check_int(op, "bits", bits)
    group_size = check_int(op, "group_size", group_size)
    if bits not in BITS:
        raise ValueError(f"{op}: bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{op}: group_size must be one of {GROUP_SIZES}, got {group_size}")
    return bits, group_size


class QuantizedWeight:
    """A weight of shape ``(.., N, K)`` in MLX's affine quantized format.

    Parameters
    ----------
    packed : array, shape ``(.., N, K * bits / 32)``, uint32
        The codes, ``32 / bits`` per word for 2/4/8 bits, a continuous little-endian bit stream
        for 3/5/6 bits (see the module docstring).
    scales, biases : array, shape ``(.., N, K / group_size)``, one float dtype
        ``w = scales * q + biases`` per group.
    bits : {2, 3, 4, 5, 6, 8}
    group_size : {16, 32, 64, 128}

    Attributes
    ----------
    shape : tuple of int
        ``(.., N, K)``, the dequantized weight's shape.
    dtype
        The dtype of ``scales`` (and of the dequantized weight).
    bits, group_size : int
    backend : Backend
        The library of the three arrays.

    Raises
    ------
    ValueError
        bits or group_size outside the sets above, or shapes that disagree.
    TypeError
        packed not uint32, scales/biases not float or of two dtypes, arrays of two libraries.
    """

    __slots__ = ("backend", "biases", "bits", "group_size", "packed", "scales", "shape")

    def __init__(self, packed: Any, scales: Any, biases: Any, /, *, bits: int, group_size: int):
        op = "QuantizedWeight"
        bits, group_size = check_format(op, bits, group_size)
        bk, (packed, scales, biases) = resolve(op, None, packed, scales, biases)
        for name, a in (("packed", packed), ("scales", scales), ("biases", biases)):
            if backend_of(a) is not bk:
                raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}")
        if bk.dtype_name(packed.dtype) != "uint32":
            raise TypeError(
                f"{op}: packed must have dtype uint32, got {bk.dtype_name(packed.dtype)} with "
                f"shape {tuple(packed.shape)}"
            )
        check_float(op, "scales", scales, bk)
        if biases.dtype != scales.dtype:
            raise TypeError(
                f"{op}: biases must have the dtype of scales ({bk.dtype_name(scales.dtype)}), "
                f"got {bk.dtype_name(biases.dtype)}"
            )
        check_ndim(op, "packed", packed, 2, ".. x N x K*bits/32")
        lead, words = tuple(packed.shape[:-1]), packed.shape[-1]
        k, unit = words * 32 // bits, k_unit(bits, group_size)
        if (words * 32) % bits or k % unit:
            raise ValueError(
                f"{op}: packed has shape {tuple(packed.shape)}: its last dimension times 32 must "
                f"be a multiple of bits * {unit} = {bits * unit} (bits={bits}, "
                f"group_size={group_size})"
            )
        expected = (*lead, k // group_size)
        for name, a in (("scales", scales), ("biases", biases)):
            if tuple(a.shape) != expected:
                raise ValueError(
                    f"{op}: {name} must have shape {expected} (.. x N x K/group_size, K = {k}) to "
                    f"match packed of shape {tuple(packed.shape)} with bits={bits}, "
                    f"group_size={group_size}; got {tuple(a.shape)}"
                )
        self.packed, self.scales, self.biases = packed, scales, biases
        self.bits, self.group_size = bits, group_size
        self.shape: tuple[int, ...] = (*lead, k)
        self.backend: Backend = bk

    @property
    def dtype(self) -> Any:
        """The dtype of ``scales``: that of the dequantized weight."""
        return self.scales.dtype

    @property
    def device(self) -> Any:
        """The device of the arrays (the backend's device object)."""
        return self.backend.device_of(self.scales)

    def devices(self) -> Any:
        """``scales.devices()``: ``Backend.device_of`` reads a JAX array's device this way, so
        it reads a QuantizedWeight's too (``device`` serves the other libraries)."""
        return self.scales.devices()

    @property
    def sharding(self) -> Any:
        """``scales.sharding``: how a JAX weight over several devices (a partitioned model's)
        is placed, which ``Backend.device_of`` reads as it reads ``devices()``."""
        return self.scales.sharding

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays."""
        return sum(math.prod(a.shape) * _itemsize(self.backend, a) for a in self.arrays)

    @property
    def arrays(self) -> tuple[Any, Any, Any]:
        """``(packed, scales, biases)``."""
        return self.packed, self.scales, self.biases

    def __getitem__(self, index: Any) -> QuantizedWeight:
        """Index the leading axes (e.g. one expert of a stacked ``(X, N, K)`` weight)."""
        if not isinstance(index, int | slice):
            raise TypeError("QuantizedWeight: only an int or a slice indexes the leading axis")
        if len(self.shape) < 3 and not isinstance(index, slice):
            raise IndexError("QuantizedWeight: a 2-D weight has no leading axis to index")
        return QuantizedWeight(
            self.packed[index, ...],
            self.scales[index, ...],
            self.biases[index, ...],
            bits=self.bits,
            group_size=self.group_size,
        )

    def to(self, backend: str | Backend, device: Any = None) -> QuantizedWeight:
        """The same weight as arrays of ``backend`` (on ``device``)."""
        bk = get_backend(backend)
        conv = [
            a if (self.backend is bk and device is None) else bk.convert(a, self.backend, device)
            for a in self.arrays
        ]
        return QuantizedWeight(*conv, bits=self.bits, group_size=self.group_size)

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight(shape={self.shape}, bits={self.bits}, group_size={self.group_size}, "
            f"dtype={self.backend.dtype_name(self.dtype)}, backend={self.backend.name!r})"
        )


def _itemsize(bk: Backend, a: Any) -> int:
    name = bk.dtype_name(a.dtype)
    return {"float16": 2, "bfloat16": 2, "float64": 8}.get(name, 4)


# -- the portable implementations ---------------------------------------------------------------


def is_quantized(*weights: Any) -> bool:
    """Whether any of ``weights`` is a :class:`QuantizedWeight` or an
    :class:`~portable_llm.ops.quant.mxfp4.MXFP4Weight`."""
    return any(isinstance(w, QuantizedWeight | MXFP4Weight) for w in weights)
