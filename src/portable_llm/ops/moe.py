"""Mixture of Experts: the top-k routers and the sparse MoE block (Mixtral, Qwen2-MoE, Llama 4,
DeepSeek V3, gpt-oss).

Three routers: ``"softmax"`` (Mixtral, Qwen2-MoE: softmax over all experts, the top k weight the
experts' outputs), ``"sigmoid"`` (Llama 4: the top k logits, their sigmoid scales each
expert's *input*) and ``"grouped"`` (DeepSeek V3, Kimi K2, GLM-4.5: sigmoid scores, a
correction bias for the selection, top-k within the best groups:
:mod:`portable_llm.ops.grouped_router`).

Experts are stacked as HF stores them: ``experts_gate``/``experts_up`` ``(X, I, E)`` (HF's fused
``experts.gate_up_proj`` of shape ``(X, 2I, E)`` split into its halves ``[:, :I]`` and
``[:, I:]``), ``experts_down`` ``(X, E, I)`` (HF ``experts.down_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from portable_llm.backends import Backend, resolve
from portable_llm.core.checks import (
    check_float,
    check_int,
    check_ndim,
    float_compute_dtype,
    match_weight,
)
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.activations import activation_op, logistic
from portable_llm.ops.grouped_router import GROUPED, Grouping, check_grouping, grouped_route
from portable_llm.ops.linear import mlp, swiglu_option
from portable_llm.ops.moe_experts import (
    check_expert_biases,
    check_experts,
    check_mxfp4_experts,
    mxfp4_experts,
    run_experts,
)
from portable_llm.ops.quant import dequantized

__all__ = ["ROUTERS", "MoeWeights", "moe", "route"]

#: The routers of :func:`route` and :func:`moe`.
ROUTERS: tuple[str, ...] = ("softmax", "sigmoid", GROUPED)


@portable("top_k", pure=True)
def _top_k(xp: Namespace, x: Array, *, k: int) -> tuple[Array, Array]:
    """The k largest along the last axis, descending; ties: the lower index first."""
    idx = xp.argsort(x, axis=-1, descending=True, stable=True)[..., :k]  # (N.., k)
    return xp.take_along_axis(x, idx, axis=-1), idx


@dataclass(frozen=True)
class MoeWeights:
    """A decoder layer's mixture of experts: :func:`moe`'s four arrays and its options, under
    :func:`moe`'s own names (see it for each); calling it runs :func:`moe` on ``x``
    ``(B.., L, E)``.

    ``w_router`` ``(X, E)``, ``experts_gate`` and ``experts_up`` ``(X, I, E)``,
    ``experts_down`` ``(X, E, I)`` (arrays, MXFP4 weights kept quantized, or other quantized
    weights :func:`moe` dequantizes).
    """

    w_router: Any
    experts_gate: Any
    experts_up: Any
    experts_down: Any
    top_k: int
    norm_topk_prob: bool = False
    router: str = "softmax"
    shared: tuple[Any, Any, Any] | None = None
    shared_gate: Any = None
    act: str = "silu"
    n_group: int = 1
    topk_group: int = 1
    e_score_correction_bias: Any = None
    routed_scaling_factor: float = 1.0
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    router_bias: Any = None  # gpt-oss: (X,)
    experts_gate_bias: Any = None  # gpt-oss: (X, I)
    experts_up_bias: Any = None  # gpt-oss: (X, I)
    experts_down_bias: Any = None  # gpt-oss: (X, E)

    @property
    def arrays(self) -> tuple[Any, Any, Any, Any]:
        """``(w_router, experts_gate, experts_up, experts_down)``."""
        return self.w_router, self.experts_gate, self.experts_up, self.experts_down

    @cached_property
    def options(self) -> dict[str, Any]:
        """:func:`moe`'s keyword options (every field but the four arrays)."""
        return {f.name: getattr(self, f.name) for f in fields(self)[4:]}

    def __call__(self, x: Array, /) -> Array:
        return moe(x, *self.arrays, **self.options)


def _route(
    bk: Backend, x: Array, w_router: Array, top_k: int, norm_topk_prob: bool, impl: str,
    router: str = "softmax", grouping: Grouping | None = None, bias: Array = None,
) -> tuple[Array, Array]:  # fmt: skip
    if grouping is not None:  # router="grouped"
        return grouped_route(bk, x, w_router, top_k, norm_topk_prob, impl, grouping)
    xp = bk.xp
    logits = pick(bk, "linear", impl, x, w_router, bias)(xp, x, w_router, bias)  # (N.., X)
    if router == "sigmoid":  # HF Llama4Router: top-k of the logits, then their sigmoid
        top, ids = pick(bk, "top_k", impl, logits, k=top_k)(xp, logits, k=top_k)  # (N.., k)
        scores = logistic(xp, xp.astype(top, float_compute_dtype(xp, x.dtype)))
        return scores, xp.astype(ids, xp.asarray(0).dtype)
    probs = xp.astype(logits, float_compute_dtype(xp, x.dtype))
    probs = xp.exp(probs - xp.max(probs, axis=-1, keepdims=True))
    probs = probs / xp.sum(probs, axis=-1, keepdims=True)  # softmax over all experts
    weights, ids = pick(bk, "top_k", impl, probs, k=top_k)(xp, probs, k=top_k)  # (N.., k)
    if norm_topk_prob:
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    return weights, xp.astype(ids, xp.asarray(0).dtype)


def _grouping(
    op: str, bk: Backend, x: Array, w_router: Array, top_k: int, router: str, opts: dict[str, Any]
) -> Grouping | None:
    """:func:`~portable_llm.ops.grouped_router.check_grouping` of the call's grouped options."""
    return check_grouping(
        op, bk, x, w_router.shape[0], top_k, router=router, n_group=opts["n_group"],
        topk_group=opts["topk_group"], bias=opts["e_score_correction_bias"],
        scale=opts["routed_scaling_factor"],
    )  # fmt: skip


def _check_router(op: str, router: Any, norm_topk_prob: Any) -> str:
    if router not in ROUTERS:
        raise ValueError(f"{op}: router must be one of {ROUTERS}, got {router!r}")
    if router == "sigmoid" and norm_topk_prob:
        raise ValueError(f"{op}: router='sigmoid' scores are not renormalised; norm_topk_prob=True")
    return str(router)


def _check_router_bias(
    op: str, bk: Backend, bias: Array, x: Array, w_router: Array, router: str
) -> Array:
    """``router_bias`` ``(X,)`` in x's dtype (or None); not with ``router="grouped"``, whose
    bias (``e_score_correction_bias``) only ranks."""
    if bias is None:
        return None
    if router == GROUPED:
        raise ValueError(
            f"{op}: router_bias is added to the logits of router='softmax' or 'sigmoid'; "
            "router='grouped' takes e_score_correction_bias"
        )
    check_float(op, "router_bias", bias, bk)
    X = w_router.shape[0]
    if tuple(bias.shape) != (X,):
        raise ValueError(
            f"{op}: router_bias must have shape ({X},) (one logit per expert of w_router "
            f"{tuple(w_router.shape)}), got {tuple(bias.shape)}"
        )
    return match_weight(op, "router_bias", bias, x, bk)


def _check_route(op: str, bk: Backend, x: Array, w_router: Array, top_k: Any) -> tuple[Array, int]:
    """Check the router's inputs; ``(w_router in x's dtype, top_k as an int)``."""
    check_float(op, "x", x, bk)
    check_float(op, "w_router", w_router, bk)
    check_ndim(op, "x", x, 1, "B.. x L x E")
    if w_router.ndim != 2 or w_router.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{op}: w_router must have shape (X, {x.shape[-1]}) (X experts x E) to match x of "
            f"shape {tuple(x.shape)}, got {tuple(w_router.shape)}"
        )
    top_k = check_int(op, "top_k", top_k)
    if not 1 <= top_k <= w_router.shape[0]:
        raise ValueError(
            f"{op}: top_k must be in [1, X] = [1, {w_router.shape[0]}] (w_router shape "
            f"{tuple(w_router.shape)}), got {top_k}"
        )
    return match_weight(op, "w_router", w_router, x, bk), top_k


# Over 80 lines for its docstring (the three routers and their options: 57 lines); the code is
# its checks and one dispatch.
def route(
    x: Array,
    w_router: Array,
    /,
    *,
    top_k: int,
    norm_topk_prob: bool = False,
    router: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    e_score_correction_bias: Array = None,
    routed_scaling_factor: float = 1.0,
    router_bias: Array = None,
    impl: str = "auto",
    backend: str | None = None,
) -> tuple[Array, Array]:
    """The MoE router: the ``top_k`` experts of each token and their weights.

    ``logits = x @ w_router.T [+ router_bias]`` (in x's dtype, as HF's router ``F.linear``).

    - ``router="softmax"`` (Mixtral, Qwen2-MoE): softmax over all experts in float32 (float64
      for float64 x); the top-k ranks by probability, ties broken by the lower expert id.
      ``norm_topk_prob=True`` rescales the k weights to sum to 1: Mixtral always does,
      Qwen2-MoE when its config's ``norm_topk_prob`` is set.
    - ``router="sigmoid"`` (Llama 4, HF ``Llama4Router``): the top-k of the logits, and the
      sigmoid of each chosen logit (float32) as its score, which :func:`moe` multiplies into
      the expert's *input*. The scores are independent (no normalisation).
    - ``router="grouped"`` (DeepSeek V3, Kimi K2, GLM-4.5; HF ``DeepseekV3TopkRouter``): the
      logits in float32 (x and w_router upcast, as HF), ``scores = sigmoid(logits)``; the
      selection ranks ``scores + e_score_correction_bias``: the ``X`` experts in ``n_group``
      groups of consecutive ids, the ``topk_group`` groups with the largest sum of their two
      best biased scores kept, the ``top_k`` best experts of those; the weights are the
      *unbiased* scores of the chosen experts, divided by their sum (``+ 1e-20``) when
      ``norm_topk_prob``, times ``routed_scaling_factor``. ``n_group = topk_group = 1``, no
      bias: the sigmoid of the top-k logits.

    Parameters
    ----------
    x : array, shape ``(B.., L, E)``, float dtype
    w_router : array, shape ``(X, E)``, float dtype
        HF ``gate.weight`` (``MixtralTopKRouter``/``Qwen2MoeTopKRouter``). Cast to x's dtype
        when its float dtype differs (the mixed-precision rule, docs/mixed-precision.md).
    top_k : int in ``[1, X]``
        HF ``num_experts_per_tok``.
    norm_topk_prob : bool
    router : {"softmax", "sigmoid", "grouped"}
    n_group : int >= 1, dividing X
        ``router="grouped"``: HF ``n_group``.
    topk_group : int in ``[1, n_group]``
        ``router="grouped"``: HF ``topk_group``; ``top_k <= topk_group * X / n_group``.
    e_score_correction_bias : array, shape ``(X,)``, float dtype, optional
        ``router="grouped"``: HF ``gate.e_score_correction_bias``, added to the scores for the
        selection only (used in float32).
    routed_scaling_factor : float > 0
        ``router="grouped"``: HF ``routed_scaling_factor``.
    router_bias : array, shape ``(X,)``, float dtype, optional
        ``router="softmax"`` or ``"sigmoid"``: added to the logits (gpt-oss, HF
        ``GptOssTopKRouter.bias``; cast to x's dtype). gpt-oss's router, a softmax over the
        top-k biased logits, is ``router="softmax"`` with ``norm_topk_prob=True``: the same
        weights.
    impl : {"auto", "portable", "native"}
        For the router projection and the top-k (``jax.lax.top_k`` on JAX; the portable
        top-k is a stable descending ``argsort``).
    backend : str, optional

    Returns
    -------
    weights : array, shape ``(B.., L, top_k)``, float32 (float64 for float64 x)
        Descending along the last axis (``"grouped"``: in the order of the biased scores).
    ids : array, shape ``(B.., L, top_k)``, the backend's default integer dtype
        The experts chosen, in ``[0, X)``. They carry no gradient (on MLX they are cut from
        the graph, so ``mx.grad`` flows to x and w_router through the weights).
    """
    router = _check_router("route", router, norm_topk_prob)
    bk, (x, w_router, bias, r_bias) = resolve(
        "route", backend, x, w_router, e_score_correction_bias, router_bias
    )
    w_router, top_k = _check_route("route", bk, x, w_router, top_k)
    r_bias = _check_router_bias("route", bk, r_bias, x, w_router, router)
    opts = {"n_group": n_group, "topk_group": topk_group, "e_score_correction_bias": bias,
            "routed_scaling_factor": routed_scaling_factor}  # fmt: skip
    grouping = _grouping("route", bk, x, w_router, top_k, router, opts)
    return _route(bk, x, w_router, top_k, bool(norm_topk_prob), impl, router, grouping, r_bias)


# Over 80 lines for its docstring (three routers, the shared expert, every impl); the code is the
# checks (~30 lines), then _moe_body.
def moe(
    x: Array,
    w_router: Array,
    experts_gate: Array,
    experts_up: Array,
    experts_down: Array,
    /,
    *,
    top_k: int,
    norm_topk_prob: bool = False,
    router: str = "softmax",
    shared: tuple[Array, Array, Array] | None = None,
    shared_gate: Array = None,
    act: str = "silu",
    n_group: int = 1,
    topk_group: int = 1,
    e_score_correction_bias: Array = None,
    routed_scaling_factor: float = 1.0,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
    router_bias: Array = None,
    experts_gate_bias: Array = None,
    experts_up_bias: Array = None,
    experts_down_bias: Array = None,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """Sparse MoE block: each token through its ``top_k`` experts, weighted by the router.

    ``router="softmax"`` or ``"grouped"``: ``out = sum_j weights_j * mlp_{ids_j}(x) [+
    shared]``;
    ``router="sigmoid"`` (Llama 4's ``Llama4TextMoe``): ``out = sum_j mlp_{ids_j}(x *
    scores_j) [+ shared]``, each score rounded to x's dtype and multiplied into the expert's
    input; with ``(weights | scores, ids) = route(x, w_router, ..., router=router)``, each
    expert a gated MLP (:func:`~portable_llm.mlp`), and ``shared`` ``= [sigmoid(x @
    shared_gate.T) *] mlp_shared(x)``. Only the routed tokens are gathered for each expert, so
    the cost grows with ``top_k``, not with the number of experts X.

    Parameters
    ----------
    x : array, shape ``(B.., L, E)``, float dtype
    w_router : array, shape ``(X, E)``
        HF ``gate.weight``.
    experts_gate, experts_up : array or MXFP4Weight, shape ``(X, I, E)``
        HF ``experts.gate_up_proj[:, :I]`` and ``[:, I:]``. Three
        :class:`~portable_llm.MXFP4Weight` experts (gpt-oss's checkpoints) stay quantized: each
        expert that has tokens is multiplied by the ``quantized_linear`` kernel of MXFP4
        (dequantized per selected expert on the portable path; ``mx.quantized_matmul`` on MLX;
        under ``jax.jit``, ``impl="auto"`` dequantizes inside the compiled ``ragged_dot``
        program). Other quantized experts are dequantized for the call.
    experts_down : array or MXFP4Weight, shape ``(X, E, I)``
        HF ``experts.down_proj``.
    top_k : int in ``[1, X]``
    norm_topk_prob : bool
        Renormalise the k routing weights to sum to 1 (Mixtral: always ``True``; not with
        ``router="sigmoid"``).
    router : {"softmax", "sigmoid", "grouped"}
        See :func:`route`; ``"sigmoid"`` scales the experts' inputs (Llama 4).
    n_group, topk_group, e_score_correction_bias, routed_scaling_factor
        The options of ``router="grouped"`` (DeepSeek V3, Kimi K2, GLM-4.5): see :func:`route`.
    shared : (w_gate, w_up, w_down), optional
        A shared expert run on every token, in :func:`~portable_llm.mlp`'s layout
        (``(I_s, E)``, ``(I_s, E)``, ``(E, I_s)``; HF ``shared_expert.{gate,up,down}_proj``).
    shared_gate : array, shape ``(1, E)``, optional
        Scales the shared expert by ``sigmoid(x @ shared_gate.T)`` (HF ``shared_expert_gate``);
        without it the shared expert is added unscaled.
    act : str
        The experts' activation (HF ``hidden_act``).
    swiglu_limit, swiglu_alpha : float
        gpt-oss: the routed experts' gate product is :func:`~portable_llm.clamped_swiglu`
        (as in :func:`~portable_llm.mlp`; ``act`` must be ``"silu"``); the shared expert keeps
        ``act``. gpt-oss's router (HF ``GptOssTopKRouter``: a softmax over the top-k logits)
        is ``router="softmax"`` with ``norm_topk_prob=True`` and ``router_bias``.
    router_bias : array, shape ``(X,)``, optional
        Added to the router logits (gpt-oss, HF ``router.bias``); see :func:`route`.
    experts_gate_bias, experts_up_bias : array, shape ``(X, I)``, optional
    experts_down_bias : array, shape ``(X, E)``, optional
        The routed experts' biases (gpt-oss, HF ``experts.gate_up_proj_bias`` de-interleaved
        and ``experts.down_proj_bias``): expert ``e`` is ``down_e(glu(gate_e(x) + bg_e,
        up_e(x) + bu_e)) + bd_e``, each sum in x's dtype as HF's. All three or none.
    impl : {"auto", "portable", "native", "dense"}
        How the routed experts run. ``"portable"``: sort the assignments by expert and run each
        expert on its own tokens; the per-expert counts are read back to the host (one sync per
        call), so it cannot run under ``jax.jit``. ``"native"``: ``jax.lax.ragged_dot`` (JAX:
        static shapes, works under ``jax.jit``) or ``mx.gather_mm`` (MLX, float32 on the CPU).
        ``"auto"``: the native kernel where there is one and it is faster (on JAX's CPU,
        ``ragged_dot`` only under ``jax.jit``), the portable one otherwise.
        ``"dense"``: every expert on every token (static shapes, cost grows with X; the
        baseline the benchmark compares against). The projections use ``impl="portable"``
        under ``"portable"``, ``"auto"`` otherwise.
    backend : str, optional

    Returns
    -------
    array, shape ``(B.., L, E)``, x's dtype
        Each expert's output is rounded to x's dtype (as HF's projections), then weighted and
        summed over the k experts in float32 (float64 for float64 x) and rounded once.
    """
    router = _check_router("moe", router, norm_topk_prob)
    act_name = activation_op(act, "moe")
    swiglu = swiglu_option("moe", act, swiglu_limit, swiglu_alpha)
    if shared is not None and (not isinstance(shared, tuple | list) or len(shared) != 3):
        raise ValueError("moe: shared must be a tuple (w_gate, w_up, w_down) or None")
    if shared_gate is not None and shared is None:
        raise ValueError("moe: shared_gate was given without a shared expert (shared=None)")
    # MXFP4 experts stay quantized (moe_experts_mxfp4); other quantized weights are dequantized
    # for the call (correct, not memory-light).
    mx4 = mxfp4_experts(experts_gate, experts_up, experts_down)
    s_w = [dequantized(w) for w in (shared if shared is not None else (None, None, None))]
    if not mx4:
        experts_gate, experts_up, experts_down = map(
            dequantized, (experts_gate, experts_up, experts_down)
        )
    w_router, shared_gate = dequantized(w_router), dequantized(shared_gate)
    dense = (None, None, None) if mx4 else (experts_gate, experts_up, experts_down)
    e_biases = (experts_gate_bias, experts_up_bias, experts_down_bias)
    bk, (x, w_router, gate, up, down, s_gate, s_up, s_down, shared_gate, bias, r_bias, *eb) = (
        resolve("moe", backend, x, w_router, *dense, *s_w, shared_gate, e_score_correction_bias,
                router_bias, *e_biases)
    )  # fmt: skip
    w_router, top_k = _check_route("moe", bk, x, w_router, top_k)
    r_bias = _check_router_bias("moe", bk, r_bias, x, w_router, router)
    grouped = {"n_group": n_group, "topk_group": topk_group, "e_score_correction_bias": bias,
               "routed_scaling_factor": routed_scaling_factor}  # fmt: skip
    grouping = _grouping("moe", bk, x, w_router, top_k, router, grouped)
    if mx4:
        gate, up, down = check_mxfp4_experts(
            "moe", bk, x, experts_gate, experts_up, experts_down, w_router.shape[0]
        )
    else:
        gate, up, down = check_experts(bk, x, gate, up, down, w_router.shape[0])
    biases = check_expert_biases(bk, x, eb, gate.shape)
    e = x.shape[-1]
    if shared_gate is not None and tuple(shared_gate.shape) != (1, e):
        raise ValueError(
            f"moe: shared_gate must have shape (1, {e}) to match x of shape {tuple(x.shape)}, "
            f"got {tuple(shared_gate.shape)}"
        )
    shared_gate = match_weight("moe", "shared_gate", shared_gate, x, bk)
    if e == 0:  # no features: the (empty) result, with no expert to run
        return bk.xp.zeros_like(x)
    experts = (gate, up, down)
    shared_w = None if shared is None else (s_gate, s_up, s_down)
    route_opts = (top_k, bool(norm_topk_prob), router, grouping, r_bias)
    return _moe_body(bk, impl, x, w_router, route_opts, experts, (act, act_name, swiglu),
                     shared_w, shared_gate, biases)  # fmt: skip


def _moe_body(
    bk: Any, impl: str, x: Array, w_router: Array, route_opts: tuple[Any, ...],
    experts: tuple[Array, Array, Array], acts: tuple[str, str, Any],
    shared: tuple[Array, Array, Array] | None, shared_gate: Array,
    biases: tuple[Array, Array, Array] | None = None,
) -> Array:  # fmt: skip
    """:func:`moe` on checked arguments: route, run the experts on their tokens, add the shared
    expert (``route_opts``: top_k, norm_topk_prob, router, grouping, router bias; ``acts``: the
    shared expert's ``act``, the experts' activation op and their clamped SwiGLU; ``biases``:
    the experts' stacked biases)."""
    xp, e = bk.xp, x.shape[-1]
    top_k, norm_topk_prob, router, grouping, r_bias = route_opts
    act, act_name, swiglu = acts
    sub = "portable" if impl == "portable" else "auto"
    xf = xp.reshape(x, (-1, e))  # (N, E)
    weights, ids = _route(
        bk, xf, w_router, top_k, norm_topk_prob, sub, router, grouping, r_bias
    )  # (N, k)
    n = xf.shape[0]
    if router == "sigmoid":  # each (token, slot) its own row: x * score, weight 1
        scaled = xp.expand_dims(xf, axis=1) * xp.expand_dims(xp.astype(weights, x.dtype), axis=2)
        xf = xp.reshape(scaled, (n * top_k, e))  # (N * k, E), token-major
        ids = xp.reshape(ids, (n * top_k, 1))  # (N * k, 1)
        weights = xp.ones_like(xp.reshape(weights, (n * top_k, 1)))  # (N * k, 1)
    out = run_experts(bk, impl, xf, weights, ids, experts, act_name, swiglu, biases)  # (N*, E)
    if router == "sigmoid":  # the k slots of each token summed in float32, rounded once
        ys = xp.reshape(xp.astype(out, weights.dtype), (n, top_k, e))  # (N, k, E)
        out = xp.astype(xp.sum(ys, axis=1), x.dtype)  # (N, E)
        xf = xp.reshape(x, (-1, e))  # (N, E): the shared expert's input
    if shared is not None:
        s = mlp(xf, *shared, act=act, impl=sub)  # (N, E)
        if shared_gate is not None:
            g = pick(bk, "linear", sub, xf, shared_gate)(xp, xf, shared_gate)  # (N, 1)
            s = xp.astype(logistic(xp, xp.astype(g, weights.dtype)), x.dtype) * s
        out = out + s
    return xp.reshape(out, x.shape)  # (B.., L, E)
