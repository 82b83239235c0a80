"""Elementwise activations (SiLU, GELU, ReLU), gpt-oss's clamped SwiGLU, softmax, and the
activation registry.

Every activation computes in float32 (float64 for float64 input) and returns the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from portable_llm.backends import resolve
from portable_llm.core.checks import (
    check_float,
    check_int,
    check_ndim,
    check_real,
    check_same_dtype,
    float_compute_dtype,
)
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace

__all__ = [
    "ACTIVATIONS",
    "activation",
    "check_swiglu",
    "clamped_swiglu",
    "gelu",
    "gelu_tanh",
    "logistic",
    "relu",
    "sigmoid",
    "silu",
    "softmax",
]

_SQRT_PI = math.sqrt(math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def logistic(xp: Namespace, x: Array) -> Array:
    """The logistic sigmoid ``1 / (1 + exp(-x))`` of ``x`` (any shape) in x's dtype, pure
    ``xp`` code: the piece of SiLU that the MoE router's shared-expert gate also uses."""
    # exp(-|x|) never overflows, so neither branch produces inf or NaN.
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def sigmoid(xp: Namespace, x: Array) -> Array:
    """``1 / (1 + exp(-x))`` in float32 (float64 for float64), rounded once to x's dtype
    (``torch.sigmoid``'s bits): the output gates of Qwen3-Next's attention and DeltaNet."""
    return xp.astype(logistic(xp, xp.astype(x, float_compute_dtype(xp, x.dtype))), x.dtype)


def _erf(xp: Namespace, z: Array) -> Array:
    """erf from its Maclaurin series (|z| < 2) and its Laplace continued fraction (|z| >= 2).

    The Array API has no erf. Each branch sees an argument clamped to its range so the other
    branch never overflows; both are accurate to a few float64 ulps (checked against math.erf).
    """
    a = xp.abs(z)
    s = xp.minimum(a, xp.full_like(a, 2.0))  # series argument, in [0, 2]
    term = s
    total = s
    s2 = -(s * s)
    for n in range(1, 40):  # term_n = (-1)^n s^(2n+1) / n!; 4^40/40! < 1e-23
        term = term * s2 / n
        total = total + term / (2 * n + 1)
    series = total * (2.0 / _SQRT_PI)
    c = xp.maximum(a, xp.full_like(a, 2.0))  # continued-fraction argument, >= 2
    f = c
    for k in range(60, 0, -1):  # erfc(c) = exp(-c^2)/sqrt(pi) / (c + 1/2/(c + 1/(c + 3/2/...)))
        f = c + (k / 2.0) / f
    cf = 1.0 - xp.exp(-(c * c)) / (_SQRT_PI * f)
    out = xp.where(a < 2.0, series, cf)
    return xp.where(z < 0, -out, out)


@portable("silu", pure=True)
def _silu(xp: Namespace, x: Array) -> Array:
    xc = xp.astype(x, float_compute_dtype(xp, x.dtype))
    return xp.astype(xc * logistic(xp, xc), x.dtype)


@portable("gelu", pure=True)
def _gelu(xp: Namespace, x: Array) -> Array:
    xc = xp.astype(x, float_compute_dtype(xp, x.dtype))
    return xp.astype(0.5 * xc * (1.0 + _erf(xp, xc / math.sqrt(2.0))), x.dtype)


@portable("gelu_tanh", pure=True)
def _gelu_tanh(xp: Namespace, x: Array) -> Array:
    xc = xp.astype(x, float_compute_dtype(xp, x.dtype))
    inner = _SQRT_2_OVER_PI * (xc + 0.044715 * (xc * xc * xc))
    return xp.astype(0.5 * xc * (1.0 + xp.tanh(inner)), x.dtype)


@portable("relu", pure=True)
def _relu(xp: Namespace, x: Array) -> Array:
    return xp.maximum(x, xp.zeros_like(x))  # NaN stays NaN


@portable("clamped_swiglu", pure=True)
def _clamped_swiglu(xp: Namespace, gate: Array, up: Array, *, limit: float, alpha: float) -> Array:
    compute = float_compute_dtype(xp, gate.dtype)
    g, u = xp.astype(gate, compute), xp.astype(up, compute)
    top = xp.full_like(g, limit)  # as full arrays: not every namespace's clip takes keywords
    g = xp.minimum(g, top)  # the gate: clamped above only
    u = xp.maximum(xp.minimum(u, top), -top)
    return xp.astype((u + 1.0) * (g * logistic(xp, alpha * g)), gate.dtype)


def check_swiglu(op: str, limit: Any, alpha: Any) -> tuple[float, float]:
    """``(limit, alpha)`` of the clamped SwiGLU as Python floats: ``limit > 0`` (``inf``: no
    clamp), ``alpha`` finite; else a TypeError/ValueError naming ``op`` and the argument."""
    limit = check_real(op, "swiglu_limit", limit, low=0.0, low_open=True, finite=False)
    return limit, check_real(op, "swiglu_alpha", alpha)


@portable("softmax", pure=True)
def _softmax(xp: Namespace, x: Array, *, axis: int) -> Array:
    xc = xp.astype(x, float_compute_dtype(xp, x.dtype))
    e = xp.exp(xc - xp.max(xc, axis=axis, keepdims=True))
    return xp.astype(e / xp.sum(e, axis=axis, keepdims=True), x.dtype)


def _unary(op: str, x: Array, impl: str, backend: str | None) -> Array:
    bk, (x,) = resolve(op, backend, x)
    check_float(op, "x", x, bk)
    return pick(bk, op, impl, x)(bk.xp, x)


def silu(x: Array, /, *, impl: str = "auto", backend: str | None = None) -> Array:
    """SiLU (swish): ``x * sigmoid(x)``.

    Parameters
    ----------
    x : array, any shape, float dtype
    impl : {"auto", "portable", "native"}
    backend : str, optional
        Array library to compute with; inferred from ``x`` when ``None``.

    Returns
    -------
    array
        Same shape and dtype as ``x``. Computed in float32 (float64 for float64 input) with a
        sigmoid that never overflows: ``silu(-1e4)`` is ``-0.0`` in float16, not NaN.
    """
    return _unary("silu", x, impl, backend)


def gelu(x: Array, /, *, impl: str = "auto", backend: str | None = None) -> Array:
    """Exact GELU: ``0.5 * x * (1 + erf(x / sqrt(2)))``. Same shape and dtype as ``x``.

    Parameters
    ----------
    x : array, any shape, float dtype
    impl : {"auto", "portable", "native"}
    backend : str, optional
    """
    return _unary("gelu", x, impl, backend)


def gelu_tanh(x: Array, /, *, impl: str = "auto", backend: str | None = None) -> Array:
    """GELU, tanh approximation (HF ``gelu_pytorch_tanh``). Same shape and dtype as ``x``.

    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``.

    Parameters
    ----------
    x : array, any shape, float dtype
    impl : {"auto", "portable", "native"}
    backend : str, optional
    """
    return _unary("gelu_tanh", x, impl, backend)


def relu(x: Array, /, *, impl: str = "auto", backend: str | None = None) -> Array:
    """ReLU: ``max(x, 0)`` (NaN propagates). Same shape and dtype as ``x``.

    Parameters
    ----------
    x : array, any shape, float dtype
    impl : {"auto", "portable", "native"}
    backend : str, optional
    """
    return _unary("relu", x, impl, backend)


def clamped_swiglu(
    gate: Array,
    up: Array,
    /,
    *,
    limit: float = 7.0,
    alpha: float = 1.702,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """gpt-oss's clamped SwiGLU (HF ``GptOssExperts._apply_gate``) of the two halves of a
    gated projection:

    ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)``.

    With ``limit = inf`` and ``alpha = 1`` it is ``silu(gate) * (up + 1)``: the plain SwiGLU
    of ``up + 1``.

    Parameters
    ----------
    gate, up : array, any shape (the same), one float dtype
    limit : float > 0
        HF ``swiglu_limit`` (gpt-oss: 7.0); ``inf`` clamps nothing.
    alpha : float
        HF ``swiglu_alpha`` (gpt-oss: 1.702).
    impl : {"auto", "portable", "native"}
        No backend has a kernel for it: ``auto`` is the portable one.
    backend : str, optional

    Returns
    -------
    array
        gate's shape and dtype; computed in float32 (float64 for float64 input) and rounded
        once (HF rounds after each step in bfloat16: within the tolerance table).
    """
    op = "clamped_swiglu"
    limit, alpha = check_swiglu(op, limit, alpha)
    bk, (gate, up) = resolve(op, backend, gate, up)
    check_float(op, "gate", gate, bk)
    check_float(op, "up", up, bk)
    check_same_dtype(op, bk, gate=gate, up=up)
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(
            f"{op}: up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}"
        )
    fn = pick(bk, op, impl, gate, up, limit=limit, alpha=alpha)
    return fn(bk.xp, gate, up, limit=limit, alpha=alpha)


def softmax(
    x: Array, /, *, axis: int = -1, impl: str = "auto", backend: str | None = None
) -> Array:
    """Softmax along ``axis``: ``exp(x - max(x)) / sum(exp(x - max(x)))``.

    Parameters
    ----------
    x : array, ``N.. x D``, float dtype
    axis : int
        The axis to normalise over (default: the last).
    impl : {"auto", "portable", "native"}
    backend : str, optional

    Returns
    -------
    array
        Same shape and dtype as ``x`` (an empty ``axis`` gives an empty result);
        max-subtracted, exponentials and the sum in float32 (float64 for float64 input). A
        slice that is all ``-inf`` gives NaN, as in every backend's native softmax.
    """
    bk, (x,) = resolve("softmax", backend, x)
    check_float("softmax", "x", x, bk)
    check_ndim("softmax", "x", x, 1, "N.. x D")
    axis = check_int("softmax", "axis", axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"softmax: axis={axis!r} is out of range for x of shape {tuple(x.shape)}")
    if x.shape[axis] == 0:  # nothing to normalise over: the (empty) result, on every backend
        return bk.xp.zeros_like(x)
    return pick(bk, "softmax", impl, x, axis=axis)(bk.xp, x, axis=axis)


#: Activation names as HF ``config.hidden_act`` spells them -> the op that computes them.
ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}

_PUBLIC = {"silu": silu, "gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu}


def activation_op(name: str, where: str = "act") -> str:
    """The op name of activation ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"{where}: unknown activation {name!r}; known: {', '.join(sorted(ACTIVATIONS))}"
        ) from None


def activation(name: str, /) -> Callable[..., Array]:
    """The public activation function called ``name`` (HF ``ACT2FN`` names: ``"silu"``, ...)."""
    return _PUBLIC[activation_op(name, "activation")]
