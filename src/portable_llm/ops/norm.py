"""RMSNorm and LayerNorm."""

from __future__ import annotations

from portable_llm.backends import Backend, resolve, resolve_pair
from portable_llm.core.checks import (
    check_float,
    check_ndim,
    check_real,
    float_compute_dtype,
    match_weight,
)
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace

__all__ = ["layer_norm", "rms_norm"]

_INF = float("inf")


@portable("rms_norm", pure=True)
def _rms_norm(xp: Namespace, x: Array, weight: Array, *, eps: float) -> Array:
    xc = xp.astype(x, float_compute_dtype(xp, x.dtype))
    variance = xp.mean(xc * xc, axis=-1, keepdims=True)  # (N.., 1)
    normed = xc * (1.0 / xp.sqrt(variance + eps))
    # HF Qwen2RMSNorm order: round the normalised value to x's dtype, then scale by the weight.
    if weight is None:  # Llama 4's weightless q/k norm (Llama4TextL2Norm)
        return xp.astype(normed, x.dtype)
    return weight * xp.astype(normed, x.dtype)


@portable("rms_norm_offset", pure=True)
def _rms_norm_offset(xp: Namespace, x: Array, weight: Array, *, eps: float, offset: float) -> Array:
    ct = float_compute_dtype(xp, x.dtype)
    xc = xp.astype(x, ct)
    variance = xp.mean(xc * xc, axis=-1, keepdims=True)  # (N.., 1)
    normed = xc * (1.0 / xp.sqrt(variance + eps))
    # HF GemmaRMSNorm order: the scale (offset + w) and its multiply in float32, one rounding.
    return xp.astype(normed * (offset + xp.astype(weight, ct)), x.dtype)


# Over 80 lines for its docstring (the math, every dtype and backend rule); the code is ~30 lines
# and stays in one piece: one combined test on the hot path, no helper call per norm.
def rms_norm(
    x: Array,
    weight: Array = None,
    /,
    *,
    eps: float = 1e-5,
    offset: float = 0.0,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """RMS normalisation (Llama, Qwen, Mistral): ``weight * x / sqrt(mean(x^2) + eps)``.

    The computation, in this order (HF transformers' ``Qwen2RMSNorm``/``LlamaRMSNorm``):

    1. ``xc = float32(x)`` (float64 stays float64, where HF would drop to float32);
    2. ``normed = xc * (1 / sqrt(mean(xc**2, axis=-1) + eps))``, accumulated in float32;
    3. ``out = weight * normed.astype(x.dtype)`` -- the normalised value is rounded to x's dtype
       *before* the weight multiply, which then happens in x's dtype.

    With ``offset`` (Gemma: ``offset=1.0``, the scale is ``1 + weight``) the order is HF
    ``GemmaRMSNorm``'s instead: ``out = (normed * (offset + float32(weight))).astype(x.dtype)``,
    the scale formed and applied in float32, one rounding.

    Parameters
    ----------
    x : array, shape ``(N.., D)``, float dtype
    weight : array, shape ``(D,)``, float dtype, optional
        Cast to x's dtype when it differs (a float32 weight with bfloat16 activations gives a
        bfloat16 result): the package's mixed-precision rule (docs/mixed-precision.md).
        ``None``: no scale, the normalised value alone (Llama 4's q/k L2 norm); ``offset`` must
        then be 0.
    eps : float, >= 0
        Added to the mean of squares inside the square root.
    offset : float
        Added to the weight to form the scale (Gemma's ``1 + w``); 0 (the default) is Llama's
        norm and its rounding order.
    impl : {"auto", "portable", "native"}
        ``auto`` uses ``mx.fast.rms_norm`` (same rounding order as above) and, for float32 and
        float64, ``torch.nn.functional.rms_norm``. For float16/bfloat16 torch's kernel multiplies
        by the weight before its single rounding (one ulp from HF in about a quarter of the
        elements), so ``auto`` keeps the portable path there; ``impl="native"`` still forces it.
        With an ``offset``, torch's kernel runs on float32 (Gemma's order) for every dtype; the
        other backends run the portable path.
    backend : str, optional
        Array library to compute with; inferred from the arrays when ``None``.

    Returns
    -------
    array, shape ``(N.., D)``, x's dtype
        ``D = 0`` gives the empty result (no mean to take).
    """
    bk, x, weight = resolve_pair("rms_norm", backend, x, weight)
    # One combined test on the hot path (each attribute read once: on torch every read costs
    # ~0.1 us, which the 1.3x dispatch budget of a tiny call notices); the detailed checks only
    # run to word the error. ``weight.shape != shape[-1:]`` covers weight.ndim == 1 as well.
    floats, dtype, shape = bk.float_set, x.dtype, x.shape
    try:  # a try costs nothing in 3.11 unless it raises
        w_dtype = dtype if weight is None else weight.dtype
        bad = (
            dtype not in floats
            or w_dtype not in floats
            or not shape
            or (weight is not None and weight.shape != shape[-1:])
            or not eps >= 0  # also rejects NaN
            or eps.__class__ is bool
            or not shape[-1]
            or offset.__class__ is not float
            or (offset and (weight is None or not -_INF < offset < _INF))  # 0.0: one test
        )
    except (TypeError, AttributeError):  # eps is not a number, weight is not an array
        bad = True
    if bad:  # raises, or D == 0, or an offset given as another number type
        offset = _check_rms_norm(bk, x, weight, eps, offset)
        if not shape or not shape[-1]:
            return (
                x * 1 if weight is None else match_weight("rms_norm", "weight", weight, x, bk) * x
            )
    if w_dtype != dtype:
        weight = match_weight("rms_norm", "weight", weight, x, bk)
    if offset:
        fn = pick(bk, "rms_norm_offset", impl, x, weight, eps=eps, offset=offset)
        return fn(bk.xp, x, weight, eps=eps, offset=offset)
    return pick(bk, "rms_norm", impl, x, weight, eps=eps)(bk.xp, x, weight, eps=eps)


def _check_rms_norm(bk: Backend, x: Array, weight: Array, eps: float, offset: float) -> float:
    """Raise the detailed error of a bad call; the offset as a Python float otherwise."""
    check_float("rms_norm", "x", x, bk)
    check_ndim("rms_norm", "x", x, 1, "N.. x D")
    if weight is not None:
        check_float("rms_norm", "weight", weight, bk)
        if weight.ndim != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"rms_norm: weight must have shape ({x.shape[-1]},) to match the last dimension "
                f"of x (shape {tuple(x.shape)}), got {tuple(weight.shape)}"
            )
    _check_eps("rms_norm", eps)
    offset = check_real("rms_norm", "offset", offset)
    if offset and weight is None:
        raise ValueError(f"rms_norm: offset={offset!r} needs a weight (the scale is offset + w)")
    return offset


# -- LayerNorm ---------------------------------------------------------------------------------


@portable("layer_norm", pure=True)
def _layer_norm(
    xp: Namespace, x: Array, weight: Array = None, bias: Array = None, *, eps: float
) -> Array:
    ct = float_compute_dtype(xp, x.dtype)
    xc = xp.astype(x, ct)
    centred = xc - xp.mean(xc, axis=-1, keepdims=True)  # (N.., D)
    variance = xp.mean(centred * centred, axis=-1, keepdims=True)  # (N.., 1), biased
    y = centred * (1.0 / xp.sqrt(variance + eps))
    # torch.nn.LayerNorm's order: the affine map in float32 too, one rounding at the end.
    if weight is not None:
        y = y * xp.astype(weight, ct)
    if bias is not None:
        y = y + xp.astype(bias, ct)
    return xp.astype(y, x.dtype)


def layer_norm(
    x: Array,
    weight: Array = None,
    bias: Array = None,
    /,
    *,
    eps: float = 1e-5,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """Layer normalisation (GPT-2, Phi-2): ``(x - mean(x)) / sqrt(var(x) + eps) * weight + bias``.

    The computation (``torch.nn.LayerNorm``'s): ``xc = float32(x)`` (float64 stays float64);
    the mean and the biased variance over the last dimension, the normalised value, the weight
    multiply and the bias add, all in float32; one rounding to x's dtype at the end.

    Parameters
    ----------
    x : array, shape ``(N.., D)``, float dtype
    weight : array, shape ``(D,)``, float dtype, optional
        ``None``: no scale (as ``elementwise_affine=False``). Cast to x's dtype when it differs
        (the mixed-precision rule, docs/mixed-precision.md).
    bias : array, shape ``(D,)``, float dtype, optional
        ``None``: no shift (as ``bias=False``). Cast to x's dtype likewise.
    eps : float, >= 0
        Added to the variance inside the square root.
    impl : {"auto", "portable", "native"}
        ``auto`` uses ``torch.nn.functional.layer_norm`` and, below float64,
        ``mx.fast.layer_norm``; JAX runs the portable path under ``jax.jit``.
    backend : str, optional
        Array library to compute with; inferred from the arrays when ``None``.

    Returns
    -------
    array, shape ``(N.., D)``, x's dtype
        ``D = 0`` gives the empty result.
    """
    bk, (x, weight, bias) = resolve("layer_norm", backend, x, weight, bias)
    floats, dtype, shape = bk.float_set, x.dtype, x.shape
    try:
        bad = (
            dtype not in floats
            or not shape
            or not shape[-1]
            or not eps >= 0  # also rejects NaN
            or eps.__class__ is bool
            or (weight is not None and (weight.dtype not in floats or weight.shape != shape[-1:]))
            or (bias is not None and (bias.dtype not in floats or bias.shape != shape[-1:]))
        )
    except TypeError:  # eps is not a number
        bad = True
    if bad:  # raises, or D == 0: the empty result
        return _layer_norm_slow_path(bk, x, weight, bias, eps)
    if weight is not None and weight.dtype != dtype:
        weight = match_weight("layer_norm", "weight", weight, x, bk)
    if bias is not None and bias.dtype != dtype:
        bias = match_weight("layer_norm", "bias", bias, x, bk)
    fn = pick(bk, "layer_norm", impl, x, weight, bias, eps=eps)
    return fn(bk.xp, x, weight, bias, eps=eps)


def _layer_norm_slow_path(bk: Backend, x: Array, weight: Array, bias: Array, eps: float) -> Array:
    op = "layer_norm"
    check_float(op, "x", x, bk)
    check_ndim(op, "x", x, 1, "N.. x D")
    for name, a in (("weight", weight), ("bias", bias)):
        if a is None:
            continue
        check_float(op, name, a, bk)
        if a.ndim != 1 or a.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{op}: {name} must have shape ({x.shape[-1]},) to match the last dimension of "
                f"x (shape {tuple(x.shape)}), got {tuple(a.shape)}"
            )
    _check_eps(op, eps)
    return x * 1  # everything is valid and D == 0: the empty result, a new array


def _check_eps(op: str, eps: float) -> None:
    try:
        check_real(op, "eps", eps, low=0.0, finite=False)
    except TypeError:
        raise TypeError(f"{op}: eps must be a real number >= 0, got {eps!r}") from None
    except ValueError:
        raise ValueError(f"{op}: eps must be >= 0, got {eps!r}") from None
