"""Quantized weights in MLX's affine format: ``QuantizedWeight``, ``quantize``, ``dequantize``,
``quantized_linear``.

The format (MLX's ``mx.quantize(mode="affine")``, mlx-lm's 4-bit checkpoints): a weight ``W`` of
shape ``(N, K)`` is cut along K into groups of ``group_size``; each group ``g`` of row ``n`` has a
float ``scales[n, g]`` and ``biases[n, g]`` and each element a ``bits``-bit code ``q``, so that
``W[n, k] ~= scales[n, k // group_size] * q[n, k] + biases[n, k // group_size]``. The codes of a
row are one little-endian bit stream: code ``k`` occupies bits ``bits*k .. bits*k + bits - 1``,
and stream bit ``b`` is bit ``b % 32`` of ``packed[n, b // 32]`` (uint32). For 2, 4 and 8 bits a
code never straddles two words; for 3, 5 and 6 bits some do (e.g. 3-bit code 10 takes bits 30-31
of word 0 and bit 0 of word 1). The layout is drawn in ``docs/ops/quantization.md``.

The portable code unpacks with shifts and masks on int32 (the uint32 words reinterpreted: every
library wraps the conversion, and torch has no shifts on uint32); the codes are exact whatever the
sign of the int32.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.backends import Backend, backend_of, get_backend, resolve
from portable_llm.core.checks import check_float, check_int, check_ndim, float_compute_dtype
from portable_llm.core.dispatch import auto_portable, pick, portable
from portable_llm.ops.affine import affine
from portable_llm.ops.quant_codes import exact_divide, pack_codes, unpack_codes
from portable_llm.ops.quant_int8 import projection_op

__all__ = [
    "BITS",
    "GROUP_SIZES",
    "KEEP_CODES_FROM",
    "QuantizedWeight",
    "dequantize",
    "device_kind",
    "fastest_form",
    "k_unit",
    "keeps_codes",
    "quantize",
    "quantized_linear",
]

#: The code widths MLX's affine format supports.
BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
#: The group sizes of the format: MLX's 32, 64 and 128, and 16 (llama.cpp's Q6_K, an int8 scale
#: per 16 weights, kept exactly). MLX's kernels take groups of 32 to 128 only: a group of 16
#: runs the portable paths on MLX (and every backend's kernel that needs 32 or more).
GROUP_SIZES: tuple[int, ...] = (16, 32, 64, 128)
#: MLX's floor on a group's step (``float eps = 1e-7``), so a constant group does not divide by 0.
_EPS = 1e-7


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


def _check_format(op: str, bits: Any, group_size: Any) -> tuple[int, int]:
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
        bits, group_size = _check_format(op, bits, group_size)
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


# -- the public ops -----------------------------------------------------------------------------


def quantize(
    w: Any,
    /,
    *,
    bits: int = 4,
    group_size: int = 64,
    impl: str = "auto",
    backend: str | None = None,
) -> QuantizedWeight:
    """Quantize a weight to MLX's affine format.

    Per group of ``group_size`` along the last axis, in float32 (MLX's algorithm): the step is
    ``s = max((max - min) / (2**bits - 1), 1e-7)``, signed and adjusted so that the endpoint of
    larger magnitude (``edge``) is an exact multiple ``q0 * s``; ``bias = edge`` (0 when
    ``q0 == 0``); codes ``q = clip(round((w - bias) / s), 0, 2**bits - 1)``, rounding half to
    even. Scales and biases are then rounded to w's dtype.

    Parameters
    ----------
    w : array, shape ``(.., N, K)``, float dtype, K a multiple of ``group_size`` (and of 32
        for 3, 5 and 6 bits)
    bits : {2, 3, 4, 5, 6, 8}
    group_size : {16, 32, 64, 128}
    impl : {"auto", "portable", "native"}
        On MLX ``auto`` is ``mx.quantize`` (bit-identical to the portable path, tested) for
        groups of 32 to 128; a group of 16 runs the portable path there.
    backend : str, optional

    Returns
    -------
    QuantizedWeight
        ``dequantize(quantize(w))`` is within one step (``|scale|``) of ``w`` per element, and
        within half a step (``|scale| / 2``) where the code is strictly inside
        ``(0, 2**bits - 1)``, plus the rounding of scales and biases to w's dtype. A whole step
        is reached: anchoring the group's larger end moves the step (``s = edge / q0``), and
        the far end's code, clipped to ``2**bits - 1``, can then miss it by up to one step
        (exactly one at 2 bits for ``w = [-1.5, 1.5]``: ``s = -0.75``).

    Raises
    ------
    ValueError
        ``w`` holds a NaN or an infinity (on every backend and ``impl``: one rule, where MLX's
        own kernel and the portable formula would disagree).
    """
    op = "quantize"
    bits, group_size = _check_format(op, bits, group_size)
    bk, (w,) = resolve(op, backend, w)
    check_float(op, "w", w, bk)
    check_ndim(op, "w", w, 2, ".. x N x K")
    unit = k_unit(bits, group_size)
    if w.shape[-1] % unit:
        what = f"group_size={group_size}"
        if unit != group_size:
            what = f"{unit} ({what}, in whole blocks of 32 codes at bits={bits})"
        raise ValueError(
            f"{op}: the last dimension of w (shape {tuple(w.shape)}) must be a multiple of {what}"
        )
    if not bool(bk.xp.all(bk.xp.isfinite(w))):  # the one NaN rule, on every backend
        raise ValueError(
            f"{op}: w (shape {tuple(w.shape)}) holds NaN or infinite values; only finite "
            "weights are quantized (MLX's kernel would map a NaN to a number, the portable "
            "path would make its whole group NaN)"
        )
    packed, scales, biases = pick(bk, op, impl, w, bits=bits, group_size=group_size)(
        bk.xp, w, bits=bits, group_size=group_size
    )
    return QuantizedWeight(packed, scales, biases, bits=bits, group_size=group_size)


def _check_qw(op: str, name: str, qw: Any) -> QuantizedWeight:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{op}: {name} must be a QuantizedWeight, got {type(qw).__name__}")
    return qw


def dequantize(qw: QuantizedWeight, /, *, impl: str = "auto") -> Any:
    """The float weight ``scales * q + biases`` of a :class:`QuantizedWeight`.

    Computed as ``mx.dequantize`` does: the codes cast to the scales' dtype, multiplied by the
    scale, then the bias added, each step rounded to that dtype (equal to ``mx.dequantize`` on
    every backend, tested).

    Parameters
    ----------
    qw : QuantizedWeight, shape ``(.., N, K)``
    impl : {"auto", "portable", "native"}

    Returns
    -------
    array, shape ``(.., N, K)``, qw's dtype, of qw's backend
    """
    qw = _check_qw("dequantize", "qw", qw)
    bk, opts = qw.backend, {"bits": qw.bits, "group_size": qw.group_size}
    return pick(bk, "dequantize", impl, *qw.arrays, **opts)(bk.xp, *qw.arrays, **opts)


def quantized_linear(
    x: Any,
    qw: QuantizedWeight,
    bias: Any = None,
    /,
    *,
    activations: str = "float",
    impl: str = "auto",
    backend: str | Backend | None = None,
) -> Any:
    """``x @ dequantize(qw).T + bias``, accumulated in float32, returned in x's dtype.

    With ``activations="int8"`` the rows of x are rounded to 8 bits per block of 32 first, as
    llama.cpp's Q8_0 blocks, and multiplied by the codes in integers
    (:mod:`portable_llm.ops.quant_int8`): a product judged by the KL divergence of a model's
    token distributions (:func:`~portable_llm.perplexity`), not element by element.

    The dequantized weight (qw's dtype) is cast to x's dtype when they differ (the one
    mixed-precision rule of the weights), then multiplied as :func:`~portable_llm.linear` does.

    Parameters
    ----------
    x : array, shape ``(N.., I)``, float dtype
    qw : QuantizedWeight, shape ``(O, I)``
    bias : array, shape ``(O,)``, optional
        Cast to x's dtype when it differs.
    activations : {"float", "int8"}
        ``float`` (default): the exact product above. ``int8``: x in Q8_0 blocks (``max|x| /
        127`` per block of ``min(32, group_size)`` values) times the codes, summed in integers,
        scaled back in float32; ``impl`` then picks among ``quantized_linear_int8``'s paths
        (``portable``; ``native``: the numba kernel on NumPy and torch's CPU, where installed).
    impl : {"auto", "portable", "grouped", "native"}
        ``native``: ``mx.quantized_matmul`` on MLX; on torch CPU,
        ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (4-bit, bfloat16),
        ``_weight_int8pack_mm`` once per group (8-bit) or the codes read as bytes (see the docs
        for which of them ``auto`` takes). ``portable`` dequantizes and multiplies (JAX: in one
        jitted function, which XLA fuses); ``grouped`` sums ``scales * (x_g . q_g) + biases *
        sum(x_g)`` per group without the dequantized weight (``auto``'s portable choice for at
        most ``group_size / 4`` rows with float32/float64 x and scales, where x is not traced:
        under ``jax.jit`` ``auto`` dequantizes, which XLA fuses into the product).
    backend : str, optional
        Inferred from x and qw when ``None`` (arrays of two libraries are a TypeError); when given,
        x, qw and bias are converted to it.

    Returns
    -------
    array, shape ``(N.., O)``, x's dtype
    """
    op = "quantized_linear"
    qw = _check_qw(op, "qw", qw)
    bk, (x, bias) = resolve(op, backend, x, bias)
    if qw.backend is not bk:
        if backend is None:
            raise TypeError(
                f"{op}: got arrays from two libraries, {bk.name} (x) and {qw.backend.name} (qw); "
                "pass backend='...' to convert them to one"
            )
        qw = qw.to(bk, bk.device_of(x))
    check_float(op, "x", x, bk)
    check_ndim(op, "x", x, 1, "N.. x I")
    if len(qw.shape) != 2 or qw.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{op}: qw must have shape (O, {x.shape[-1]}) (O x I) to match x of shape "
            f"{tuple(x.shape)}, got {qw.shape}"
        )
    if bias is not None:
        check_float(op, "bias", bias, bk)
        if tuple(bias.shape) != (qw.shape[0],):
            raise ValueError(
                f"{op}: bias must have shape ({qw.shape[0]},) to match qw of shape {qw.shape}, "
                f"got {tuple(bias.shape)}"
            )
        if bias.dtype != x.dtype:
            bias = bk.astype(bias, x.dtype)
    p, s, b = qw.arrays
    opts = {"bits": qw.bits, "group_size": qw.group_size}
    if activations != "float":
        op = projection_op(activations, op)
    return pick(bk, op, impl, x, p, s, b, bias, **opts)(bk.xp, x, p, s, b, bias, **opts)


def quantized_embedding(ids: Any, qw: QuantizedWeight, bk: Backend) -> Any:
    """Rows ``ids`` (an index dtype, already range-checked) of a quantized table, dequantized.

    Used by :func:`~portable_llm.embedding`; only the gathered rows are dequantized.
    """
    opts = {"bits": qw.bits, "group_size": qw.group_size}
    fn = pick(bk, "quantized_embedding", "portable", ids, *qw.arrays, **opts)
    return fn(bk.xp, ids, *qw.arrays, **opts)


# -- QuantizedWeight in the other ops (each calls one of these when handed one) -----------------


def is_quantized(*weights: Any) -> bool:
    """Whether any of ``weights`` is a :class:`QuantizedWeight`."""
    return any(isinstance(w, QuantizedWeight) for w in weights)


# -- the measured rule: keep the codes or multiply the dequantized floats ----------------------

#: ``(backend, device kind, dtype, bits) -> N``: from ``N`` output rows on, a decode projection
#: (one row of x, ``impl="auto"``) kept quantized is at least as fast as the dense matmul of its
#: dequantized weight; a combination absent here never is (its quantized path is no faster than
#: dequantize-then-matmul, e.g. NumPy (native/numpy.py's blocks: 0.5-0.8x per projection
#: streamed from memory, 0.5-0.7x over SmolLM2's whole decode), array-api-strict, JAX
#: bfloat16, torch float32 on a CPU, CUDA). Measured by ``benchmarks/quant_rule.py`` per
#: projection and ``benchmarks/quant_decode.py`` over a whole decode (one thread, interleaved
#: rounds, medians; the figures and the load are in ``benchmarks/README.md``) at SmolLM2-135M's
#: shapes, group 32.
KEEP_CODES_FROM: dict[tuple[str, str, str, int], int] = {
    # torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu): 1.1-1.7x the dense bfloat16 GEMV,
    # 8.4x on the 49152-row LM head; 2 and 3 bits run it as 4
    ("torch", "cpu", "bfloat16", 2): 0,
    ("torch", "cpu", "bfloat16", 3): 0,
    ("torch", "cpu", "bfloat16", 4): 0,
    # 5 to 8 bits: the same kernel on two nibble planes. One projection with its weight in
    # cache: 0.73-1.0x the dense GEMV, 1.8-1.9x on the LM head; SmolLM2 Q8_0's whole decode
    # (weights streamed from memory, as in every real model) kept quantized: 1.6x its floats
    ("torch", "cpu", "bfloat16", 5): 0,
    ("torch", "cpu", "bfloat16", 6): 0,
    ("torch", "cpu", "bfloat16", 8): 0,
    # torch float32: none. No torch CPU kernel multiplies group-wise codes by float32
    # activations at the dense GEMV's speed (the int4/int8 kernels' float32 loops are scalar on
    # x86: 2-5x slower than the dense floats; benchmarks/README.md, issue 21).
    # JAX float32: native/jax.py's jitted kernel (the codes unpacked and scaled in float32
    # inside the product's XLA computation). SmolLM2 Q4_1 (4-bit layers, Q8_0 head), whole
    # compiled decode with every matrix kept: 1.38x, 1.10x, 1.04x its floats in three runs
    # (load 5-11);
    # per projection the ratios do not compose (the first rule kept only the head: 0.75-0.91x).
    # bfloat16: 0.19x (5.4 against 28.6 tok/s): none.
    ("jax", "cpu", "float32", 4): 0,
    ("jax", "cpu", "float32", 8): 0,
    # mx.quantized_matmul on a CPU: none. float32 per projection 0.96-1.5x (4 and 8 bits, noisy:
    # MLX runs several threads), but SmolLM2 Q4_1's whole decode kept ran 0.75x and 0.86x its
    # floats in two runs (load 10-14; the 4-bit layers alone kept: 0.86x); bfloat16 0.04-0.16x
    # (at float32 through native/mlx.py: 0.75-1.3x, with a weight not rounded as dequantize's)
    # mx.quantized_matmul on Metal: mlx-lm's own decode path (not measured on this machine)
    ("mlx", "gpu", "float32", 4): 0,
    ("mlx", "gpu", "float32", 8): 0,
    ("mlx", "gpu", "bfloat16", 4): 0,
    ("mlx", "gpu", "bfloat16", 8): 0,
    ("mlx", "gpu", "float16", 4): 0,
    ("mlx", "gpu", "float16", 8): 0,
}


def device_kind(bk: Backend, x: Any) -> str:
    """``"cpu"`` or ``"gpu"`` (CUDA, Metal, MPS): where the array ``x`` of ``bk`` computes."""
    dev = x.device if isinstance(x, QuantizedWeight) else bk.device_of(x)
    text = str(getattr(dev, "type", None) or getattr(dev, "platform", None) or dev).lower()
    return "cpu" if "cpu" in text else "gpu"


def keeps_codes(
    backend: str | Backend,
    /,
    *,
    device: str,
    dtype: str,
    bits: int,
    rows: int,
    group_size: int = 32,
) -> bool:
    """Whether a weight of ``rows`` output rows, ``bits``-bit codes, multiplied by activations
    of ``dtype`` on ``device`` (``"cpu"``/``"gpu"``), decodes at least as fast kept quantized
    as dequantized (the rule of :data:`KEEP_CODES_FROM`).

    Parameters
    ----------
    backend : str or Backend
    device : {"cpu", "gpu"}
    dtype : str
        The activations' dtype name (``"float32"``, ``"bfloat16"``, ...).
    bits : int
    rows : int
        N of the ``(N, K)`` weight.
    group_size : int, default 32
        Groups of 16 (llama.cpp's Q6_K) are never kept: MLX's kernels and torch's int4 kernel
        take 32 or more, and the paths that take them ran slower than the floats on NumPy,
        torch and MLX (per decode projection: 0.07-0.75x at 8 bits through NumPy's and torch's
        byte paths, 0.01-0.23x at 6 bits through the portable paths; JAX's jitted kernel
        0.72-1.55x at 8 bits, a tie over Gemma 3's whole decode; ``benchmarks/README.md``).

    Returns
    -------
    bool
    """
    name = backend if isinstance(backend, str) else backend.name
    if device not in ("cpu", "gpu"):
        raise ValueError(f"keeps_codes: device must be 'cpu' or 'gpu', got {device!r}")
    start = KEEP_CODES_FROM.get((name, device, dtype, int(bits)))
    return start is not None and int(rows) >= start and int(group_size) >= 32


def fastest_form(qw: QuantizedWeight, /, *, dtype: Any = None) -> Any:
    """``qw`` itself where :func:`keeps_codes` says its codes multiply at least as fast as its
    floats, else ``dequantize(qw)`` (cast to ``dtype``): what ``pl.load(..., dequantize="auto")``
    keeps of each quantized weight.

    Parameters
    ----------
    qw : QuantizedWeight, shape ``(.., N, K)``
    dtype : dtype, optional
        The activations' dtype; default qw's.

    Returns
    -------
    QuantizedWeight or array, shape ``(.., N, K)``
        The array: of ``dtype``, equal to ``dequantize(qw)`` cast to it.
    """
    qw = _check_qw("fastest_form", "qw", qw)
    bk = qw.backend
    dt = qw.dtype if dtype is None else dtype
    name = bk.dtype_name(dt)
    rows = qw.shape[-2] if len(qw.shape) >= 2 else 1
    fmt = {"bits": qw.bits, "rows": rows, "group_size": qw.group_size}
    if keeps_codes(bk, device=device_kind(bk, qw), dtype=name, **fmt):
        return qw
    w = dequantize(qw)
    return w if w.dtype == dt else bk.astype(w, dt)


def dequantized(w: Any) -> Any:
    """``w`` as floats: :func:`dequantize` for a :class:`QuantizedWeight`, else ``w``."""
    return dequantize(w) if isinstance(w, QuantizedWeight) else w
