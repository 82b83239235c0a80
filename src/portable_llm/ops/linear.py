"""Linear layers and the gated MLP (SwiGLU) of Llama/Qwen/Mistral (and gpt-oss's clamped one)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from portable_llm.backends import Backend, resolve
from portable_llm.core.checks import check_float, check_int, check_ndim, match_weight
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.activations import activation, activation_op, check_swiglu, clamped_swiglu
from portable_llm.ops.affine import affine
from portable_llm.ops.kernels import Kernels, KernelSet
from portable_llm.ops.quant import is_quantized, quantized_linear

__all__ = [
    "MlpWeights",
    "check_linear",
    "intermediate_size",
    "linear",
    "mlp",
    "mlp_body",
    "swiglu_option",
]


@portable("linear", pure=True)
def _linear(xp: Namespace, x: Array, weight: Array, bias: Array = None) -> Array:
    return affine(xp, x, weight, bias)  # ops/affine.py, shared with the quantized ops


def check_linear(
    op: str, bk: Backend, x: Array, weight: Array, bias: Array, what: str
) -> tuple[Array, Array]:
    """Check one projection; ``(weight, bias)`` in x's dtype (the mixed-precision rule)."""
    check_float(op, "x", x, bk)
    check_float(op, what, weight, bk)
    check_ndim(op, "x", x, 1, "N.. x I")
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{op}: {what} must have shape (O, {x.shape[-1]}) (torch layout, O x I) to match "
            f"x of shape {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if bias is not None:
        check_float(op, f"bias of {what}", bias, bk)
        if bias.ndim != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"{op}: the bias of {what} must have shape ({weight.shape[0]},) to match "
                f"{what} of shape {tuple(weight.shape)}, got {tuple(bias.shape)}"
            )
    bias_name = f"bias of {what}"
    if not is_quantized(weight):  # a quantized one computes in x's dtype itself
        weight = match_weight(op, what, weight, x, bk)
    return weight, match_weight(op, bias_name, bias, x, bk)


def linear(
    x: Array,
    weight: Array,
    bias: Array = None,
    /,
    *,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """Affine map ``x @ weight.T + bias`` with torch's weight layout.

    Parameters
    ----------
    x : array, shape ``(N.., I)``, float dtype
    weight : array, shape ``(O, I)``, float dtype
        Cast to x's dtype when its float dtype differs (the
        mixed-precision rule, docs/mixed-precision.md).
    bias : array, shape ``(O,)``, float dtype, optional
        Cast to x's dtype likewise.
    impl : {"auto", "portable", "native"}
        ``auto`` uses ``torch.nn.functional.linear``, ``mx.addmm`` (``mx.matmul`` without a bias)
        or ``jax.numpy.matmul`` with ``preferred_element_type=float32``.
    backend : str, optional

    Returns
    -------
    array, shape ``(N.., O)``, x's dtype
        float16/bfloat16 products are accumulated in float32 and rounded once.
    """
    if is_quantized(weight):  # ops/quant/: a QuantizedWeight or an MXFP4Weight
        return quantized_linear(x, weight, bias, impl=impl, backend=backend)
    bk, (x, weight, bias) = resolve("linear", backend, x, weight, bias)
    weight, bias = check_linear("linear", bk, x, weight, bias, "weight")
    return pick(bk, "linear", impl, x, weight, bias)(bk.xp, x, weight, bias)


def mlp(
    x: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    /,
    *,
    act: str = "silu",
    b_gate: Array = None,
    b_up: Array = None,
    b_down: Array = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """Gated feed-forward block: ``down(act(gate(x)) * up(x))`` (SwiGLU for ``act="silu"``);
    with ``swiglu_limit``, gpt-oss's ``down(clamped_swiglu(gate(x), up(x)))``.

    The order of HF ``Qwen2MLP``/``LlamaMLP``: each projection and the activation round to x's
    dtype, the gate product happens in x's dtype.

    Parameters
    ----------
    x : array, shape ``(N.., L, E)`` (any leading shape), float dtype
    w_gate, w_up : array, shape ``(I, E)``, float dtype
    w_down : array, shape ``(E, I)``, float dtype
        Weights and biases in another float dtype are cast to x's dtype (the
        mixed-precision rule, docs/mixed-precision.md).
    act : str
        Activation name, as HF ``hidden_act`` spells it: ``"silu"`` (``"swish"``), ``"gelu"``,
        ``"gelu_tanh"`` (``"gelu_pytorch_tanh"``, ``"gelu_new"``), ``"relu"``.
    b_gate, b_up : array, shape ``(I,)``, optional
    b_down : array, shape ``(E,)``, optional
    swiglu_limit : float > 0, optional
        gpt-oss (HF ``swiglu_limit``): the gate product is
        :func:`~portable_llm.clamped_swiglu` of the two projections, ``(clip(up, -limit,
        limit) + 1) * g * sigmoid(swiglu_alpha * g)`` with ``g = min(gate, limit)``, computed
        in float32 and rounded once; ``act`` must then be ``"silu"`` (its default).
    swiglu_alpha : float
        HF ``swiglu_alpha`` (gpt-oss: 1.702); read only with ``swiglu_limit``.
    impl : {"auto", "portable", "native"}
        Passed to the projections and the activation.
    backend : str, optional

    Returns
    -------
    array, shape ``(N.., L, E)``, x's dtype
    """
    swiglu = swiglu_option("mlp", act, swiglu_limit, swiglu_alpha)
    if is_quantized(w_gate, w_up, w_down):
        weights = MlpWeights(w_gate, w_up, w_down, b_gate, b_up, b_down, swiglu)
        return _quantized_mlp(x, weights, act, impl, backend)
    act_name = activation_op(act, "mlp")
    bk, (x, w_gate, w_up, w_down, b_gate, b_up, b_down) = resolve(
        "mlp", backend, x, w_gate, w_up, w_down, b_gate, b_up, b_down
    )
    w_gate, b_gate = check_linear("mlp", bk, x, w_gate, b_gate, "w_gate")
    w_up, b_up = check_linear("mlp", bk, x, w_up, b_up, "w_up")
    if tuple(w_up.shape) != tuple(w_gate.shape):
        raise ValueError(
            f"mlp: w_up must have the shape of w_gate (I x E), {tuple(w_gate.shape)}, "
            f"got {tuple(w_up.shape)}"
        )
    i, e = w_gate.shape
    if tuple(w_down.shape) != (e, i):
        raise ValueError(
            f"mlp: w_down must have shape ({e}, {i}) (E x I) to match w_gate "
            f"{tuple(w_gate.shape)}, got {tuple(w_down.shape)}"
        )
    if b_down is not None and tuple(b_down.shape) != (e,):
        raise ValueError(f"mlp: b_down must have shape ({e},), got {tuple(b_down.shape)}")
    w_down = match_weight("mlp", "w_down", w_down, x, bk)
    b_down = match_weight("mlp", "b_down", b_down, x, bk)
    weights = MlpWeights(w_gate, w_up, w_down, b_gate, b_up, b_down, swiglu)
    return mlp_body(bk.xp, Kernels(bk, impl, act_name), x, weights)


def _quantized_mlp(x: Array, w: MlpWeights, act: str, impl: str, backend: str | None) -> Array:
    """:func:`mlp` with a quantized projection: the same steps through the public ops, each
    projection quantized or not (each op checks its own arguments)."""
    gate = linear(x, w.w_gate, w.b_gate, impl=impl, backend=backend)  # (N.., I)
    up = linear(x, w.w_up, w.b_up, impl=impl, backend=backend)  # (N.., I)
    if w.swiglu is None:
        h = activation(act)(gate, impl=impl) * up
    else:
        h = clamped_swiglu(gate, up, limit=w.swiglu[0], alpha=w.swiglu[1], impl=impl)
    return linear(h, w.w_down, w.b_down, impl=impl, backend=backend)  # (N.., E)


def swiglu_option(op: str, act: str, limit: Any, alpha: Any) -> tuple[float, float] | None:
    """The checked ``(swiglu_limit, swiglu_alpha)`` of a gated MLP (``None`` without a limit):
    the clamped SwiGLU replaces ``act(gate) * up``, so ``act`` must be SiLU's."""
    if limit is None:
        return None
    if activation_op(act, op) != "silu":
        raise ValueError(
            f"{op}: swiglu_limit gives gpt-oss's clamped SwiGLU, whose gate activation is "
            f"x * sigmoid(swiglu_alpha * x); act must be 'silu', got {act!r}"
        )
    return check_swiglu(op, limit, alpha)


@dataclass(frozen=True)
class MlpWeights:
    """A gated MLP's weights: ``down(act(gate(x)) * up(x))``; without ``w_gate`` the plain MLP
    ``down(act(up(x)))`` (GPT-2's ``c_fc``/``c_proj``, Phi-2's ``fc1``/``fc2``). Each projection
    is a float array, a :class:`~portable_llm.QuantizedWeight` or one bound with its kernel
    (:class:`~portable_llm.ops.kernels.QLinear`, :class:`~portable_llm.ops.kernels.Packed`)."""

    w_gate: Any  # (I, E), or None: the plain MLP
    w_up: Any  # (I, E)
    w_down: Any  # (E, I)
    b_gate: Any  # (I,) or None
    b_up: Any  # (I,) or None
    b_down: Any  # (E,) or None
    #: ``(limit, alpha)``: gpt-oss's clamped SwiGLU in place of ``act(gate) * up``; or None
    swiglu: tuple[float, float] | None = None


def mlp_body(xp: Namespace, kn: KernelSet, x: Array, w: MlpWeights) -> Array:
    """The gated MLP of checked arguments: the body of :func:`mlp` and of a model's layers.

    ``kn``: a :class:`~portable_llm.ops.kernels.KernelSet` (each kernel chosen per call,
    bound once, or the public ops); ``x`` ``(N.., E)``.
    HF's order: each projection and the activation round to x's dtype.
    """
    if w.w_gate is None:  # HF PhiMLP / GPT2MLP: fc1, act, fc2
        up = kn.project(xp, x, w.w_up, w.b_up)  # (N.., I)
        return kn.project(xp, kn.act(xp, up), w.w_down, w.b_down)  # (N.., E)
    gate = kn.project(xp, x, w.w_gate, w.b_gate)  # (N.., I)
    up = kn.project(xp, x, w.w_up, w.b_up)  # (N.., I)
    if w.swiglu is not None:  # gpt-oss: one fused, clamped gate product
        h = kn.glu(xp, gate, up, limit=w.swiglu[0], alpha=w.swiglu[1])  # (N.., I)
        return kn.project(xp, h, w.w_down, w.b_down)  # (N.., E)
    return kn.project(xp, kn.act(xp, gate) * up, w.w_down, w.b_down)  # (N.., E)


def intermediate_size(hidden_size: int, /, *, ratio: float = 8 / 3, multiple_of: int = 256) -> int:
    """The Llama rule for the FFN width: ``floor(ratio * E)`` rounded up to ``multiple_of``.

    ``ratio`` is read as the nearest fraction with a small denominator, so the default 8/3 is
    exact: ``intermediate_size(4096) == 11008`` (Llama-7B), ``(5120) == 13824`` (13B).

    Parameters
    ----------
    hidden_size : int, > 0
    ratio : float, > 0
    multiple_of : int, > 0

    Returns
    -------
    int
    """
    for name, value in (("hidden_size", hidden_size), ("multiple_of", multiple_of)):
        try:
            check_int("intermediate_size", name, value, low=1)
        except (TypeError, ValueError):
            raise ValueError(
                f"intermediate_size: {name} must be a positive int, got {value!r}"
            ) from None
    if not (isinstance(ratio, int | float | Fraction) and math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"intermediate_size: ratio must be a positive number, got {ratio!r}")
    width = math.floor(Fraction(ratio).limit_denominator(1000) * int(hidden_size))
    return int(multiple_of) * -(-width // int(multiple_of))
