"""float64 NumPy references of the recurrent ops, written step by step from the equations (one
token, one row, one head at a time, no chunking): :func:`short_conv`, :func:`gated_delta_rule`,
:func:`ssd_scan`; and the mixer of Mamba-2 over them, :func:`mamba2_mixer` (with its
:func:`gated_rms_norm`). Re-exported by :mod:`portable_llm.testing.reference`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["gated_delta_rule", "gated_rms_norm", "mamba2_mixer", "short_conv", "ssd_scan"]


def _f64(*arrays: Any) -> list[Any]:
    """Each array in float64 (``None`` stays ``None``)."""
    return [None if a is None else np.asarray(a, dtype=np.float64) for a in arrays]


def short_conv(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
    state: np.ndarray | None = None, activation: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(y, state)``: for each row, token and channel, the ``K`` taps over the last ``K``
    inputs (held state first); the state after the last token is its last ``K - 1`` inputs."""
    x, w, bias, state = _f64(x, weight, bias, state)
    B, L, C = x.shape
    K = w.shape[1]
    held = np.zeros((B, K - 1, C)) if state is None else state.copy()
    y = np.zeros((B, L, C))
    for b in range(B):
        window = list(held[b])  # K - 1 vectors (C,), oldest first
        for t in range(L):
            window.append(x[b, t])
            for c in range(C):
                acc = 0.0 if bias is None else bias[c]
                for j in range(K):
                    acc += w[c, j] * window[j][c]
                y[b, t, c] = acc / (1.0 + math.exp(-acc)) if activation else acc
            window.pop(0)
        held[b] = np.array(window).reshape(K - 1, C)
    return y, held


def gated_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
    state: np.ndarray | None = None, qk_l2_norm: bool = False, scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(o, state)`` of the gated delta rule, token by token for each row and value head
    ``h`` (key head ``h // (H / H_k)``): decay, delta update, read."""
    q, k, v, g, beta, state = _f64(q, k, v, g, beta, state)
    B, L, h_k, d_k = q.shape
    H, d_v = v.shape[2:]
    scale = d_k**-0.5 if scale is None else scale
    S_all = np.zeros((B, H, d_k, d_v)) if state is None else state.copy()
    o = np.zeros((B, L, H, d_v))
    for b in range(B):
        for h in range(H):
            kh = h // (H // h_k)
            S = S_all[b, h]
            for t in range(L):
                qt, kt = q[b, t, kh].copy(), k[b, t, kh].copy()
                if qk_l2_norm:
                    qt = qt / math.sqrt(float(qt @ qt) + 1e-6)
                    kt = kt / math.sqrt(float(kt @ kt) + 1e-6)
                qt = qt * scale
                S = math.exp(g[b, t, h]) * S
                delta = beta[b, t, h] * (v[b, t, h] - kt @ S)  # (D_v,)
                S = S + np.outer(kt, delta)
                o[b, t, h] = qt @ S
            S_all[b, h] = S
    return o, S_all


def ssd_scan(
    x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray,
    D: np.ndarray | None = None, z: np.ndarray | None = None, dt_bias: np.ndarray | None = None,
    state: np.ndarray | None = None, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(y, state)`` of the Mamba-2 selective scan, token by token for each row and head
    ``h`` (group ``h // (H / n_groups)``): discretise, update, read, skip, gate."""
    x, dt, A, B, C, D, z, dt_bias, state = _f64(x, dt, A, B, C, D, z, dt_bias, state)
    b_, L, H, P = x.shape
    G, N = B.shape[2:]
    S_all = np.zeros((b_, H, P, N)) if state is None else state.copy()
    y = np.zeros((b_, L, H, P))
    for b in range(b_):
        for h in range(H):
            grp = h // (H // G)
            S = S_all[b, h]
            for t in range(L):
                d = dt[b, t, h] + (0.0 if dt_bias is None else dt_bias[h])
                if dt_softplus:
                    d = math.log1p(math.exp(d)) if d < 30 else d
                if tuple(dt_limit) != (0.0, math.inf):
                    d = min(max(d, dt_limit[0]), dt_limit[1])
                S = math.exp(d * A[h]) * S + d * np.outer(x[b, t, h], B[b, t, grp])
                out = S @ C[b, t, grp] + (0.0 if D is None else D[h] * x[b, t, h])
                if z is not None:
                    zz = z[b, t, h]
                    out = out * zz / (1.0 + np.exp(-zz))
                y[b, t, h] = out
            S_all[b, h] = S
    return y, S_all


def gated_rms_norm(
    x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float = 1e-6, n_groups: int = 1,
    norm_before_gate: bool = True,
) -> np.ndarray:  # fmt: skip
    """The gated RMSNorm, one group of ``E / n_groups`` features at a time: ``weight *
    rms(x) * silu(gate)`` (``norm_before_gate``) or ``weight * rms(x * silu(gate))``."""
    x, gate, weight = _f64(x, gate, weight)
    silu = gate / (1.0 + np.exp(-gate))
    v = x if norm_before_gate else x * silu
    out = np.empty_like(v)
    width = v.shape[-1] // n_groups
    for g in range(n_groups):
        part = v[..., g * width : (g + 1) * width]
        out[..., g * width : (g + 1) * width] = part / np.sqrt(
            np.mean(part**2, axis=-1, keepdims=True) + eps
        )
    out = out * weight
    return out * silu if norm_before_gate else out


def mamba2_mixer(
    x: np.ndarray, w: Any, state: tuple[Any, Any] | None = None
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """``(out, (conv, ssm))`` of the Mamba-2 mixer of the weights ``w`` (a
    :class:`~portable_llm.ops.mamba2.Mamba2Weights` of NumPy arrays), composed of the references
    above in float64: the projection, the multipliers, the convolution, the scan, the gate."""
    x, w_in, b_in, mup, w_out, b_out = _f64(x, w.in_proj, w.in_bias, w.mup, w.out_proj, w.out_bias)
    b, L, _ = x.shape
    H, P, G = int(w.A.shape[0]), w.head_dim, w.n_groups
    Di, C = H * P, int(w.conv.shape[0])
    N = (C - Di) // (2 * G)
    proj = (x * w.in_multiplier) @ w_in.T + (0.0 if b_in is None else b_in)
    proj = proj if mup is None else proj * mup
    z, xBC, dt = proj[..., :Di], proj[..., Di : Di + C], proj[..., Di + C :]
    conv_state, ssm_state = (None, None) if state is None else state
    xBC, conv_state = short_conv(xBC, w.conv, w.conv_bias, conv_state, activation="silu")
    xs = xBC[..., :Di].reshape(b, L, H, P)
    Bm, Cm = (xBC[..., Di + i * G * N : Di + (i + 1) * G * N].reshape(b, L, G, N) for i in (0, 1))
    gate = z.reshape(b, L, H, P) if w.norm is None else None
    y, ssm_state = ssd_scan(xs, dt, w.A, Bm, Cm, D=w.D, z=gate, dt_bias=w.dt_bias,
                            state=ssm_state, dt_limit=w.dt_limit)  # fmt: skip
    y = y.reshape(b, L, Di)
    if w.norm is not None:
        y = gated_rms_norm(y, z, w.norm, w.eps, G, w.norm_before_gate)
    return y @ w_out.T + (0.0 if b_out is None else b_out), (conv_state, ssm_state)
