"""RMSNorm."""

from __future__ import annotations

from portable_llm.backends import Backend, resolve_pair
from portable_llm.core.checks import (
    check_float,
    check_ndim,
    check_real,
    float_compute_dtype,
    match_weight,
)
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace

__all__ = ["rms_norm"]


@portable("rms_norm", pure=True)
def _rms_norm(xp: Namespace, x: Array, weight: Array, *, eps: float) -> Array:
    xc = xp.astype(x, float_compute_dtype(xp, x.dtype))
    variance = xp.mean(xc * xc, axis=-1, keepdims=True)  # (N.., 1)
    normed = xc * (1.0 / xp.sqrt(variance + eps))
    # HF Qwen2RMSNorm order: round the normalised value to x's dtype, then scale by the weight.
    return weight * xp.astype(normed, x.dtype)


def rms_norm(
    x: Array, weight: Array, /, *, eps: float = 1e-5, impl: str = "auto", backend: str | None = None
) -> Array:
    """RMS normalisation (Llama, Qwen, Mistral): ``weight * x / sqrt(mean(x^2) + eps)``.

    The computation, in this order (HF transformers' ``Qwen2RMSNorm``/``LlamaRMSNorm``):

    1. ``xc = float32(x)`` (float64 stays float64, where HF would drop to float32);
    2. ``normed = xc * (1 / sqrt(mean(xc**2, axis=-1) + eps))``, accumulated in float32;
    3. ``out = weight * normed.astype(x.dtype)`` -- the normalised value is rounded to x's dtype
       *before* the weight multiply, which then happens in x's dtype.

    Parameters
    ----------
    x : array, shape ``(N.., D)``, float dtype
    weight : array, shape ``(D,)``, float dtype
        Cast to x's dtype when it differs (a float32 weight with bfloat16 activations gives a
        bfloat16 result): the package's mixed-precision rule (docs/mixed-precision.md).
    eps : float, >= 0
        Added to the mean of squares inside the square root.
    impl : {"auto", "portable", "native"}
        ``auto`` uses ``mx.fast.rms_norm`` (same rounding order as above) and, for float32 and
        float64, ``torch.nn.functional.rms_norm``. For float16/bfloat16 torch's kernel multiplies
        by the weight before its single rounding (one ulp from HF in about a quarter of the
        elements), so ``auto`` keeps the portable path there; ``impl="native"`` still forces it.
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
    floats, dtype, w_dtype, shape = bk.float_set, x.dtype, weight.dtype, x.shape
    try:  # a try costs nothing in 3.11 unless it raises
        bad = (
            dtype not in floats
            or w_dtype not in floats
            or not shape
            or weight.shape != shape[-1:]
            or not eps >= 0  # also rejects NaN
            or eps.__class__ is bool
            or not shape[-1]
        )
    except TypeError:  # eps is not a number
        bad = True
    if bad:  # raises, or D == 0: the empty result
        return _slow_path(bk, x, weight, eps)
    if w_dtype != dtype:
        weight = match_weight("rms_norm", "weight", weight, x, bk)
    return pick(bk, "rms_norm", impl, x, weight, eps=eps)(bk.xp, x, weight, eps=eps)


def _slow_path(bk: Backend, x: Array, weight: Array, eps: float) -> Array:
    check_float("rms_norm", "x", x, bk)
    check_float("rms_norm", "weight", weight, bk)
    check_ndim("rms_norm", "x", x, 1, "N.. x D")
    if weight.ndim != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) to match the last dimension of x "
            f"(shape {tuple(x.shape)}), got {tuple(weight.shape)}"
        )
    try:
        check_real("rms_norm", "eps", eps, low=0.0, finite=False)
    except TypeError:
        raise TypeError(f"rms_norm: eps must be a real number >= 0, got {eps!r}") from None
    except ValueError:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps!r}") from None
    # Everything is valid and D == 0: nothing to normalise.
    return match_weight("rms_norm", "weight", weight, x, bk) * x
