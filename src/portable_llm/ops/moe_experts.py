"""The routed experts of a mixture of experts: the ``moe_experts`` kernels (and
``moe_experts_mxfp4``'s, for MXFP4 experts kept quantized) and the checks of the stacked
experts, their biases and their MXFP4 form; :func:`~portable_llm.ops.moe.moe` routes, then calls
:func:`run_experts`.

A kernel takes ``(xp, x, weights, ids, *experts, b_gate, b_up, b_down, *, act, linear, to_host,
glu)``: ``(N, E)`` rows, their ``(N, k)`` routing weights and expert ids, the stacked experts
(``(X, I, E)``, ``(X, I, E)``, ``(X, E, I)`` floats; for MXFP4 the ``(packed, scales)`` arrays
of each), their stacked biases or Nones (positional: traced under ``jax.jit``, not static),
and the kernels the call chose. Native kernels: ``jax.lax.ragged_dot_general`` and
``mx.gather_mm`` (:mod:`portable_llm.native`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from portable_llm.backends import Backend
from portable_llm.core.checks import check_float, match_weight
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.kernels import BoundKernels
from portable_llm.ops.linear import MlpWeights, mlp_body
from portable_llm.ops.quant import MXFP4Weight
from portable_llm.ops.quant.mxfp4 import DEQUANTIZE as MXFP4_DEQUANTIZE
from portable_llm.ops.quant.mxfp4 import LINEAR as MXFP4_LINEAR

__all__ = [
    "MOE_MXFP4",
    "ClampedGlu",
    "check_experts",
    "check_expert_biases",
    "check_mxfp4_experts",
    "mxfp4_experts",
    "run_experts",
]


def _expert_ranks(xp: Namespace, stacked: Array, dtype: Any) -> Array:
    """0, 1, ..., X-1 on the device of ``stacked`` ``(X, ..)`` (built from it: the standard's
    arange needs a device)."""
    ones = xp.ones_like(stacked[:, 0, 0], dtype=dtype)  # (X,)
    return xp.cumulative_sum(ones) - 1


@dataclass(frozen=True)
class ClampedGlu:
    """gpt-oss's clamped SwiGLU as the experts' gate product: ``glu(xp, gate, up)`` in place of
    ``act(xp, gate) * up``. Every ``moe_experts`` kernel takes it as ``glu=`` (hashable: JAX's
    kernel compiles once per option set)."""

    fn: Any  # the clamped_swiglu kernel, fn(xp, gate, up, *, limit, alpha)
    limit: float
    alpha: float

    def __call__(self, xp: Namespace, gate: Array, up: Array) -> Array:
        return self.fn(xp, gate, up, limit=self.limit, alpha=self.alpha)


def _expert_mlp(
    xp: Namespace, xs: Array, w: tuple[Any, Any, Any], b: tuple[Any, Any, Any], act: Any,
    linear: Any, glu: ClampedGlu | None = None,
) -> Array:  # fmt: skip
    """One expert over its tokens ``xs`` ``(n, E)``: the gated MLP's body with the kernels the
    call chose. ``w``: its gate, up and down weights (arrays, or ``(packed, scales)`` pairs of
    MXFP4 that ``linear`` takes); ``b``: their biases ``(I,)``, ``(I,)``, ``(E,)`` or Nones
    (gpt-oss); ``glu``: the clamped SwiGLU in place of ``act``."""
    if glu is None:
        kernels = BoundKernels.for_mlp(linear, act)
        return mlp_body(xp, kernels, xs, MlpWeights(*w, *b))  # (n, E)
    kernels = BoundKernels.for_mlp(linear, act, glu.fn)
    return mlp_body(xp, kernels, xs, MlpWeights(*w, *b, (glu.limit, glu.alpha)))  # (n, E)


def _rows(arrays: tuple[Any, ...], e: int) -> tuple[Any, ...]:
    """Expert ``e``'s slice of each stacked ``(X, ..)`` array (None stays None)."""
    return tuple(None if a is None else a[e, ...] for a in arrays)


def _gather_run(
    xp: Namespace, x: Array, weights: Array, ids: Array, stacked: Array, run: Any, to_host: Any
) -> Array:  # fmt: skip
    """Sort the (token, slot) assignments by expert and run ``run(e, xs)`` -> ``(n_e, E)`` on
    each expert's own tokens only; the segment bounds are read back to the host (one sync).
    ``stacked``: an ``(X, .., ..)`` array of the experts (their count and device)."""
    n, k = ids.shape
    flat = xp.reshape(ids, (-1,))  # (A,) = (N * k,), token-major
    order = xp.argsort(flat, stable=True)  # (A,) assignments grouped by expert
    starts = xp.searchsorted(xp.take(flat, order), _expert_ranks(xp, stacked, flat.dtype))  # (X,)
    bounds = [*to_host(starts).tolist(), n * k]
    tokens = order // k  # (A,) the token of each assignment, in expert order
    ys = []
    for e in range(stacked.shape[0]):
        if bounds[e + 1] > bounds[e]:
            xs = xp.take(x, tokens[bounds[e] : bounds[e + 1]], axis=0)  # (count_e, E)
            ys.append(run(e, xs))
    if not ys:  # no tokens
        return xp.zeros_like(x)
    w = xp.take(xp.reshape(weights, (-1,)), order)  # (A,) routing weight, expert order
    y = xp.astype(xp.concat(ys, axis=0), weights.dtype) * w[:, None]  # (A, E)
    y = xp.take(y, xp.argsort(order), axis=0)  # (A, E) back to token-major
    return xp.astype(xp.sum(xp.reshape(y, (n, k, x.shape[-1])), axis=1), x.dtype)  # (N, E)


def _dense_run(xp: Namespace, x: Array, weights: Array, ids: Array, X: int, run: Any) -> Array:
    """Every expert ``run(e, x)`` on every token, weighted by its routing weight (0 where not
    routed)."""
    out = xp.zeros_like(x, dtype=weights.dtype)  # (N, E)
    zero = xp.zeros_like(weights)
    for e in range(X):
        w_e = xp.sum(xp.where(ids == e, weights, zero), axis=-1, keepdims=True)  # (N, 1)
        out = out + xp.astype(run(e, x), weights.dtype) * w_e
    return xp.astype(out, x.dtype)


@portable("moe_experts")
def _moe_gather(
    xp: Namespace, x: Array, weights: Array, ids: Array, gate: Array, up: Array, down: Array,
    b_gate: Array = None, b_up: Array = None, b_down: Array = None, *,
    act: Any, linear: Any, to_host: Any, glu: ClampedGlu | None = None,
) -> Array:  # fmt: skip
    """Run each expert on its own tokens only (:func:`_gather_run`); ``b_*``: the experts'
    stacked biases ``(X, I)``, ``(X, I)``, ``(X, E)`` or None (gpt-oss)."""
    w, b = (gate, up, down), (b_gate, b_up, b_down)

    def run(e: int, xs: Array) -> Array:
        return _expert_mlp(xp, xs, _rows(w, e), _rows(b, e), act, linear, glu)

    return _gather_run(xp, x, weights, ids, gate, run, to_host)


@portable("moe_experts", "dense", pure=True)
def _moe_dense(
    xp: Namespace, x: Array, weights: Array, ids: Array, gate: Array, up: Array, down: Array,
    b_gate: Array = None, b_up: Array = None, b_down: Array = None, *,
    act: Any, linear: Any, to_host: Any = None, glu: ClampedGlu | None = None,
) -> Array:  # fmt: skip
    """Every expert on every token, weighted by its routing weight (0 where not routed)."""
    w, b = (gate, up, down), (b_gate, b_up, b_down)

    def run(e: int, xs: Array) -> Array:
        return _expert_mlp(xp, xs, _rows(w, e), _rows(b, e), act, linear, glu)

    return _dense_run(xp, x, weights, ids, gate.shape[0], run)


#: The routed experts' op when they are :class:`~portable_llm.MXFP4Weight` (gpt-oss's
#: checkpoints): each kernel takes the codes and scales ``(packed, scales)`` of gate, up and
#: down, and ``linear`` is the ``quantized_linear_mxfp4`` kernel ``(xp, x, packed, scales,
#: bias)``, so the experts stay quantized: each expert that has tokens is multiplied from its
#: own codes (the portable kernel dequantizes that expert's rows for the product).
MOE_MXFP4 = "moe_experts_mxfp4"


def _mxfp4_runner(
    xp: Namespace, arrays: tuple[Array, ...], act: Any, linear: Any, glu: ClampedGlu | None
) -> Any:
    """``run(e, xs)``: expert ``e`` of MXFP4 arrays ``(gp, gs, up, us, dp, ds, bg, bu, bd)``."""
    q, b = arrays[:6], arrays[6:]

    def project(xp: Namespace, x: Array, w: tuple[Array, Array], bias: Array) -> Array:
        return linear(xp, x, w[0], w[1], bias)

    def run(e: int, xs: Array) -> Array:
        r = _rows(q, e)
        w = ((r[0], r[1]), (r[2], r[3]), (r[4], r[5]))
        return _expert_mlp(xp, xs, w, _rows(b, e), act, project, glu)

    return run


@portable(MOE_MXFP4)
def _moe_gather_mxfp4(
    xp: Namespace, x: Array, weights: Array, ids: Array, gate_packed: Array, gate_scales: Array,
    up_packed: Array, up_scales: Array, down_packed: Array, down_scales: Array,
    b_gate: Array = None, b_up: Array = None, b_down: Array = None, *,
    act: Any, linear: Any, to_host: Any, glu: ClampedGlu | None = None,
) -> Array:  # fmt: skip
    """The gather (:func:`_gather_run`) over MXFP4 experts: only the experts that have tokens
    are multiplied, each from its codes."""
    arrays = (gate_packed, gate_scales, up_packed, up_scales, down_packed, down_scales,
              b_gate, b_up, b_down)  # fmt: skip
    run = _mxfp4_runner(xp, arrays, act, linear, glu)
    return _gather_run(xp, x, weights, ids, gate_scales, run, to_host)


@portable(MOE_MXFP4, "dense", pure=True)
def _moe_dense_mxfp4(
    xp: Namespace, x: Array, weights: Array, ids: Array, gate_packed: Array, gate_scales: Array,
    up_packed: Array, up_scales: Array, down_packed: Array, down_scales: Array,
    b_gate: Array = None, b_up: Array = None, b_down: Array = None, *,
    act: Any, linear: Any, to_host: Any = None, glu: ClampedGlu | None = None,
) -> Array:  # fmt: skip
    """Every MXFP4 expert on every token (static shapes: runs under ``jax.jit``)."""
    arrays = (gate_packed, gate_scales, up_packed, up_scales, down_packed, down_scales,
              b_gate, b_up, b_down)  # fmt: skip
    run = _mxfp4_runner(xp, arrays, act, linear, glu)
    return _dense_run(xp, x, weights, ids, gate_scales.shape[0], run)


def run_experts(
    bk: Backend, impl: str, xf: Array, weights: Array, ids: Array, experts: tuple[Any, ...],
    act_name: str, swiglu: tuple[float, float] | None,
    biases: tuple[Array, Array, Array] | None = None,
) -> Array:  # fmt: skip
    """The routed experts of checked arguments through the ``moe_experts`` kernel ``impl``
    picks (``moe_experts_mxfp4`` for MXFP4 experts): ``(N, E)`` rows ``xf``, their ``(N, k)``
    weights and expert ids (``biases``: the experts' stacked gate, up and down biases)."""
    xp, sub = bk.xp, "portable" if impl == "portable" else "auto"
    if isinstance(experts[0], MXFP4Weight) and bk.is_traced(xf) and impl != "dense":
        # a compiled program (jax.jit): the codes dequantized inside it, a temporary of the
        # program, then the float kernel (jax.lax.ragged_dot), as no host read can run there
        experts = tuple(dequantize_in(bk, w, xf.dtype) for w in experts)
    if isinstance(experts[0], MXFP4Weight):  # the codes and scales of each, as arrays
        op, arrays = MOE_MXFP4, tuple(a for w in experts for a in w.arrays)
        p, s = arrays[0][0, ...], arrays[1][0, ...]  # one expert's gate: the kernel's choice
        linear = pick(bk, MXFP4_LINEAR, sub, xf, p, s, None)
    else:
        op, arrays = "moe_experts", experts
        linear = pick(bk, "linear", sub, xf, experts[0][0, ...])
    arrays += (None, None, None) if biases is None else biases  # gpt-oss: every expert biased
    run = pick(bk, op, impl, xf, weights, ids, *arrays)
    if run in (_moe_gather, _moe_gather_mxfp4) and bk.is_traced(xf):
        raise ValueError(
            "moe: impl='portable' reads the per-expert token counts back to the host, which a "
            "traced call (jax.jit) cannot do; use impl='auto' (jax.lax.ragged_dot) or 'dense'"
        )
    extra = {}
    if swiglu is not None:  # gpt-oss: the clamped SwiGLU, in every moe_experts kernel
        glu_fn = pick(bk, "clamped_swiglu", sub, xf, xf, limit=swiglu[0], alpha=swiglu[1])
        extra["glu"] = ClampedGlu(glu_fn, *swiglu)
    return run(
        xp, xf, weights, ids, *arrays, act=pick(bk, act_name, sub, xf), linear=linear,
        to_host=bk.to_numpy, **extra,
    )  # fmt: skip


def dequantize_in(bk: Backend, w: MXFP4Weight, dtype: Any) -> Array:
    """``w``'s floats in ``dtype`` by the dequantize kernel (traced: inside the program)."""
    p, s = w.arrays
    return pick(bk, MXFP4_DEQUANTIZE, "auto", p, s, dtype=dtype)(bk.xp, p, s, dtype=dtype)


def check_experts(
    bk: Backend, x: Array, gate: Array, up: Array, down: Array, n_experts: int
) -> tuple[Array, Array, Array]:
    """Check the stacked experts; the three in x's dtype (the mixed-precision rule)."""
    e = x.shape[-1]
    for name, arr in (("experts_gate", gate), ("experts_up", up), ("experts_down", down)):
        check_float("moe", name, arr, bk)
    if gate.ndim != 3 or gate.shape[0] != n_experts or gate.shape[2] != e:
        raise ValueError(
            f"moe: experts_gate must have shape ({n_experts}, I, {e}) (X x I x E, X from w_router, "
            f"E from x of shape {tuple(x.shape)}), got {tuple(gate.shape)}"
        )
    if tuple(up.shape) != tuple(gate.shape):
        raise ValueError(
            f"moe: experts_up must have the shape of experts_gate, {tuple(gate.shape)}, "
            f"got {tuple(up.shape)}"
        )
    want = (n_experts, e, gate.shape[1])
    if tuple(down.shape) != want:
        raise ValueError(
            f"moe: experts_down must have shape {want} (X x E x I) to match experts_gate "
            f"{tuple(gate.shape)}, got {tuple(down.shape)}"
        )
    return (
        match_weight("moe", "experts_gate", gate, x, bk),
        match_weight("moe", "experts_up", up, x, bk),
        match_weight("moe", "experts_down", down, x, bk),
    )


def mxfp4_experts(gate: Any, up: Any, down: Any) -> bool:
    """Whether the experts are MXFP4 (all three: kept quantized); one or two is a TypeError."""
    kinds = [isinstance(w, MXFP4Weight) for w in (gate, up, down)]
    if any(kinds) and not all(kinds):
        raise TypeError(
            "moe: experts_gate, experts_up and experts_down must all be MXFP4Weight or none; "
            f"got {', '.join(type(w).__name__ for w in (gate, up, down))}"
        )
    return all(kinds)


def check_mxfp4_experts(
    op: str, bk: Backend, x: Array, gate: MXFP4Weight, up: MXFP4Weight, down: MXFP4Weight,
    n_experts: int,
) -> tuple[MXFP4Weight, MXFP4Weight, MXFP4Weight]:  # fmt: skip
    """MXFP4 experts of ``x``'s backend with ``moe``'s shapes: gate and up ``(X, I, E)``, down
    ``(X, E, I)`` (``E`` and ``I`` multiples of 32, MXFP4's block)."""
    e = x.shape[-1]
    for name, w in (("experts_gate", gate), ("experts_up", up), ("experts_down", down)):
        if w.backend is not bk:
            raise TypeError(
                f"{op}: {name} is an MXFP4Weight of {w.backend.name}, x an array of {bk.name}; "
                f"convert it with {name}.to({bk.name!r})"
            )
    if len(gate.shape) != 3 or gate.shape[0] != n_experts or gate.shape[2] != e:
        raise ValueError(
            f"{op}: experts_gate must have shape ({n_experts}, I, {e}) (X x I x E, X from "
            f"w_router, E from x of shape {tuple(x.shape)}), got {gate.shape}"
        )
    if up.shape != gate.shape:
        raise ValueError(
            f"{op}: experts_up must have the shape of experts_gate, {gate.shape}, got {up.shape}"
        )
    want = (n_experts, e, gate.shape[1])
    if down.shape != want:
        raise ValueError(
            f"{op}: experts_down must have shape {want} (X x E x I) to match experts_gate "
            f"{gate.shape}, got {down.shape}"
        )
    return gate, up, down


def check_expert_biases(
    bk: Backend, x: Array, biases: list[Array], shape: tuple[int, ...]
) -> tuple[Array, Array, Array] | None:
    """The experts' biases (all three or none) with shapes ``(X, I)``, ``(X, I)``, ``(X, E)``
    for experts_gate of ``shape`` ``(X, I, E)``; in x's dtype."""
    names = ("experts_gate_bias", "experts_up_bias", "experts_down_bias")
    given = [b is not None for b in biases]
    if not any(given):
        return None
    if not all(given):
        missing = ", ".join(n for n, g in zip(names, given, strict=True) if not g)
        raise ValueError(f"moe: the experts' biases come as three or none; {missing} missing")
    X, I, E = (int(d) for d in shape)  # noqa: E741
    out = []
    for name, b, want in zip(names, biases, ((X, I), (X, I), (X, E)), strict=True):
        check_float("moe", name, b, bk)
        if tuple(b.shape) != want:
            raise ValueError(
                f"moe: {name} must have shape {want} to match experts_gate {tuple(shape)} "
                f"(X x I x E), got {tuple(b.shape)}"
            )
        out.append(match_weight("moe", name, b, x, bk))
    return out[0], out[1], out[2]
