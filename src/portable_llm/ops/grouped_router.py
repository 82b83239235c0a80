"""The group-limited router of DeepSeek V3, Kimi K2 and GLM-4.5 (``router="grouped"`` of
:func:`~portable_llm.route` and :func:`~portable_llm.moe`).

HF ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter``, in float32 (float64 for float64 x)::

    scores = sigmoid(x @ w_router.T)                       # (N.., X), x and w_router upcast
    choice = scores + e_score_correction_bias              # for the selection only
    group  = sum of the top 2 of choice in each of n_group groups of X / n_group experts
    keep   = the topk_group groups of largest group score
    ids    = top_k of choice over the experts of the kept groups
    weights = scores[ids] (/ (sum + 1e-20) if norm_topk_prob) * routed_scaling_factor

Ties go to the lower index (group or expert); HF's ``torch.topk(sorted=False)`` leaves them
unspecified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from portable_llm.backends import Backend
from portable_llm.core.checks import check_float, check_int, check_real, float_compute_dtype
from portable_llm.core.dispatch import pick
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.activations import logistic

__all__ = ["GROUPED", "Grouping", "check_grouping", "grouped_route"]

#: The router name of :func:`grouped_route` in ``route``/``moe``.
GROUPED = "grouped"


@dataclass(frozen=True)
class Grouping:
    """The checked options of the grouped router (HF ``DeepseekV3Config`` names)."""

    n_group: int  # groups of X / n_group consecutive experts
    topk_group: int  # groups kept per token
    routed_scaling_factor: float  # multiplies the k weights
    bias: Any = None  # (X,) e_score_correction_bias in the compute dtype, or None


def check_grouping(
    op: str, bk: Backend, x: Array, n_experts: int, top_k: int, *, router: str, n_group: Any,
    topk_group: Any, bias: Any, scale: Any,
) -> Grouping | None:  # fmt: skip
    """The checked :class:`Grouping` of ``router="grouped"``; ``None`` for the other routers,
    which take none of its options (a ValueError naming the one given)."""
    if router != GROUPED:
        given = {
            "n_group": n_group != 1, "topk_group": topk_group != 1,
            "e_score_correction_bias": bias is not None, "routed_scaling_factor": scale != 1.0,
        }  # fmt: skip
        for name, set_ in given.items():
            if set_:
                raise ValueError(f"{op}: {name} is an option of router='grouped', not {router!r}")
        return None
    g = check_int(op, "n_group", n_group, low=1)
    if n_experts % g:
        raise ValueError(f"{op}: n_group={g} must divide the number of experts X={n_experts}")
    tg = check_int(op, "topk_group", topk_group, low=1, high=g)
    per = n_experts // g
    if tg < g and per < 2:
        raise ValueError(
            f"{op}: a group's score is the sum of its top 2 experts: n_group={g} leaves "
            f"{per} expert per group of X={n_experts}"
        )
    if top_k > tg * per:
        raise ValueError(
            f"{op}: top_k={top_k} experts cannot come from topk_group={tg} groups of {per} "
            f"(X={n_experts}, n_group={g})"
        )
    scale = check_real(op, "routed_scaling_factor", scale, low=0.0, low_open=True)
    if bias is not None:
        check_float(op, "e_score_correction_bias", bias, bk)
        if tuple(bias.shape) != (n_experts,):
            raise ValueError(
                f"{op}: e_score_correction_bias must have shape ({n_experts},) (one per expert), "
                f"got {tuple(bias.shape)}"
            )
        bias = bk.xp.astype(bias, float_compute_dtype(bk.xp, x.dtype))
    return Grouping(g, tg, scale, bias)


def _keep_groups(xp: Namespace, top: Any, choice: Array, g: Grouping) -> Array:
    """``choice`` ``(N, X)`` with ``-inf`` outside each row's ``topk_group`` best groups."""
    n, x = choice.shape
    grouped = xp.reshape(choice, (n, g.n_group, x // g.n_group))  # (N, n_group, X / n_group)
    best2, _ = top(grouped, 2)  # (N, n_group, 2)
    _, kept = top(xp.sum(best2, axis=-1), g.topk_group)  # (N, topk_group) group ids
    ranks = xp.cumulative_sum(xp.ones_like(choice[:, : g.n_group]), axis=-1) - 1.0  # (N, n_group)
    hit = xp.astype(kept, choice.dtype)[:, :, None] == ranks[:, None, :]  # (N, topk_group, n_group)
    keep = xp.any(hit, axis=1)[:, :, None]  # (N, n_group, 1)
    keep = xp.reshape(xp.broadcast_to(keep, grouped.shape), (n, x))  # (N, X)
    return xp.where(keep, choice, -math.inf)


def grouped_route(
    bk: Backend, x: Array, w_router: Array, top_k: int, norm_topk_prob: bool, impl: str,
    g: Grouping,
) -> tuple[Array, Array]:  # fmt: skip
    """``(weights, ids)``, each ``(N.., top_k)``, of checked arguments (see the module)."""
    xp = bk.xp
    compute = float_compute_dtype(xp, x.dtype)
    lead = x.shape[:-1]
    xc = xp.reshape(xp.astype(x, compute), (-1, x.shape[-1]))  # (N, E), HF: .type(float32)
    wc = xp.astype(w_router, compute)
    logits = pick(bk, "linear", impl, xc, wc)(xp, xc, wc)  # (N, X)
    scores = logistic(xp, logits)
    choice = scores if g.bias is None else scores + g.bias

    def top(a: Array, k: int) -> tuple[Array, Array]:
        return pick(bk, "top_k", impl, a, k=k)(xp, a, k=k)

    if g.topk_group < g.n_group:
        choice = _keep_groups(xp, top, choice, g)
    _, ids = top(choice, top_k)  # (N, k), by the biased scores
    weights = xp.take_along_axis(scores, ids, axis=-1)  # the unbiased scores
    if norm_topk_prob:
        weights = weights / (xp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * g.routed_scaling_factor
    ids = xp.astype(ids, xp.asarray(0).dtype)
    return xp.reshape(weights, (*lead, top_k)), xp.reshape(ids, (*lead, top_k))
