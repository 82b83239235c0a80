"""The short causal depthwise convolution of LFM2 (``Lfm2ShortConv.conv``) and Mamba/Mamba-2
(``conv1d``), with its rolling state.

Channel ``c`` of the output at token ``t`` is a ``K``-tap filter over that channel's last ``K``
inputs, the state's ``K - 1`` held inputs first::

    u = concat(state, x)                         # (B, K - 1 + L, C) along the tokens
    y[b, t, c] = act(bias[c] + sum_j weight[c, j] * u[b, t + j, c])
    new_state  = u[:, L:, :]                     # the last K - 1 inputs

Every implementation is ``fn(xp, u, weight) -> y`` before the bias, in float32 (float64 for
float64 ``u``): the state is joined once, and the bias, activation and rounding applied once, in
the public function. The ``"portable"`` one sums the ``K`` shifted slices (the whole sequence
at once), the ``"recurrent"`` one rolls a ``K``-token window one token at a time (decode);
torch, JAX and MLX run the sum as their grouped convolution (``native``, for ``L > 1``).
"""

from __future__ import annotations

from typing import Any

from portable_llm.backends import resolve
from portable_llm.core.arrays import creation_device
from portable_llm.core.checks import check_bool, check_int, float_compute_dtype, match_weight
from portable_llm.core.dispatch import auto_portable, pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.activations import logistic
from portable_llm.ops.recurrent import RECURRENT, check_dims

__all__ = ["CONV_ACTIVATIONS", "short_conv", "short_conv_body"]

OP = "short_conv"

#: ``activation=`` values: none (LFM2) or SiLU (Mamba, Mamba-2, Qwen3-Next's conv).
CONV_ACTIVATIONS = (None, "silu", "swish")


def _finish(xp: Namespace, y: Array, bias: Array | None, silu: bool, dtype: Any) -> Array:
    """The bias, the activation and the one rounding to ``dtype`` of the float32 (float64)
    convolution ``y`` any implementation returns."""
    if bias is not None:
        y = y + xp.astype(bias, y.dtype)
    if silu:
        y = y * logistic(xp, y)
    return xp.astype(y, dtype)


@portable(OP, pure=True)
def _short_conv(xp: Namespace, u: Array, weight: Array) -> Array:
    compute = float_compute_dtype(xp, u.dtype)
    uc, w = xp.astype(u, compute), xp.astype(weight, compute)
    K = w.shape[1]
    L = u.shape[1] - (K - 1)
    y = uc[:, :L, :] * w[:, 0]  # (B, L, C): tap 0 sees the oldest input
    for j in range(1, K):
        y = y + uc[:, j : j + L, :] * w[:, j]
    return y


@portable(OP, RECURRENT, pure=True)
def _short_conv_steps(xp: Namespace, u: Array, weight: Array) -> Array:
    compute = float_compute_dtype(xp, u.dtype)
    uc, wt = xp.astype(u, compute), xp.permute_dims(xp.astype(weight, compute), (1, 0))  # (K, C)
    K = wt.shape[0]
    window = uc[:, : K - 1, :]  # (B, K - 1, C): the state
    outs = []
    for t in range(u.shape[1] - (K - 1)):
        full = xp.concat([window, uc[:, K - 1 + t : K + t, :]], axis=1)  # (B, K, C)
        outs.append(xp.sum(full * wt, axis=1))  # (B, C)
        window = full[:, 1:, :]
    return xp.stack(outs, axis=1)


@auto_portable(OP)
def _one_token(u: Array, weight: Array, *_: Any, **__: Any) -> str:
    return RECURRENT if u.shape[1] == weight.shape[1] else "portable"  # L == 1


def short_conv(
    x: Array,
    weight: Array,
    /,
    *,
    bias: Array | None = None,
    state: Array | None = None,
    activation: str | None = None,
    all_states: bool = False,
    impl: str = "auto",
    backend: str | None = None,
) -> tuple[Array, Array]:
    """Causal depthwise convolution of ``K`` taps over the tokens, with its rolling state.

    ``y[b, t, c] = act(bias[c] + sum_j weight[c, j] * u[b, t + j, c])`` where ``u =
    concat(state, x)`` along the tokens (HF ``causal_conv1d_fn`` / ``causal_conv1d_update``:
    LFM2's ``conv``, Mamba's ``conv1d``, Qwen3-Next's ``conv1d``).

    Parameters
    ----------
    x : array, shape ``(B, L, C)``, float dtype
        Tokens along axis 1, channels last (HF's layout transposed).
    weight : array, shape ``(C, K)``, float dtype
        HF ``conv.weight.squeeze(1)``: ``weight[c, K - 1]`` multiplies the newest input. Cast
        to ``x``'s dtype when it differs (the mixed-precision rule of every op with weights).
    bias : array, shape ``(C,)``, optional
        Cast as ``weight``.
    state : array, shape ``(B, K - 1, C)``, optional
        The last ``K - 1`` inputs before ``x`` (oldest first); zeros when ``None`` (the start of
        a sequence). Any float dtype: cast to ``x``'s.
    activation : {None, "silu", "swish"}
        Applied after the bias (Mamba: ``"silu"``; LFM2: ``None``).
    all_states : bool
        Return the state after every token, ``(B, L, K - 1, C)``, instead of the last one (what a
        cache keeps to rewind speculative tokens).
    impl : {"auto", "portable", "recurrent", "native"}
        ``"portable"``: the ``K`` shifted slices summed over the whole sequence;
        ``"recurrent"``: one token at a time through a rolling window (decode); ``"native"``:
        the backend's grouped convolution (``F.conv1d(groups=C)``,
        ``lax.conv_general_dilated(feature_group_count=C)``, ``mx.conv1d(groups=C)``).
        ``"auto"``: native where the backend has it for ``L > 1``, recurrent for one token.
    backend : str, optional

    Returns
    -------
    (y, state) : arrays
        ``y`` ``(B, L, C)`` in ``x``'s dtype, summed in float32 (float64 for float64) and rounded
        once; ``state`` ``(B, K - 1, C)`` (or ``(B, L, K - 1, C)`` with ``all_states``) in
        ``x``'s dtype: the inputs themselves, exact.
    """
    bk, (x, weight, bias, state) = resolve(OP, backend, x, weight, bias, state)
    xp = bk.xp
    check_dims(OP, "x", x, "(B, L, C)", (None, None, None), bk)
    B, L, C = x.shape
    if L < 1:
        raise ValueError(f"{OP}: x must hold at least one token, got shape {tuple(x.shape)}")
    check_dims(OP, "weight", weight, "(C, K)", (C, None), bk)
    K = check_int(OP, "weight.shape[1] (K, the taps)", weight.shape[1], low=1)
    if bias is not None:
        check_dims(OP, "bias", bias, "(C,)", (C,), bk)
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"{OP}: activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    check_bool(OP, "all_states", all_states)
    weight = match_weight(OP, "weight", weight, x, bk)  # the mixed-precision rule
    bias = match_weight(OP, "bias", bias, x, bk)
    if state is not None:
        check_dims(OP, "state", state, "(B, K - 1, C)", (B, K - 1, C), bk)

    def choose(op: str, *args: Any) -> Any:
        return pick(bk, op, impl, *args)

    return short_conv_body(
        xp, choose, x, weight, bias=bias, state=state, silu=activation is not None,
        all_states=all_states,
    )  # fmt: skip


def short_conv_body(
    xp: Namespace, choose: Any, x: Array, weight: Array, *, bias: Array | None,
    state: Array | None, silu: bool, all_states: bool,
) -> tuple[Array, Array]:  # fmt: skip
    """The convolution of checked arguments: the body of :func:`short_conv` and of a model's
    layers (LFM2's ``conv``, a recurrent mixer's).

    ``choose(op, u, weight)``: the kernel of ``short_conv`` for the joined inputs ``u``
    ``(B, K - 1 + L, C)`` (the public op's :func:`~portable_llm.core.dispatch.pick` of its
    ``impl``; a model's ``kn.choose``). ``x`` ``(B, L, C)``; ``weight`` ``(C, K)`` and ``bias``
    ``(C,)`` of ``x``'s dtype; ``state`` ``(B, K - 1, C)`` or ``None`` (zeros; another float
    dtype is cast); ``silu``: the activation. Returns ``(y, state)`` as :func:`short_conv`.
    """
    B, L, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = xp.zeros((B, K - 1, C), dtype=x.dtype, device=creation_device(x))
    else:
        state = xp.astype(state, x.dtype)
    u = xp.concat([state, x], axis=1)  # (B, K - 1 + L, C)
    y = _finish(xp, choose(OP, u, weight)(xp, u, weight), bias, silu, x.dtype)
    if all_states:  # the window after token t: u[:, t + 1 : t + K]
        return y, xp.stack([u[:, t + 1 : t + K, :] for t in range(L)], axis=1)
    return y, u[:, L:, :]
