"""Float64 NumPy reference formulas, written independently of the portable implementations.

These are the textbook definitions in plain NumPy float64 (``math.erf`` for GELU), with none of
the dtype handling, dispatch or numerical tricks of the ops. Tests and ``portable-llm report``
compare every op and backend against them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from portable_llm.testing.recurrent_reference import (
    gated_delta_rule,
    gated_rms_norm,
    mamba2_mixer,
    short_conv,
    ssd_scan,
)

__all__ = [
    "attention",
    "attention_temperature",
    "causal_mask",
    "clamped_swiglu",
    "embedding",
    "gelu",
    "gated_delta_rule",
    "gated_rms_norm",
    "gelu_tanh",
    "grouped_route",
    "latent_attention",
    "layer_norm",
    "linear",
    "mamba2_mixer",
    "mlp",
    "moe",
    "mxfp4_dequantize",
    "mxfp4_linear",
    "penalties",
    "relu",
    "rms_norm",
    "rope",
    "rope_frequencies",
    "route",
    "sampling_probs",
    "scaled_dot_product_attention",
    "short_conv",
    "silu",
    "softmax",
    "ssd_scan",
    "unembed",
]

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    x = _f64(x)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def gelu(x: np.ndarray) -> np.ndarray:
    x = _f64(x)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def relu(x: np.ndarray) -> np.ndarray:
    x = _f64(x)
    return np.where(x > 0, x, 0.0)


ACTIVATIONS = {"silu": silu, "gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu}


def clamped_swiglu(
    gate: np.ndarray, up: np.ndarray, limit: float = 7.0, alpha: float = 1.702
) -> np.ndarray:
    """gpt-oss (HF ``GptOssExperts._apply_gate``): the gate clamped above at ``limit``, up to
    ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    g = np.minimum(_f64(gate), limit)
    u = np.clip(_f64(up), -limit, limit)
    with np.errstate(over="ignore"):
        return (u + 1.0) * (g / (1.0 + np.exp(-alpha * g)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = _f64(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention_temperature(
    q: np.ndarray, positions: np.ndarray, floor_scale: float = 8192.0, scale: float = 0.1
) -> np.ndarray:
    """Llama 4: row l of q times ``log(floor((positions[l] + 1) / floor_scale) + 1) * scale
    + 1``."""
    p = _f64(positions)
    factor = np.log(np.floor((p + 1.0) / floor_scale) + 1.0) * scale + 1.0
    return _f64(q) * factor[:, None]


def rms_norm(
    x: np.ndarray, weight: np.ndarray | None = None, eps: float = 1e-5, offset: float = 0.0
) -> np.ndarray:
    """``(offset + weight) * x / sqrt(mean(x^2) + eps)``; no weight: the normalised ``x``."""
    x = _f64(x)
    y = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)
    return y if weight is None else (offset + _f64(weight)) * y


def layer_norm(
    x: np.ndarray,
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
) -> np.ndarray:
    """``(x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the last axis (biased var)."""
    x = _f64(x)
    y = (x - x.mean(axis=-1, keepdims=True)) / np.sqrt(x.var(axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * _f64(weight)
    return y if bias is None else y + _f64(bias)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = np.einsum("...i,oi->...o", _f64(x), _f64(weight))
    return y if bias is None else y + _f64(bias)


def mlp(
    x: np.ndarray,
    w_gate: np.ndarray,
    w_up: np.ndarray,
    w_down: np.ndarray,
    act: str = "silu",
    swiglu: tuple[float, float] | None = None,
    biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """``down(act(gate(x)) * up(x))``; ``swiglu`` ``(limit, alpha)``: ``down(clamped_swiglu(
    gate(x), up(x)))`` (gpt-oss); ``biases``: of gate, up and down."""
    bg, bu, bd = (None, None, None) if biases is None else biases
    gate, up = linear(x, w_gate, bg), linear(x, w_up, bu)
    if swiglu is not None:
        return linear(clamped_swiglu(gate, up, *swiglu), w_down, bd)
    return linear(ACTIVATIONS[act](gate) * up, w_down, bd)


# -- attention ---------------------------------------------------------------------------------


def causal_mask(L: int, S: int, window: int | None = None, chunk: int | None = None) -> np.ndarray:
    """Boolean (L, S): query i (at absolute position i + S - L) may see key j; ``chunk``: only
    keys of the query's own chunk of ``chunk`` positions (Llama 4)."""
    mask = np.zeros((L, S), dtype=bool)
    for i in range(L):
        pos = i + S - L
        for j in range(S):
            mask[i, j] = j <= pos and (window is None or j > pos - window)
            mask[i, j] &= chunk is None or math.floor(j / chunk) == math.floor(pos / chunk)
    return mask


def scaled_dot_product_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float | None = None,
    mask: str | np.ndarray | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """softmax(q k^T * scale + mask) v, with K/V repeated to q's heads; no-key rows are 0.
    ``v`` ``(B.., H_kv, S, D_v)`` may have another head dim than q and k.

    ``sinks`` ``(H,)`` (gpt-oss): head h's row is ``softmax([scores, sinks[h]])[:-1] @ v``, the
    sink one more logit in the denominator with no value."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    h, L, d = q.shape[-3:]
    S = k.shape[-2]
    group = h // k.shape[-3]
    k = np.repeat(k, group, axis=-3)  # (B.., H, S, D), HF repeat_kv
    v = np.repeat(v, group, axis=-3)
    scores = np.einsum("...ld,...sd->...ls", q, k) * (d**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    allowed = np.ones(scores.shape, dtype=bool)
    if isinstance(mask, str) or window is not None:
        allowed &= causal_mask(L, S, window)
    if mask is not None and not isinstance(mask, str):
        mask = np.asarray(mask)
        if mask.dtype == bool:
            allowed &= mask
        else:
            scores = scores + _f64(mask)
            allowed &= mask > -np.inf
    out = np.zeros((*q.shape[:-1], v.shape[-1]), dtype=np.float64)  # (B.., H, L, D_v)
    flat_s = scores.reshape(-1, L, scores.shape[-1])
    flat_a = np.broadcast_to(allowed, scores.shape).reshape(flat_s.shape)
    flat_v = v.reshape(-1, S, v.shape[-1])
    flat_o = out.reshape(-1, L, v.shape[-1])
    sink = np.full(h, -np.inf) if sinks is None else _f64(sinks)
    for n in range(flat_s.shape[0]):
        for i in range(L):
            seen = flat_a[n, i]
            if not seen.any():
                continue  # a query that sees no key returns zeros (with a sink too: no value)
            logits = np.append(flat_s[n, i, seen], sink[n % h])  # the row's scores, its sink
            w = np.exp(logits - logits.max())
            flat_o[n, i] = (w[:-1] / w.sum()) @ flat_v[n, seen]
    return out


def latent_attention(
    x: np.ndarray,
    wkv_a: np.ndarray,
    kv_a_norm: np.ndarray,
    wkv_b: np.ndarray,
    wo: np.ndarray,
    *,
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    wq: np.ndarray | None = None,
    wq_a: np.ndarray | None = None,
    q_a_norm: np.ndarray | None = None,
    wq_b: np.ndarray | None = None,
    bq_a: np.ndarray | None = None,
    bkv_a: np.ndarray | None = None,
    bo: np.ndarray | None = None,
    norm_eps: float = 1e-6,
    rope_options: dict | None = None,
    scale: float | None = None,
    mask: str | np.ndarray | None = "causal",
    offset: int = 0,
) -> np.ndarray:
    """DeepSeek's multi-head latent attention, head by head, keys and values expanded from the
    latent (``DeepseekV3Attention``): ``q`` from ``wq`` or ``wq_b(rms_norm(wq_a x))``; ``c_kv,
    k_pe = wkv_a x``; ``c_kv = rms_norm(c_kv)``; head ``h``'s ``k_nope, v = c_kv`` times its rows
    of ``wkv_b``; scores ``q_nope . k_nope + rope(q_pe) . rope(k_pe)``, times ``scale`` (default
    ``(d_n + d_r) ** -0.5``, times ``mscale ** 2`` for a yarn ``rope_options["scaling"]`` with
    ``mscale_all_dim``); ``o_proj`` of the heads. ``rope_options``: :func:`rope`'s options
    (default ``{"traditional": True}``); ``mask``: ``"causal"``, ``None`` or a boolean array
    broadcastable to ``(B, H, L, L)``; positions ``offset + l``."""
    x = _f64(x)
    b, L, _ = x.shape
    H, R, dn, dr, dv = num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    ropt: dict[str, Any] = {"traditional": True} if rope_options is None else rope_options
    if wq is not None:
        q = linear(x, wq)
    else:
        assert wq_a is not None and wq_b is not None
        q = linear(rms_norm(linear(x, wq_a, bq_a), q_a_norm, norm_eps), wq_b)
    q = q.reshape(b, L, H, dn + dr)
    latent = linear(x, wkv_a, bkv_a)  # (B, L, R + d_r)
    c, positions = rms_norm(latent[..., :R], kv_a_norm, norm_eps), offset + np.arange(L)
    k_pe = rope(latent[..., R:], positions, **ropt)  # (B, L, d_r), shared by the heads
    if scale is None:
        scale = (dn + dr) ** -0.5
        s: dict[str, Any] = ropt.get("scaling") or {}
        if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
            f = s["factor"]
            m = 0.1 * s["mscale_all_dim"] * math.log(f) + 1.0 if f > 1 else 1.0
            scale *= m * m
    allowed = np.ones((b, H, L, L), bool)
    if isinstance(mask, str):
        allowed &= causal_mask(L, L)
    elif mask is not None:
        allowed &= np.asarray(mask, bool)
    rows = _f64(wkv_b).reshape(H, dn + dv, R)
    out = np.zeros((b, L, H, dv))
    for h in range(H):
        q_nope, q_pe = q[:, :, h, :dn], rope(q[:, :, h, dn:], positions, **ropt)
        k_nope, v = c @ rows[h, :dn].T, c @ rows[h, dn:].T  # (B, L, d_n), (B, L, d_v)
        scores = (q_nope @ k_nope.transpose(0, 2, 1) + q_pe @ k_pe.transpose(0, 2, 1)) * scale
        for n in range(b):
            for i in range(L):
                seen = allowed[n, h, i]
                if seen.any():
                    p = np.exp(scores[n, i, seen] - scores[n, i, seen].max())
                    out[n, i, h] = (p / p.sum()) @ v[n, seen]
    return linear(out.reshape(b, L, H * dv), wo, bo)


# -- decoding: embedding, sampling ---------------------------------------------------------------


def attention(
    x: np.ndarray,
    wq: np.ndarray,
    wk: np.ndarray,
    wv: np.ndarray,
    wo: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None = None,
    bq: np.ndarray | None = None,
    bk: np.ndarray | None = None,
    bv: np.ndarray | None = None,
    q_norm: np.ndarray | None = None,
    k_norm: np.ndarray | None = None,
    norm_eps: float = 1e-6,
    rope_options: dict | None = None,
    mask: str | np.ndarray | None = "causal",
    offset: int | np.ndarray = 0,
    window: int | None = None,
    chunk: int | None = None,
    qk_l2_norm: bool = False,
    temperature: tuple[float, float] | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """The attention block: project, split heads, q/k RMSNorm, RoPE, attention, merge, project.

    ``q_norm``/``k_norm``: ``(d,)`` norms each head; ``(H * d,)``/``(H_kv * d,)`` (OLMo 2) norm
    the whole projection before the split.

    ``rope_options``: the keyword options of :func:`rope` (``None``: no rotary embedding);
    positions are ``offset + l``, ``offset`` an int or one per sequence ``(B,)``. Llama 4:
    ``chunk`` (chunked causal mask, ``mask="causal"`` and an int offset of 0), ``qk_l2_norm``
    (weightless RMS norm after RoPE), ``temperature`` ``(floor_scale, scale)`` (int offset).
    gpt-oss: ``sinks`` ``(H,)`` (see :func:`scaled_dot_product_attention`).
    """
    b, L, E = np.shape(x)
    d = head_dim or E // num_heads

    def heads(y: np.ndarray, n: int) -> np.ndarray:  # (B, L, n*d) -> (B, n, L, d)
        return y.reshape(b, L, n, d).transpose(0, 2, 1, 3)

    q, k = linear(x, wq, bq), linear(x, wk, bk)  # (B, L, H*d), (B, L, H_kv*d)
    whole = [n is not None and n.shape[0] != d for n in (q_norm, k_norm)]  # OLMo 2's (H*d,)
    if q_norm is not None and whole[0]:
        q = rms_norm(q, q_norm, norm_eps)
    if k_norm is not None and whole[1]:
        k = rms_norm(k, k_norm, norm_eps)
    q, k = heads(q, num_heads), heads(k, num_kv_heads)
    v = heads(linear(x, wv, bv), num_kv_heads)
    if q_norm is not None and not whole[0]:
        q = rms_norm(q, q_norm, norm_eps)
    if k_norm is not None and not whole[1]:
        k = rms_norm(k, k_norm, norm_eps)
    if rope_options is not None:
        off = np.asarray(offset)
        positions = (off[:, None] if off.ndim else off) + np.arange(L)  # (L,) or (B, L)
        q, k = rope(q, positions, **rope_options), rope(k, positions, **rope_options)
    if qk_l2_norm:
        q, k = rms_norm(q, None, norm_eps), rms_norm(k, None, norm_eps)
    if temperature is not None:
        q = attention_temperature(q, int(offset) + np.arange(L), *temperature)
    if chunk is not None:
        mask = causal_mask(L, L, window, chunk)
    o = scaled_dot_product_attention(q, k, v, mask=mask, window=window, sinks=sinks)
    return linear(o.transpose(0, 2, 1, 3).reshape(b, L, num_heads * d), wo)


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids)
    table = _f64(table)
    out = np.empty((*ids.shape, table.shape[1]))
    for pos in np.ndindex(*ids.shape):
        out[pos] = table[int(ids[pos])]
    return out


def unembed(h: np.ndarray, table: np.ndarray) -> np.ndarray:
    return _f64(h) @ _f64(table).T


def sampling_probs(
    logits: np.ndarray,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> np.ndarray:
    """The distribution a sampler draws from, one row at a time (temperature > 0).

    Rank tokens by logit (ties: lower id first); top-k keeps the first k; top-p keeps tokens
    until the kept mass reaches top_p; min-p keeps p >= min_p * max p; renormalise after each.
    """
    logits = _f64(logits)
    out = np.zeros_like(logits)
    for row in np.ndindex(*logits.shape[:-1]):
        z = logits[row] / temperature
        ranked = sorted(range(z.size), key=lambda i: (-z[i], i))
        kept = ranked if top_k is None else ranked[:top_k]
        w = np.exp(np.array([z[i] for i in kept]) - z[ranked[0]])
        p = w / w.sum()
        if top_p is not None:
            mass, n = 0.0, 0
            while n < len(kept) and mass < top_p:
                mass += p[n]
                n += 1
            kept, p = kept[:n], p[:n] / p[:n].sum()
        if min_p is not None:
            n = int(np.sum(p >= min_p * p.max()))
            kept, p = kept[:n], p[:n] / p[:n].sum()
        out[row][kept] = p
    return out


def penalties(
    logits: np.ndarray,
    generated: list[list[int]],
    prompts: list[list[int]],
    *,
    frequency: list[float],
    presence: list[float],
    repetition: list[float],
    bias: list[dict[int, float]],
    banned: list[set[int]],
) -> np.ndarray:
    """Logits ``(B, V)`` after each row's ``logit_bias``, banned tokens, repetition penalty
    (over the prompt and the generated ids: ``x / r`` if ``x > 0`` else ``x * r``), frequency
    and presence penalties (over the generated ids: ``x - f * count - p``), token by token."""
    out = _f64(logits).copy()
    for b in range(out.shape[0]):
        for token in range(out.shape[1]):
            x = out[b, token] + bias[b].get(token, 0.0)
            if token in banned[b]:
                x = -math.inf
            count = generated[b].count(token)
            if count or token in prompts[b]:
                x = x / repetition[b] if x > 0 else x * repetition[b]
            if count:
                x = x - frequency[b] * count - presence[b]
            out[b, token] = x
    return out


# -- mixture of experts ------------------------------------------------------------------------


def route(
    x: np.ndarray, w_router: np.ndarray, *, top_k: int, norm_topk_prob: bool = False,
    router: str = "softmax", router_bias: np.ndarray | None = None, **grouped: Any,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(weights, ids), each ``(N.., top_k)``: softmax over experts, the k largest; ``router=
    "sigmoid"`` (Llama 4): the k largest logits and their sigmoid; ``router="grouped"``:
    :func:`grouped_route` (``grouped``: its options). ``router_bias`` (gpt-oss): added to the
    logits.

    Ties: the lower expert id first.
    """
    if router == "grouped":
        return grouped_route(x, w_router, top_k=top_k, norm_topk_prob=norm_topk_prob, **grouped)
    logits = linear(x, w_router, router_bias)
    if router == "sigmoid":
        ids = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k]
        return 1.0 / (1.0 + np.exp(-np.take_along_axis(logits, ids, axis=-1))), ids
    probs = softmax(logits)
    ids = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids


def grouped_route(
    x: np.ndarray, w_router: np.ndarray, *, top_k: int, norm_topk_prob: bool = False,
    n_group: int = 1, topk_group: int = 1, e_score_correction_bias: np.ndarray | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """DeepSeek V3's router, token by token: sigmoid scores; the biased scores pick the
    ``topk_group`` groups (of ``X / n_group`` consecutive experts) whose two best sum highest,
    then the ``top_k`` best experts in those groups; the weights are the unbiased scores
    (divided by their sum + 1e-20 if ``norm_topk_prob``) times ``routed_scaling_factor``."""
    scores = 1.0 / (1.0 + np.exp(-linear(x, w_router)))  # (N.., X)
    n_x = scores.shape[-1]
    bias = np.zeros(n_x) if e_score_correction_bias is None else _f64(e_score_correction_bias)
    size = n_x // n_group
    weights = np.zeros((*scores.shape[:-1], top_k))
    ids = np.zeros((*scores.shape[:-1], top_k), dtype=np.int64)
    for pos in np.ndindex(*scores.shape[:-1]):
        biased = scores[pos] + bias
        groups = [sorted(biased[g * size : (g + 1) * size])[-2:] for g in range(n_group)]
        rank = sorted(range(n_group), key=lambda g: (-sum(groups[g]), g))  # ties: lower first
        allowed = [e for e in range(n_x) if e // size in rank[:topk_group]]
        chosen = sorted(allowed, key=lambda e: (-biased[e], e))[:top_k]
        w = scores[pos][chosen]
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        weights[pos], ids[pos] = w * routed_scaling_factor, chosen
    return weights, ids


def moe(
    x: np.ndarray,
    w_router: np.ndarray,
    experts_gate: np.ndarray,
    experts_up: np.ndarray,
    experts_down: np.ndarray,
    *,
    top_k: int,
    norm_topk_prob: bool = False,
    shared: tuple[np.ndarray, ...] | None = None,
    shared_gate: np.ndarray | None = None,
    act: str = "silu",
    router: str = "softmax",
    swiglu: tuple[float, float] | None = None,
    router_bias: np.ndarray | None = None,
    experts_biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    **grouped: Any,
) -> np.ndarray:
    """Token by token: the weighted sum of its top-k experts' MLPs (``router="sigmoid"``: the
    sum of the experts' MLPs of the input times its score), plus the gated shared MLP.
    ``swiglu`` ``(limit, alpha)``: the routed experts' clamped SwiGLU (gpt-oss); ``router_bias``
    ``(X,)`` and ``experts_biases`` (stacked gate ``(X, I)``, up ``(X, I)`` and down ``(X, E)``
    biases): gpt-oss's; ``grouped``: the options of :func:`grouped_route`
    (``router="grouped"``)."""
    x = _f64(x)
    weights, ids = route(
        x, w_router, top_k=top_k, norm_topk_prob=norm_topk_prob, router=router,
        router_bias=router_bias, **grouped,
    )  # fmt: skip
    out = np.zeros_like(x)
    for pos in np.ndindex(*x.shape[:-1]):
        for w, e in zip(weights[pos], ids[pos], strict=True):
            g, u, d = experts_gate[e], experts_up[e], experts_down[e]
            b = None if experts_biases is None else tuple(a[e] for a in experts_biases)
            if router == "sigmoid":  # Llama 4: the score scales the expert's input
                out[pos] += mlp(x[pos] * w, g, u, d, act, None, b)
            else:
                out[pos] += w * mlp(x[pos], g, u, d, act, swiglu, b)
    if shared is not None:
        s_gate, s_up, s_down = shared
        s = mlp(x, s_gate, s_up, s_down, act)
        if shared_gate is not None:
            s = s / (1.0 + np.exp(-linear(x, shared_gate)))
        out = out + s
    return out


# -- rotary position embedding -----------------------------------------------------------------


def rope_frequencies(
    dims: int,
    base: float = 10000.0,
    scaling: dict | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[np.ndarray, float]:
    """``(theta, attention)``: the angle per position of pair i < dims/2, and the factor on cos/sin.

    ``theta_i = base^(-2i/dims)``, changed by an HF ``rope_scaling`` dict: linear divides every
    angle by the factor; dynamic (NTK) raises the base once ``seq_len`` outgrows the trained
    length; llama3 divides the slow pairs (wavelength above ``L0 / low_freq_factor``) by the
    factor, keeps the fast ones (below ``L0 / high_freq_factor``) and blends in between; yarn
    blends theta (pairs that turn more than ``beta_fast`` times over ``L0`` positions) into
    ``theta / factor`` (fewer than ``beta_slow`` turns) along a linear ramp of the pair index,
    and scales cos/sin by ``0.1 * mscale * ln(factor) + 1`` (over the same for mscale_all_dim);
    longrope divides theta by ``short_factor`` (``long_factor`` once ``seq_len > L0``) and
    scales cos/sin by ``sqrt(1 + ln(factor) / ln(L0))``, factor ``mpe / L0`` by default.
    """
    s = dict(scaling or {})
    kind = s.get("rope_type", s.get("type", "default"))
    base = float(s.get("rope_theta", base))
    mpe: int = max_position_embeddings or s.get("max_position_embeddings") or 0
    i = np.arange(dims // 2, dtype=np.float64)
    if kind == "dynamic":
        length = max(seq_len or 0, mpe)
        f = s["factor"]
        base = base * (f * length / mpe - (f - 1)) ** (dims / (dims - 2))
    theta = base ** (-2.0 * i / dims)
    attention = 1.0
    L0: int = s.get("original_max_position_embeddings") or mpe
    if kind == "linear":
        theta = theta / s["factor"]
    elif kind == "llama3":
        f, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        out = []
        for th in theta:
            wavelength = 2 * math.pi / th
            if wavelength < L0 / hi:
                out.append(th)
            elif wavelength > L0 / lo:
                out.append(th / f)
            else:
                smooth = (L0 / wavelength - lo) / (hi - lo)
                out.append((1 - smooth) * th / f + smooth * th)
        theta = np.array(out)
    elif kind == "yarn":
        f = s["factor"] if s["factor"] is not None else mpe / L0

        def pair_index(turns: float) -> float:  # the pair that turns `turns` times over L0
            return dims * math.log(L0 / (2 * math.pi * turns)) / (2 * math.log(base))

        lo, hi = pair_index(s.get("beta_fast") or 32), pair_index(s.get("beta_slow") or 1)
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dims - 1)
        hi = hi + 0.001 if hi == lo else hi
        ramp = np.clip((i - lo) / (hi - lo), 0.0, 1.0)  # 0: keep theta, 1: theta / factor
        theta = theta * (1 - ramp) + theta / f * ramp

        def m(scale: float) -> float:
            return 0.1 * scale * math.log(f) + 1.0 if f > 1 else 1.0

        attention = s.get("attention_factor") or (
            m(s["mscale"]) / m(s["mscale_all_dim"])
            if s.get("mscale") and s.get("mscale_all_dim")
            else m(1.0)
        )
    elif kind == "longrope":
        long = seq_len is not None and seq_len > L0  # the long factors beyond L0
        theta = theta / np.asarray(s["long_factor" if long else "short_factor"], np.float64)
        f = s.get("factor") or mpe / L0
        attention = s.get("attention_factor") or (
            math.sqrt(1 + math.log(f) / math.log(L0)) if f > 1 else 1.0
        )
    return theta, float(attention)


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    base: float = 10000.0,
    traditional: bool = False,
    scaling: dict | None = None,
    dims: int | None = None,
    max_position_embeddings: int | None = None,
) -> np.ndarray:
    """RoPE as complex multiplication: pair ``(a, b)`` at position m becomes the real and
    imaginary parts of ``(a + ib) * attention * e^(i m theta)``.

    x ``(.., L, D)``; positions ``(L,)``, or ``(B, L)`` for x ``(B, .., L, D)``. Pairs are
    ``(i, i + dims/2)``, or ``(2i, 2i + 1)`` when ``traditional``; features ``dims:`` pass.
    """
    x = _f64(x)
    D = x.shape[-1]
    if dims is None:
        dims = int(D * (scaling or {}).get("partial_rotary_factor", 1.0))
    positions = np.asarray(positions)
    theta, attention = rope_frequencies(
        dims, base, scaling, max_position_embeddings, int(positions.max()) + 1
    )
    angle = positions[..., None].astype(np.float64) * theta  # (L, h) or (B, L, h)
    if angle.ndim == 3:
        angle = angle.reshape(angle.shape[0], *(1,) * (x.ndim - 3), *angle.shape[1:])
    first = slice(0, dims, 2) if traditional else slice(0, dims // 2)
    second = slice(1, dims, 2) if traditional else slice(dims // 2, dims)
    z = (x[..., first] + 1j * x[..., second]) * attention * np.exp(1j * angle)
    out = x.copy()
    out[..., first], out[..., second] = z.real, z.imag
    return out


def affine_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The integer codes of MLX's affine layout: each row of uint32 ``packed`` is one
    little-endian bit stream, code ``k`` its bits ``k * bits .. (k + 1) * bits - 1``."""
    words = packed.astype(np.uint64)
    n, w = words.shape
    stream = ((words[:, :, None] >> np.arange(32, dtype=np.uint64)) & 1).reshape(n, w * 32)
    per_code = stream.reshape(n, w * 32 // bits, bits)  # (N, K, bits), least significant first
    return (per_code * (1 << np.arange(bits, dtype=np.uint64))).sum(-1).astype(np.int64)


def dequantize(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, *, bits: int, group_size: int
) -> np.ndarray:
    """``scales * q + biases`` per group, in float64: shape ``(N, K)``."""
    codes = affine_codes(packed, bits)
    s = np.repeat(np.asarray(scales, np.float64), group_size, axis=-1)
    b = np.repeat(np.asarray(biases, np.float64), group_size, axis=-1)
    return s * codes + b


def quantized_linear(
    x: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    *,
    bits: int,
    group_size: int,
) -> np.ndarray:
    """``x @ dequantize(...).T`` in float64."""
    return linear(x, dequantize(packed, scales, biases, bits=bits, group_size=group_size))


def quantized_linear_int8(
    x: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    *,
    bits: int,
    group_size: int,
    compute: Any = np.float32,
) -> np.ndarray:
    """``quantized_linear(..., activations="int8")``: x rounded to Q8_0 blocks, then
    ``x_q @ dequantize(...).T`` in float64.

    The blocks' scales ``d = max|x| / 127`` and codes ``round(x / d)`` (half to even) are
    formed in ``compute`` (float32; float64 for float64 x), as the op defines them: the codes of
    a value near a rounding boundary depend on that precision, and the reference must round the
    same values the op rounds. Everything after (the dequantized weight, the products and sums)
    is float64."""
    a = min(32, group_size)
    xc = np.asarray(x, dtype=compute)
    lead, k = xc.shape[:-1], xc.shape[-1]
    xb = xc.reshape(-1, k // a, a)  # (M, J, A)
    d = np.max(np.abs(xb), axis=-1, keepdims=True) / compute(127.0)  # (M, J, 1), in compute
    xq = np.round(xb / np.where(d > 0, d, compute(1.0)))  # half to even, in compute
    xd = (xq.astype(np.float64) * d.astype(np.float64)).reshape(*lead, k)  # the rounded x
    return linear(xd, dequantize(packed, scales, biases, bits=bits, group_size=group_size))


def mxfp4_dequantize(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP Microscaling) from its bits, in float64: code ``c`` of element ``k`` is bits
    ``4 (k % 8) ..`` of word ``k // 8``; FP4 E2M1 decodes sign ``c >> 3``, exponent ``(c >> 1) &
    3`` (bias 1; 0 is subnormal: ``m / 2``) and mantissa ``c & 1``; the block of 32 is scaled
    by ``2 ** (e - 127)`` (E8M0; 255 read as ``2 ** 128``, as gpt-oss's readers do)."""
    words = np.asarray(packed).astype(np.uint64)
    shifts = 4 * np.arange(8, dtype=np.uint64)
    codes = ((words[..., None] >> shifts) & 0xF).reshape(*words.shape[:-1], -1).astype(np.int64)
    sign = np.where(codes >> 3, -1.0, 1.0)
    exp, man = (codes >> 1) & 3, (codes & 1).astype(np.float64)
    magnitude = np.where(exp == 0, man / 2, 2.0 ** (exp - 1) * (1 + man / 2))
    scale = 2.0 ** (np.asarray(scales).astype(np.float64) - 127)  # (.., N, K / 32)
    return sign * magnitude * np.repeat(scale, 32, axis=-1)


def mxfp4_linear(
    x: np.ndarray, packed: np.ndarray, scales: np.ndarray, bias: np.ndarray | None = None
) -> np.ndarray:
    """``x @ W.T + bias`` for the MXFP4 weight ``W`` of :func:`mxfp4_dequantize`."""
    return linear(x, mxfp4_dequantize(packed, scales), bias)
