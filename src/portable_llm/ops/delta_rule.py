"""The gated delta rule: Qwen3-Next's Gated DeltaNet linear attention (HF
``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``).

Per value head ``h`` (key head ``h // (H / H_k)``) a state ``S`` ``(D_k, D_v)`` runs over the
tokens; with ``q`` and ``k`` optionally L2-normalised and ``q`` scaled by ``scale``::

    S   = exp(g_t) * S                          # g: log-decay, <= 0
    S   = S + k_t (beta_t * (v_t - k_t^T S))^T  # the delta rule: correct what S predicts for k_t
    o_t = q_t^T S

``"recurrent"`` runs exactly that, one token at a time (decode). ``"portable"`` is the chunked
form (prefill): within a chunk of ``C`` tokens, with ``G_i = g_1 + .. + g_i`` and the strictly
lower ``A_ij = beta_i (k_i . k_j) exp(G_i - G_j)``, the WY/UT transform ``T = (I + A)^-1``
(forward substitution) turns the ``C`` rank-one updates into ``U = T (beta v)`` and ``W = T (beta
exp(G) k)``; each chunk then reads and updates the state with matrix products::

    v' = U - W S
    o  = (q exp(G)) S + tril((q k^T) exp(G_i - G_j)) v'
    S  = exp(G_C) S + (k exp(G_C - G))^T v'
"""

from __future__ import annotations

from typing import Any

from portable_llm.backends import resolve
from portable_llm.core.arrays import creation_device
from portable_llm.core.checks import check_bool, check_int, check_real, check_same_dtype
from portable_llm.core.dispatch import auto_portable, pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.recurrent import (
    RECURRENT,
    causal_decay,
    check_dims,
    check_state,
    compute_dtype,
    one_token_is_recurrent,
)

__all__ = ["gated_delta_rule", "gated_delta_rule_body"]

OP = "gated_delta_rule"
_L2_EPS = 1e-6  # HF l2norm (the FLA library's): x * rsqrt(sum(x^2) + 1e-6)


def _heads(
    xp: Namespace, q: Array, k: Array, v: Array, g: Array, beta: Array, *, qk_l2_norm: bool,
    scale: float,
) -> tuple[Array, ...]:  # fmt: skip
    """The inputs in the compute dtype, as ``(B, H, L, ...)``: q and k repeated to the ``H``
    value heads (each key head serves ``H / H_k`` consecutive value heads), normalised, scaled."""
    c = compute_dtype(xp, q.dtype)
    q, k, v, g, beta = (xp.astype(a, c) for a in (q, k, v, g, beta))
    B, L, h_k, d_k = k.shape
    H = v.shape[2]
    if h_k != H:  # (B, L, H_k, D_k) -> (B, L, H_k, H / H_k, D_k) -> (B, L, H, D_k)
        q, k = (
            xp.reshape(xp.broadcast_to(a[:, :, :, None, :], (B, L, h_k, H // h_k, d_k)),
                       (B, L, H, d_k))
            for a in (q, k)
        )  # fmt: skip
    if qk_l2_norm:
        q, k = (a / xp.sqrt(xp.sum(a * a, axis=-1, keepdims=True) + _L2_EPS) for a in (q, k))
    q = q * scale
    q, k, v = (xp.permute_dims(a, (0, 2, 1, 3)) for a in (q, k, v))  # (B, H, L, D)
    return q, k, v, xp.permute_dims(g, (0, 2, 1)), xp.permute_dims(beta, (0, 2, 1))  # (B, H, L)


def _finish(xp: Namespace, o: Array, states: Array, dtype: Any) -> tuple[Array, Array]:
    return xp.astype(xp.permute_dims(o, (0, 2, 1, 3)), dtype), states  # o: (B, L, H, D_v)


@portable(OP, RECURRENT, pure=True)
def _recurrent(
    xp: Namespace, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, *,
    qk_l2_norm: bool, scale: float, chunk_size: int, all_states: bool,
) -> tuple[Array, Array]:  # fmt: skip
    dtype = q.dtype
    q, k, v, g, beta = _heads(xp, q, k, v, g, beta, qk_l2_norm=qk_l2_norm, scale=scale)
    S = state  # (B, H, D_k, D_v)
    outs, kept = [], []
    for t in range(q.shape[2]):
        S = S * xp.exp(g[:, :, t])[:, :, None, None]
        k_t = k[:, :, t, :]  # (B, H, D_k)
        predicted = xp.sum(S * k_t[:, :, :, None], axis=-2)  # (B, H, D_v)
        delta = (v[:, :, t, :] - predicted) * beta[:, :, t, None]
        S = S + k_t[:, :, :, None] * delta[:, :, None, :]
        outs.append(xp.sum(S * q[:, :, t, :, None], axis=-2))  # (B, H, D_v)
        kept.append(S)
    states = xp.stack(kept, axis=1) if all_states else S  # (B, L, H, D_k, D_v) | (B, H, ..)
    return _finish(xp, xp.stack(outs, axis=2), states, dtype)


def _solve_unit_lower(xp: Namespace, A: Array, R: Array) -> Array:
    """``X`` with ``(I + A) X = R`` for strictly lower ``A`` ``(.., C, C)``: forward
    substitution, one row at a time (the UT transform)."""
    X = R[..., :1, :]
    for i in range(1, A.shape[-1]):
        row = R[..., i : i + 1, :] - A[..., i : i + 1, :i] @ X  # (.., 1, F)
        X = xp.concat([X, row], axis=-2)
    return X


@portable(OP, pure=True)
def _chunked(
    xp: Namespace, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, *,
    qk_l2_norm: bool, scale: float, chunk_size: int, all_states: bool,
) -> tuple[Array, Array]:  # fmt: skip
    dtype = q.dtype
    q, k, v, g, beta = _heads(xp, q, k, v, g, beta, qk_l2_norm=qk_l2_norm, scale=scale)
    L, d_v = q.shape[2], v.shape[3]
    S = state  # (B, H, D_k, D_v)
    outs, kept = [], []
    for start in range(0, L, chunk_size):  # the last chunk may be shorter: no padding
        end = min(start + chunk_size, L)
        qs, ks, vs = (a[:, :, start:end, :] for a in (q, k, v))  # (B, H, C, D)
        bs = beta[:, :, start:end, None]  # (B, H, C, 1)
        G = xp.cumulative_sum(g[:, :, start:end], axis=-1)  # (B, H, C): log-decay so far
        decay = causal_decay(xp, g[:, :, start:end])  # (B, H, C, C): exp(G_i - G_j), j <= i
        i = xp.arange(end - start, device=creation_device(G))
        strict = xp.where(i[:, None] > i[None, :], decay, 0.0)
        kt = xp.permute_dims(ks, (0, 1, 3, 2))  # (B, H, D_k, C)
        X = _solve_unit_lower(  # the UT transform: [U | W] = (I + A)^-1 [beta v | beta e^G k]
            xp,
            ((ks * bs) @ kt) * strict,
            xp.concat([vs * bs, ks * bs * xp.exp(G)[..., None]], axis=-1),
        )
        v_new = X[..., :d_v] - X[..., d_v:] @ S  # (B, H, C, D_v): what S does not predict
        outs.append((qs * xp.exp(G)[..., None]) @ S + ((qs @ kt) * decay) @ v_new)
        if all_states:  # S after token t: exp(G_t) S + sum_{j <= t} decay_tj k_j v'_j^T
            spread = decay[:, :, :, :, None] * ks[:, :, None, :, :]  # (B, H, C, C, D_k)
            mine = xp.permute_dims(spread, (0, 1, 2, 4, 3)) @ v_new[:, :, None, :, :]
            kept.append(xp.exp(G)[..., None, None] * S[:, :, None, :, :] + mine)
        kd = ks * decay[:, :, -1, :, None]  # (B, H, C, D_k): decayed to the chunk's end
        S = S * xp.exp(G[:, :, -1:])[..., None] + xp.permute_dims(kd, (0, 1, 3, 2)) @ v_new
    if all_states:  # (B, H, L, D_k, D_v) -> (B, L, H, D_k, D_v)
        S = xp.permute_dims(xp.concat(kept, axis=2), (0, 2, 1, 3, 4))
    return _finish(xp, xp.concat(outs, axis=2), S, dtype)


auto_portable(OP)(one_token_is_recurrent)


# Over 80 lines for its docstring (the recurrence, the shapes, the state, both forms: 39 lines);
# the code is ~40 lines of checks and one dispatch.
def gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    /,
    *,
    state: Array | None = None,
    qk_l2_norm: bool = False,
    scale: float | None = None,
    chunk_size: int = 64,
    all_states: bool = False,
    impl: str = "auto",
    backend: str | None = None,
) -> tuple[Array, Array]:
    """The gated delta rule over a sequence, from a state to a state (Qwen3-Next's Gated
    DeltaNet; HF ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule``).

    Per value head: ``S = exp(g_t) S``; ``S = S + k_t (beta_t (v_t - k_t^T S))^T``;
    ``o_t = q_t^T S`` (see :mod:`portable_llm.ops.delta_rule` for the chunked form).

    Parameters
    ----------
    q, k : array, shape ``(B, L, H_k, D_k)``, float dtype
        Queries and keys; each key head serves ``H / H_k`` consecutive value heads (HF's
        ``repeat_interleave``).
    v : array, shape ``(B, L, H, D_v)``, q's dtype
    g : array, shape ``(B, L, H)``
        Log-decay per token and value head, ``<= 0`` (Qwen3-Next: ``-exp(A_log) *
        softplus(a + dt_bias)``); any float dtype.
    beta : array, shape ``(B, L, H)``
        Write strength per token and value head (Qwen3-Next: ``sigmoid(b)``); any float dtype.
    state : array, shape ``(B, H, D_k, D_v)``, optional
        The state before the first token (zeros when ``None``); any float dtype.
    qk_l2_norm : bool
        L2-normalise q and k over ``D_k`` first (``x / sqrt(sum(x^2) + 1e-6)``, HF's
        ``use_qk_l2norm_in_kernel``; Qwen3-Next sets it).
    scale : float, optional
        Multiplies q (after the norm); default ``D_k ** -0.5``, as HF.
    chunk_size : int
        Tokens per chunk of the chunked form (HF: 64); the result does not depend on it.
    all_states : bool
        Return the state after every token, ``(B, L, H, D_k, D_v)``, instead of the last one.
    impl : {"auto", "portable", "recurrent"}
        ``"portable"``: the chunked (WY/UT) form; ``"recurrent"``: token by token. ``"auto"``:
        recurrent for one token, chunked otherwise. No backend has a kernel in its public API.
    backend : str, optional

    Returns
    -------
    (o, state) : arrays
        ``o`` ``(B, L, H, D_v)`` in q's dtype; the state ``(B, H, D_k, D_v)`` in float32
        (float64 for float64 q). Everything runs in that dtype; ``o`` is rounded once.
    """
    bk, (q, k, v, g, beta, state) = resolve(OP, backend, q, k, v, g, beta, state)
    check_dims(OP, "q", q, "(B, L, H_k, D_k)", (None,) * 4, bk)
    B, L, h_k, d_k = q.shape
    check_dims(OP, "k", k, "(B, L, H_k, D_k)", (B, L, h_k, d_k), bk)
    check_dims(OP, "v", v, "(B, L, H, D_v)", (B, L, None, None), bk)
    H, d_v = v.shape[2:]
    if L < 1 or H % h_k:
        raise ValueError(
            f"{OP}: need L >= 1 and H_k dividing H (each key head serves H / H_k value heads); "
            f"got q {tuple(q.shape)}, v {tuple(v.shape)}"
        )
    check_same_dtype(OP, bk, q=q, k=k, v=v)
    check_dims(OP, "g", g, "(B, L, H)", (B, L, H), bk)
    check_dims(OP, "beta", beta, "(B, L, H)", (B, L, H), bk)
    state = check_state(OP, bk, state, (B, H, d_k, d_v), "(B, H, D_k, D_v)", q)

    def choose(op: str, *args: Any, **options: Any) -> Any:
        return pick(bk, op, impl, *args, **options)

    return gated_delta_rule_body(
        bk.xp, choose, q, k, v, g, beta, state=state,
        qk_l2_norm=check_bool(OP, "qk_l2_norm", qk_l2_norm),
        scale=None if scale is None else check_real(OP, "scale", scale),
        chunk_size=check_int(OP, "chunk_size", chunk_size, low=1),
        all_states=check_bool(OP, "all_states", all_states),
    )  # fmt: skip


def gated_delta_rule_body(
    xp: Namespace, choose: Any, q: Array, k: Array, v: Array, g: Array, beta: Array, *,
    state: Array | None, qk_l2_norm: bool, scale: float | None, chunk_size: int = 64,
    all_states: bool = False,
) -> tuple[Array, Array]:  # fmt: skip
    """The gated delta rule of checked arguments: the body of :func:`gated_delta_rule` and of
    a model's layers (Qwen3-Next's Gated DeltaNet).

    ``choose(op, *args, **options)``: the kernel of ``gated_delta_rule`` for these arguments
    (the public op's :func:`~portable_llm.core.dispatch.pick` of its ``impl``; a model's
    ``kn.choose``: the chunked form for a prompt, the recurrent one for one token). ``state``
    ``(B, H, D_k, D_v)`` in any float dtype, or ``None`` (zeros); ``scale`` ``None``:
    ``D_k ** -0.5``. Returns ``(o, state)`` as :func:`gated_delta_rule`.
    """
    B, d_k, (H, d_v) = q.shape[0], q.shape[3], v.shape[2:]
    c = compute_dtype(xp, q.dtype)
    if state is None:
        state = xp.zeros((B, H, d_k, d_v), dtype=c, device=creation_device(q))
    else:
        state = xp.astype(state, c)
    opts = {
        "qk_l2_norm": qk_l2_norm, "scale": d_k**-0.5 if scale is None else scale,
        "chunk_size": chunk_size, "all_states": all_states,
    }  # fmt: skip
    fn = choose(OP, q, k, v, g, beta, state, **opts)
    out: tuple[Array, Array] = fn(xp, q, k, v, g, beta, state, **opts)
    return out
