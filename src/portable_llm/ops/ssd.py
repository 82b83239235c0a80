"""The Mamba-2 selective scan (SSD, the state-space dual) of Mamba-2 and Falcon-H1 (HF
``mamba2_chunk_scan`` / ``mamba2_selective_state_update``; mamba_ssm's
``mamba_chunk_scan_combined`` / ``selective_state_update``).

Per head ``h`` (B/C group ``h // (H / n_groups)``) a state ``S`` ``(P, N)`` runs over the
tokens, with ``dt = softplus(dt + dt_bias)`` (clamped to ``dt_limit`` when one is given)::

    S   = exp(dt_t A_h) S + dt_t x_t B_t^T
    y_t = S C_t + D_h x_t                        # then y_t * silu(z_t) with z

``"recurrent"`` runs exactly that, one token at a time (decode). ``"portable"`` is the chunked
(state-space dual) form: within a chunk, with ``a_i = sum_{j <= i} dt_j A`` the output is a
masked attention ``y_i = sum_{s <= i} (C_i . B_s) exp(a_i - a_s) dt_s x_s`` plus the read of the
chunk's start state ``exp(a_i) C_i S``, and the state moves chunk to chunk as
``S = exp(a_C) S + sum_s exp(a_C - a_s) dt_s x_s B_s^T``.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.backends import Backend, resolve
from portable_llm.core.arrays import creation_device
from portable_llm.core.checks import check_bool, check_int, check_real, check_same_dtype
from portable_llm.core.dispatch import auto_portable, pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.activations import logistic
from portable_llm.ops.recurrent import (
    RECURRENT,
    causal_decay,
    check_dims,
    check_state,
    compute_dtype,
    one_token_is_recurrent,
    softplus,
)

__all__ = ["check_dt_limit", "ssd_scan", "ssd_scan_body"]

OP = "ssd_scan"
_NO_LIMIT = (0.0, math.inf)


def _prepare(
    xp: Namespace, x: Array, dt: Array, A: Array, B_: Array, C_: Array, dt_bias: Array | None,
    *, dt_softplus: bool, dt_limit: tuple[float, float],
) -> tuple[Array, ...]:  # fmt: skip
    """``(a, xdt, B, C)`` in the compute dtype, as ``(B, H, L, ...)``: the log-decays ``dt A``,
    the inputs ``dt x``, and B and C repeated to the ``H`` heads."""
    c = compute_dtype(xp, x.dtype)
    x, dt, A, B_, C_ = (xp.astype(t, c) for t in (x, dt, A, B_, C_))
    if dt_bias is not None:
        dt = dt + xp.astype(dt_bias, c)
    if dt_softplus:
        dt = softplus(xp, dt)
    if dt_limit != _NO_LIMIT:  # as mamba_ssm: the clamp only when a limit is given
        dt = xp.minimum(
            xp.maximum(dt, xp.full_like(dt, dt_limit[0])), xp.full_like(dt, dt_limit[1])
        )
    b, L, H, _ = x.shape
    G, N = B_.shape[2:]
    if G != H:  # (B, L, G, N) -> (B, L, G, H / G, N) -> (B, L, H, N)
        B_, C_ = (
            xp.reshape(xp.broadcast_to(t[:, :, :, None, :], (b, L, G, H // G, N)), (b, L, H, N))
            for t in (B_, C_)
        )
    xdt = x * dt[..., None]
    perm = (0, 2, 1, 3)
    a = xp.permute_dims(dt * A, (0, 2, 1))  # (B, H, L)
    return a, *(xp.permute_dims(t, perm) for t in (xdt, B_, C_))  # (B, H, L, P | N)


def _finish(
    xp: Namespace, y: Array, x: Array, D: Array | None, z: Array | None, states: Array
) -> tuple[Array, Array]:
    """The D skip and the z gate on ``y`` ``(B, H, L, P)``; the result in x's layout and dtype."""
    y = xp.permute_dims(y, (0, 2, 1, 3))  # (B, L, H, P)
    if D is not None:
        y = y + xp.astype(D, y.dtype)[:, None] * xp.astype(x, y.dtype)
    if z is not None:
        zc = xp.astype(z, y.dtype)
        y = y * (zc * logistic(xp, zc))
    return xp.astype(y, x.dtype), states


@portable(OP, RECURRENT, pure=True)
def _recurrent(
    xp: Namespace, x: Array, dt: Array, A: Array, B_: Array, C_: Array, state: Array,
    D: Array | None = None, z: Array | None = None, dt_bias: Array | None = None, *,
    dt_softplus: bool, dt_limit: tuple[float, float], chunk_size: int, all_states: bool,
) -> tuple[Array, Array]:  # fmt: skip
    a, xdt, Bh, Ch = _prepare(xp, x, dt, A, B_, C_, dt_bias, dt_softplus=dt_softplus,
                              dt_limit=dt_limit)  # fmt: skip
    S = state  # (B, H, P, N)
    outs, kept = [], []
    for t in range(a.shape[2]):
        S = S * xp.exp(a[:, :, t])[:, :, None, None] + xdt[:, :, t, :, None] * Bh[:, :, t, None, :]
        outs.append(xp.sum(S * Ch[:, :, t, None, :], axis=-1))  # (B, H, P)
        kept.append(S)
    states = xp.stack(kept, axis=1) if all_states else S
    return _finish(xp, xp.stack(outs, axis=2), x, D, z, states)


@portable(OP, pure=True)
def _chunked(
    xp: Namespace, x: Array, dt: Array, A: Array, B_: Array, C_: Array, state: Array,
    D: Array | None = None, z: Array | None = None, dt_bias: Array | None = None, *,
    dt_softplus: bool, dt_limit: tuple[float, float], chunk_size: int, all_states: bool,
) -> tuple[Array, Array]:  # fmt: skip
    a, xdt, Bh, Ch = _prepare(xp, x, dt, A, B_, C_, dt_bias, dt_softplus=dt_softplus,
                              dt_limit=dt_limit)  # fmt: skip
    L = a.shape[2]
    S = state  # (B, H, P, N)
    outs, kept = [], []
    for start in range(0, L, chunk_size):  # the last chunk may be shorter: no padding
        end = min(start + chunk_size, L)
        cum = xp.cumulative_sum(a[:, :, start:end], axis=-1)  # (B, H, C)
        xs, Bs, Cs = (t[:, :, start:end, :] for t in (xdt, Bh, Ch))  # (B, H, C, P | N)
        decay = causal_decay(xp, a[:, :, start:end])  # (B, H, C, C)
        scores = (Cs @ xp.permute_dims(Bs, (0, 1, 3, 2))) * decay  # (B, H, C, C)
        read = Cs @ xp.permute_dims(S, (0, 1, 3, 2))  # (B, H, C, P): the start state
        outs.append(scores @ xs + xp.exp(cum)[..., None] * read)
        if all_states:  # S after token t: exp(a_t) S + sum_{s <= t} decay_ts dt_s x_s B_s^T
            spread = decay[:, :, :, :, None] * xs[:, :, None, :, :]  # (B, H, C, C, P)
            mine = xp.permute_dims(spread, (0, 1, 2, 4, 3)) @ Bs[:, :, None, :, :]
            kept.append(xp.exp(cum)[..., None, None] * S[:, :, None, :, :] + mine)
        written = xs * decay[:, :, -1, :, None]  # (B, H, C, P): decayed to the chunk's end
        S = S * xp.exp(cum[:, :, -1:])[..., None] + xp.permute_dims(written, (0, 1, 3, 2)) @ Bs
    y = xp.concat(outs, axis=2)  # (B, H, L, P)
    if all_states:  # (B, H, L, P, N) -> (B, L, H, P, N)
        S = xp.permute_dims(xp.concat(kept, axis=2), (0, 2, 1, 3, 4))
    return _finish(xp, y, x, D, z, S)


auto_portable(OP)(one_token_is_recurrent)


def ssd_scan(
    x: Array,
    dt: Array,
    A: Array,
    B: Array,
    C: Array,
    /,
    *,
    D: Array | None = None,
    z: Array | None = None,
    dt_bias: Array | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = _NO_LIMIT,
    state: Array | None = None,
    chunk_size: int = 256,
    all_states: bool = False,
    impl: str = "auto",
    backend: str | None = None,
) -> tuple[Array, Array]:
    """The Mamba-2 selective scan (SSD) over a sequence, from a state to a state.

    ``S = exp(dt_t A) S + dt_t x_t B_t^T``; ``y_t = S C_t + D x_t``, times ``silu(z_t)`` when
    ``z`` is given (see :mod:`portable_llm.ops.ssd` for the chunked form).

    Parameters
    ----------
    x : array, shape ``(B, L, H, P)``, float dtype
        The heads' inputs (``P``: HF ``head_dim``).
    dt : array, shape ``(B, L, H)``
        Time steps before the bias and softplus; any float dtype.
    A : array, shape ``(H,)``
        Per head, negative (HF ``-exp(A_log)``); any float dtype.
    B, C : array, shape ``(B, L, n_groups, N)``
        Input and output projections of the state (``N``: HF ``ssm_state_size``); head ``h``
        uses group ``h // (H / n_groups)``.
    D : array, shape ``(H,)``, optional
        The skip: ``+ D[h] x``.
    z : array, shape ``(B, L, H, P)``, optional
        The gate: ``y * silu(z)`` (mamba_ssm's ``z``; HF's Mamba-2 gates in its norm instead).
    dt_bias : array, shape ``(H,)``, optional
        Added to ``dt`` before the softplus.
    dt_softplus : bool
        Apply ``softplus`` to ``dt + dt_bias`` (HF's layers do).
    dt_limit : (float, float)
        Clamp ``dt`` to ``[lo, hi]`` after the softplus (HF ``time_step_limit``); the default
        ``(0, inf)`` clamps nothing, as in mamba_ssm.
    state : array, shape ``(B, H, P, N)``, optional
        The state before the first token (zeros when ``None``); any float dtype.
    chunk_size : int
        Tokens per chunk of the chunked form (Mamba-2: 256); the result does not depend on it.
    all_states : bool
        Return the state after every token, ``(B, L, H, P, N)``, instead of the last one.
    impl : {"auto", "portable", "recurrent"}
        ``"portable"``: the chunked SSD form; ``"recurrent"``: token by token. ``"auto"``:
        recurrent for one token, chunked otherwise. No backend has a kernel in its public API.
    backend : str, optional

    Returns
    -------
    (y, state) : arrays
        ``y`` ``(B, L, H, P)`` in x's dtype; the state ``(B, H, P, N)`` in float32 (float64 for
        float64 x). Everything runs in that dtype; ``y`` is rounded once.
    """
    bk, arrays = resolve(OP, backend, x, dt, A, B, C, D, z, dt_bias, state)
    x, dt, A, B, C, D, z, dt_bias, state = arrays
    b, H, P, N = _check_arrays(bk, x, dt, A, B, C, D, z, dt_bias)
    state = check_state(OP, bk, state, (b, H, P, N), "(B, H, P, N)", x)
    opts = {
        "dt_softplus": check_bool(OP, "dt_softplus", dt_softplus),
        "dt_limit": check_dt_limit(OP, dt_limit),
        "chunk_size": check_int(OP, "chunk_size", chunk_size, low=1),
        "all_states": check_bool(OP, "all_states", all_states),
    }
    arrays = (x, dt, A, B, C, state, D, z, dt_bias)
    out: tuple[Array, Array] = pick(bk, OP, impl, *arrays, **opts)(bk.xp, *arrays, **opts)
    return out


def ssd_scan_body(
    xp: Namespace, choose: Any, x: Array, dt: Array, A: Array, B: Array, C: Array, *,
    state: Array | None, D: Array | None, z: Array | None, dt_bias: Array | None,
    dt_limit: tuple[float, float], chunk_size: int, all_states: bool,
) -> tuple[Array, Array]:  # fmt: skip
    """The scan of checked arguments (``dt_softplus=True``): the body of a model's layers (a
    Mamba-2 mixer's), as :func:`ssd_scan` computes it. ``choose(op, *arrays, **options)``: the
    implementation (a model's ``kn.choose``: recurrent for one token, chunked otherwise);
    ``state`` ``None``: zeros (another float dtype is cast to the compute dtype)."""
    c = compute_dtype(xp, x.dtype)
    if state is None:
        b, _, H, P = x.shape
        state = xp.zeros((b, H, P, B.shape[-1]), dtype=c, device=creation_device(x))
    else:  # any float dtype, as the public op takes it
        state = xp.astype(state, c)
    opts = {"dt_softplus": True, "dt_limit": dt_limit, "chunk_size": chunk_size,
            "all_states": all_states}  # fmt: skip
    arrays = (x, dt, A, B, C, state, D, z, dt_bias)
    out: tuple[Array, Array] = choose(OP, *arrays, **opts)(xp, *arrays, **opts)
    return out


def _check_arrays(
    bk: Backend, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None,
    z: Array | None, dt_bias: Array | None,
) -> tuple[int, int, int, int]:  # fmt: skip
    """``(B, H, P, N)`` of checked arrays; a ValueError/TypeError naming the one that is not."""
    check_dims(OP, "x", x, "(B, L, H, P)", (None,) * 4, bk)
    b, L, H, P = x.shape
    check_dims(OP, "dt", dt, "(B, L, H)", (b, L, H), bk)
    check_dims(OP, "A", A, "(H,)", (H,), bk)
    check_dims(OP, "B", B, "(B, L, n_groups, N)", (b, L, None, None), bk)
    G, N = B.shape[2:]
    check_dims(OP, "C", C, "(B, L, n_groups, N)", (b, L, G, N), bk)
    if L < 1 or G < 1 or H % G:
        raise ValueError(
            f"{OP}: need L >= 1 and n_groups dividing H (head h uses group h // (H / n_groups)); "
            f"got x {tuple(x.shape)}, B {tuple(B.shape)}"
        )
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_dims(OP, name, t, "(H,)", (H,), bk)
    if z is not None:
        check_dims(OP, "z", z, "(B, L, H, P)", (b, L, H, P), bk)
    check_same_dtype(OP, bk, x=x, z=z)
    return b, H, P, N


def check_dt_limit(op: str, value: Any) -> tuple[float, float]:
    """``dt_limit`` as a pair of floats ``0 <= lo <= hi`` (``hi`` may be infinite); else a
    TypeError/ValueError naming ``op``."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{op}: dt_limit must be a pair (lo, hi), got {value!r}")
    lo = check_real(op, "dt_limit[0]", value[0], low=0.0)
    hi = check_real(op, "dt_limit[1]", value[1], low=lo, finite=False)
    return lo, hi
