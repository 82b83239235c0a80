"""The public quantized ops: ``quantize``, ``dequantize``, ``quantized_linear``, and what the
other ops and the loaders call when handed a :class:`QuantizedWeight` (``quantized_embedding``,
``fastest_form``, ``dequantized``). Each validates, then picks a kernel by name
(:mod:`portable_llm.ops.quant.kernels`, :mod:`portable_llm.ops.quant.int8`, ``native/``).
"""

from __future__ import annotations

from typing import Any

from portable_llm.backends import Backend, resolve
from portable_llm.core.checks import check_float, check_ndim
from portable_llm.core.dispatch import pick
from portable_llm.ops.quant import kernels  # noqa: F401  (its kernels register on import)
from portable_llm.ops.quant.format import QuantizedWeight, check_format, k_unit
from portable_llm.ops.quant.int8 import projection_op  # (and int8's kernel)
from portable_llm.ops.quant.mxfp4 import DEQUANTIZE, LINEAR, MXFP4Weight
from portable_llm.ops.quant.policy import device_kind, keeps_codes

__all__ = [
    "dequantize",
    "dequantized",
    "fastest_form",
    "quantize",
    "quantized_embedding",
    "quantized_linear",
]


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
    bits, group_size = check_format(op, bits, group_size)
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


def _check_qw(op: str, name: str, qw: Any, mxfp4: bool = False) -> Any:
    kinds = (QuantizedWeight, MXFP4Weight) if mxfp4 else QuantizedWeight
    if not isinstance(qw, kinds):
        what = "a QuantizedWeight or an MXFP4Weight" if mxfp4 else "a QuantizedWeight"
        raise TypeError(f"{op}: {name} must be {what}, got {type(qw).__name__}")
    return qw


def dequantize(qw: QuantizedWeight | MXFP4Weight, /, *, impl: str = "auto") -> Any:
    """The float weight of a :class:`QuantizedWeight` (``scales * q + biases``) or an
    :class:`~portable_llm.MXFP4Weight` (``FP4_E2M1[code] * 2 ** (e - 127)``).

    Affine: computed as ``mx.dequantize`` does: the codes cast to the scales' dtype, multiplied
    by the scale, then the bias added, each step rounded to that dtype (equal to
    ``mx.dequantize`` on every backend, tested). MXFP4: each value and scale exact in float32
    (float64 for float64), the product rounded once to qw's dtype.

    Parameters
    ----------
    qw : QuantizedWeight or MXFP4Weight, shape ``(.., N, K)``
    impl : {"auto", "portable", "native"}

    Returns
    -------
    array, shape ``(.., N, K)``, qw's dtype, of qw's backend
    """
    qw = _check_qw("dequantize", "qw", qw, mxfp4=True)
    if isinstance(qw, MXFP4Weight):
        bk, fmt = qw.backend, {"dtype": qw.dtype}
        return pick(bk, DEQUANTIZE, impl, *qw.arrays, **fmt)(bk.xp, *qw.arrays, **fmt)
    bk, opts = qw.backend, {"bits": qw.bits, "group_size": qw.group_size}
    return pick(bk, "dequantize", impl, *qw.arrays, **opts)(bk.xp, *qw.arrays, **opts)


# Over 80 lines for its docstring (each impl and mode of each backend); the body is the usual
# front: checks, then one pick.
def quantized_linear(
    x: Any,
    qw: QuantizedWeight | MXFP4Weight,
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
    (:mod:`portable_llm.ops.quant.int8`): a product judged by the KL divergence of a model's
    token distributions (:func:`~portable_llm.perplexity`), not element by element.

    The dequantized weight (qw's dtype) is cast to x's dtype when they differ (the one
    mixed-precision rule of the weights), then multiplied as :func:`~portable_llm.linear` does.

    Parameters
    ----------
    x : array, shape ``(N.., I)``, float dtype
    qw : QuantizedWeight or MXFP4Weight, shape ``(O, I)``
        An MXFP4Weight takes ``activations="float"``; ``impl`` ``native`` is
        ``mx.quantized_matmul(mode="mxfp4")`` on MLX, ``portable`` dequantizes to x's dtype and
        multiplies (one compiled program on JAX).
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
    qw = _check_qw(op, "qw", qw, mxfp4=True)
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
    if isinstance(qw, MXFP4Weight):
        if activations != "float":
            raise ValueError(f"{op}: an MXFP4Weight takes activations='float' only, got "
                             f"{activations!r}")  # fmt: skip
        p, s = qw.arrays
        return pick(bk, LINEAR, impl, x, p, s, bias)(bk.xp, x, p, s, bias)
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
    """``w`` as floats: :func:`dequantize` for a :class:`QuantizedWeight` or an
    :class:`~portable_llm.MXFP4Weight`, else ``w``."""
    return dequantize(w) if isinstance(w, QuantizedWeight | MXFP4Weight) else w
