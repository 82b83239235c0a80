"""The Mamba-2 mixer (HF ``Mamba2Mixer``; Falcon-H1's ``FalconH1Mixer`` with its multipliers):
one projection into a gate, the convolved inputs and the time steps, the selective scan, a gated
RMSNorm (or a plain SiLU gate), one projection out. Read top-down, per layer::

    h          = x * in_multiplier                        # Falcon-H1's ssm_in_multiplier
    z, xBC, dt = split(in_proj(h) * mup)                  # (I | I + 2 G N | H)
    xBC, conv  = short_conv(xBC, conv, state=conv, activation="silu")
    x_, B, C   = split(xBC)                               # (I | G N | G N)
    y, ssm     = ssd_scan(x_, dt, A, B, C, D=D, dt_bias=dt_bias, state=ssm)
    y          = gated_rms_norm(y, z, norm)  or  y * silu(z)
    out        = out_proj(y)

``I`` is the mixer's inner width (``H`` heads of ``P`` features), ``G`` the groups of ``B`` and
``C`` and ``N`` the state size. The state a call carries to the next is ``(conv, ssm)``: the last
``K - 1`` inputs of the convolution ``(B, K - 1, I + 2 G N)`` and the scan's ``(B, H, P, N)``
(see :mod:`portable_llm.caches.recurrent` for keeping them in a cache).

:func:`mamba2_body` is the body a model's layers call (through its kernel set);
:func:`mamba2_mixer` is the public front that checks its arguments first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from portable_llm.backends import Backend, resolve
from portable_llm.core.checks import (
    check_bool,
    check_float,
    check_int,
    check_real,
    float_compute_dtype,
)
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.affine import times
from portable_llm.ops.gated_norm import OP as GATED_NORM
from portable_llm.ops.kernels import Kernels, KernelSet
from portable_llm.ops.quant import QuantizedWeight
from portable_llm.ops.recurrent import check_dims
from portable_llm.ops.short_conv import short_conv_body
from portable_llm.ops.ssd import check_dt_limit, ssd_scan_body

__all__ = ["Mamba2Weights", "mamba2_body", "mamba2_mixer"]

OP = "mamba2_mixer"


@dataclass(frozen=True)
class Mamba2Weights:
    """One Mamba-2 mixer's weights (HF names in the comments) and the options it runs with.

    ``I = H * P`` (``Di`` in the code); ``C = I + 2 G N`` (the convolved channels: ``x``,
    ``B`` and ``C``).
    """

    in_proj: Any  # (I + C + H, E): in_proj.weight
    conv: Any  # (C, K): conv1d.weight squeezed
    A: Any  # (H,): -exp(A_log), float32
    D: Any  # (H,)
    dt_bias: Any  # (H,)
    out_proj: Any  # (E, I)
    n_groups: int  # G
    head_dim: int  # P
    in_bias: Any = None  # (I + C + H,)
    conv_bias: Any = None  # (C,)
    out_bias: Any = None  # (E,)
    norm: Any = None  # (I,): the gated RMSNorm's weight; None: y * silu(z) (Falcon-H1's default)
    norm_before_gate: bool = True
    eps: float = 1e-6
    mup: Any = None  # (I + C + H,): Falcon-H1's ssm_multipliers, spread over in_proj's outputs
    in_multiplier: float = 1.0  # Falcon-H1's ssm_in_multiplier
    dt_limit: tuple[float, float] = (0.0, math.inf)  # HF time_step_limit
    chunk_size: int = 256

    @property
    def num_heads(self) -> int:
        """``H``."""
        return int(self.A.shape[0])

    @property
    def inner(self) -> int:
        """``I = H * P``."""
        return self.num_heads * self.head_dim

    @property
    def state_size(self) -> int:
        """``N``."""
        return (int(self.conv.shape[0]) - self.inner) // (2 * self.n_groups)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One row's state shapes: the convolution's ``(K - 1, C)`` and the scan's
        ``(H, P, N)`` (a :class:`~portable_llm.caches.recurrent.RecurrentSlots`' ``shapes``)."""
        C, K = (int(d) for d in self.conv.shape)
        return (K - 1, C), (self.num_heads, self.head_dim, self.state_size)


def mamba2_body(
    xp: Namespace, kn: KernelSet, x: Array, w: Mamba2Weights, state: tuple[Any, Any] | None,
    *, all_states: bool = False, mask: Array | None = None,
) -> tuple[Array, tuple[Array, Array]]:  # fmt: skip
    """The mixer of checked arguments: the body of :func:`mamba2_mixer` and of a model's
    layers (see the module docstring for the recipe).

    ``x`` ``(B, L, E)``; ``state`` ``(conv, ssm)`` or ``None`` (zeros); ``mask`` ``(B, L)``
    (1 for a token, 0 for padding, in x's dtype): zeroes padded tokens' inputs, convolution
    inputs and convolved inputs (HF ``apply_mask_to_padding_states`` before the projection and
    after the convolution), so that left padding leaves the state zero: a padded row equals the
    row alone. (HF does not zero the convolution's inputs, so with an ``in_proj`` bias its pads
    leave that bias in the window; here they do not.)
    Returns ``(out (B, L, E), (conv, ssm))``, the states after every token with ``all_states``.
    """
    b, L, _ = x.shape
    Di, H, P, G, N = w.inner, w.num_heads, w.head_dim, w.n_groups, w.state_size
    conv_state, ssm_state = (None, None) if state is None else state
    if mask is not None:
        x = x * mask[:, :, None]
    h = x if w.in_multiplier == 1.0 else times(xp, x, w.in_multiplier)
    proj = kn.project(xp, h, w.in_proj, w.in_bias)  # (B, L, I + C + H)
    if w.mup is not None:
        proj = proj * w.mup
    C = Di + 2 * G * N
    z, xBC, dt = proj[:, :, :Di], proj[:, :, Di : Di + C], proj[:, :, Di + C :]
    if mask is not None:  # in_proj's bias at the pads: kept out of the convolution's window
        xBC = xBC * mask[:, :, None]
    xBC, conv_state = short_conv_body(
        xp, kn.choose, xBC, w.conv, bias=w.conv_bias, state=conv_state, silu=True,
        all_states=all_states,
    )  # fmt: skip
    if mask is not None:
        xBC = xBC * mask[:, :, None]
    xs = xp.reshape(xBC[:, :, :Di], (b, L, H, P))
    Bm = xp.reshape(xBC[:, :, Di : Di + G * N], (b, L, G, N))
    Cm = xp.reshape(xBC[:, :, Di + G * N :], (b, L, G, N))
    gate_in_scan = w.norm is None  # the plain gate: in the scan's float32, before its rounding
    y, ssm_state = ssd_scan_body(
        xp, kn.choose, xs, dt, w.A, Bm, Cm, D=w.D, dt_bias=w.dt_bias,
        z=xp.reshape(z, (b, L, H, P)) if gate_in_scan else None, dt_limit=w.dt_limit,
        state=ssm_state, chunk_size=w.chunk_size, all_states=all_states,
    )  # fmt: skip
    y = xp.reshape(y, (b, L, Di))
    if not gate_in_scan:
        opts = {"eps": w.eps, "n_groups": G, "norm_before_gate": w.norm_before_gate}
        y = kn.choose(GATED_NORM, y, z, w.norm, **opts)(xp, y, z, w.norm, **opts)
    return kn.project(xp, y, w.out_proj, w.out_bias), (conv_state, ssm_state)


def mamba2_mixer(
    x: Array,
    weights: Mamba2Weights,
    /,
    *,
    state: tuple[Array, Array] | None = None,
    all_states: bool = False,
    mask: Array | None = None,
    backend: str | None = None,
) -> tuple[Array, tuple[Array, Array]]:
    """The Mamba-2 mixer over a sequence, from a state to a state (see
    :mod:`portable_llm.ops.mamba2` for the recipe).

    Parameters
    ----------
    x : array, shape ``(B, L, E)``, float dtype
        The layer's normed input.
    weights : Mamba2Weights
        Its arrays in any float dtype (cast to ``x``'s, the mixed-precision rule; ``A`` stays
        float32); ``in_proj`` and ``out_proj`` may be a :class:`~portable_llm.QuantizedWeight`
        (:func:`~portable_llm.quantized_linear`'s product); shapes checked against ``x``.
    state : (conv, ssm), optional
        ``(B, K - 1, C)`` and ``(B, H, P, N)``: the state after the tokens before ``x``
        (zeros when ``None``: the start of a sequence).
    all_states : bool
        Return the states after every token, ``(B, L, K - 1, C)`` and ``(B, L, H, P, N)``
        (what a cache keeps to rewind speculative tokens).
    mask : array, shape ``(B, L)``, optional
        1 for a token, 0 for a (left) pad, any real dtype.
    backend : str, optional

    Returns
    -------
    (out, (conv, ssm)) : arrays
        ``out`` ``(B, L, E)`` in x's dtype; the convolution's state in x's dtype (its inputs,
        exact), the scan's in float32 (float64 for float64 ``x``).
    """
    if state is not None and (not isinstance(state, tuple | list) or len(state) != 2):
        raise TypeError(f"{OP}: state must be a pair (conv, ssm), got {type(state).__name__}")
    conv_state, ssm_state = (None, None) if state is None else state
    arrays = (x, mask, conv_state, ssm_state)
    bk, (x, mask, conv_state, ssm_state) = resolve(OP, backend, *arrays)
    check_bool(OP, "all_states", all_states)
    w = _checked_weights(bk, x, weights)
    b, (C, K) = int(x.shape[0]), (int(d) for d in w.conv.shape)
    if conv_state is not None:
        check_dims(OP, "state[0]", conv_state, "(B, K - 1, C)", (b, K - 1, C), bk)
    if ssm_state is not None:
        want = (b, w.num_heads, w.head_dim, w.state_size)
        check_dims(OP, "state[1]", ssm_state, "(B, H, P, N)", want, bk)
    if mask is not None:
        if tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"{OP}: mask must have shape (B, L) = {tuple(x.shape[:2])}, got "
                             f"{tuple(mask.shape)}")  # fmt: skip
        mask = bk.xp.astype(mask, x.dtype)
    s = None if conv_state is None and ssm_state is None else (conv_state, ssm_state)
    kn = Kernels(bk)
    return mamba2_body(bk.xp, kn, x, w, s, all_states=all_states, mask=mask)


def _checked_weights(bk: Backend, x: Array, w: Any) -> Mamba2Weights:
    """``w`` with its shapes checked against ``x`` ``(B, L, E)`` and its arrays in x's dtype
    (``A`` in float32); a ValueError/TypeError naming the array and the shapes."""
    if not isinstance(w, Mamba2Weights):
        raise TypeError(f"{OP}: weights must be a Mamba2Weights, got {type(w).__name__}")
    check_float(OP, "x", x, bk)
    if x.ndim != 3 or x.shape[1] < 1:
        raise ValueError(f"{OP}: x must have shape (B, L, E) with L >= 1, got {tuple(x.shape)}")
    E = int(x.shape[2])
    for name in ("n_groups", "head_dim"):
        check_int(OP, name, getattr(w, name), low=1)
    _, (A, conv) = resolve(OP, bk, w.A, w.conv)
    check_float(OP, "A", A, bk)
    check_float(OP, "conv", conv, bk)
    H, P, G = int(A.shape[0]) if A.ndim == 1 else 0, w.head_dim, w.n_groups
    if H < 1 or P < 1 or G < 1 or H % G or conv.ndim != 2:
        raise ValueError(
            f"{OP}: need A (H,) with H >= 1, head_dim >= 1, n_groups dividing H and conv (C, K); "
            f"got A {tuple(A.shape)}, head_dim={P}, n_groups={G}, conv {tuple(conv.shape)}"
        )
    C = int(conv.shape[0])
    Di = H * P
    if Di >= C or (C - Di) % (2 * G):
        raise ValueError(f"{OP}: conv must have C = H * P + 2 n_groups N = {Di} + {2 * G} N rows, "
                         f"got {C}")  # fmt: skip
    want = {
        "in_proj": (Di + C + H, E), "out_proj": (E, Di), "D": (H,), "dt_bias": (H,),
        "in_bias": (Di + C + H,), "conv_bias": (C,), "out_bias": (E,), "norm": (Di,),
        "mup": (Di + C + H,),
    }  # fmt: skip
    cast: dict[str, Any] = {}
    for name, shape in want.items():
        t = getattr(w, name)
        if t is None:
            continue
        if name in ("in_proj", "out_proj") and isinstance(t, QuantizedWeight):
            _check_quantized(bk, name, t, shape)  # computes in x's dtype itself
            continue
        _, (t,) = resolve(OP, bk, t)
        check_float(OP, name, t, bk)
        if tuple(t.shape) != shape:
            raise ValueError(f"{OP}: {name} must have shape {shape} for x {tuple(x.shape)}, "
                             f"H={H}, P={P}, C={C}; got {tuple(t.shape)}")  # fmt: skip
        cast[name] = t if t.dtype == x.dtype else bk.astype(t, x.dtype)
    cast["A"] = bk.astype(A, float_compute_dtype(bk.xp, x.dtype))  # HF: -exp(A_log.float())
    cast["conv"] = conv if conv.dtype == x.dtype else bk.astype(conv, x.dtype)
    if w.norm is not None and Di % G:
        raise ValueError(f"{OP}: n_groups={G} must divide the inner width {Di}")
    return Mamba2Weights(**{**w.__dict__, **cast, **_checked_options(w)})


def _check_quantized(bk: Backend, name: str, t: QuantizedWeight, shape: tuple[int, ...]) -> None:
    """A quantized projection of ``bk`` of ``shape`` (its dequantized one); else an error."""
    if t.backend is not bk:
        raise TypeError(f"{OP}: {name} is a QuantizedWeight of {t.backend.name}, x of {bk.name}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{OP}: {name} must have shape {shape}, got a QuantizedWeight of "
                         f"{tuple(t.shape)}")  # fmt: skip


def _checked_options(w: Mamba2Weights) -> dict[str, Any]:
    """The weights' options, checked (a TypeError/ValueError naming the field)."""
    return {
        "n_groups": check_int(OP, "n_groups", w.n_groups, low=1),
        "head_dim": check_int(OP, "head_dim", w.head_dim, low=1),
        "norm_before_gate": check_bool(OP, "norm_before_gate", w.norm_before_gate),
        "eps": check_real(OP, "eps", w.eps, low=0.0),
        "in_multiplier": check_real(OP, "in_multiplier", w.in_multiplier),
        "dt_limit": check_dt_limit(OP, w.dt_limit),
        "chunk_size": check_int(OP, "chunk_size", w.chunk_size, low=1),
    }
