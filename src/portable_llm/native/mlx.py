"""MLX kernels: ``mx.fast`` and fused MLX ops."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from portable_llm._dispatch import native


@native("mlx", "rms_norm", kernel="mx.fast.rms_norm")
def rms_norm(xp: Any, x: Any, weight: Any, *, eps: float) -> Any:
    # One fused kernel in float32; the weight multiply precedes the single rounding.
    return mx.fast.rms_norm(x, weight, eps)


@native("mlx", "softmax", kernel="mx.softmax(precise=True)")
def softmax(xp: Any, x: Any, *, axis: int) -> Any:
    return mx.softmax(x, axis=axis, precise=True)


@native("mlx", "gelu", kernel="mx.erf")
def gelu(xp: Any, x: Any) -> Any:
    xc = x.astype(mx.float64 if x.dtype == mx.float64 else mx.float32)
    return (0.5 * xc * (1.0 + mx.erf(xc * 0.7071067811865476))).astype(x.dtype)


@native("mlx", "linear", kernel="mx.addmm")
def linear(xp: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    if bias is None:
        return mx.matmul(x, weight.T)
    return mx.addmm(bias, x, weight.T)
