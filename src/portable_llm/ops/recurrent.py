"""What the recurrent ops share (:func:`~portable_llm.short_conv`,
:func:`~portable_llm.gated_delta_rule`, :func:`~portable_llm.ssd_scan`): shape checks that name
the dimensions, the state a call starts from, the softplus of Mamba's ``dt`` and the
``impl="auto"`` choice between the chunked form and the step-by-step one.

Each op has two portable implementations, registered under one op name: ``"portable"`` (the
chunked or whole-sequence form, for prefill) and ``"recurrent"`` (one token at a time, for
decode). ``impl="auto"`` takes ``"recurrent"`` for one token and ``"portable"`` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portable_llm.backends import Backend
from portable_llm.core.arrays import creation_device
from portable_llm.core.checks import check_float, float_compute_dtype
from portable_llm.core.types import Array, Namespace

__all__ = [
    "RECURRENT",
    "causal_decay",
    "check_dims",
    "check_state",
    "one_token_is_recurrent",
    "softplus",
]

#: The name of the step-by-step implementation of each recurrent op (``impl="recurrent"``).
RECURRENT = "recurrent"


def one_token_is_recurrent(x: Array, *_: Any, **__: Any) -> str:
    """The ``@auto_portable`` chooser of the recurrent ops: ``x`` is ``(B, L, ...)``."""
    return RECURRENT if x.shape[1] == 1 else "portable"


def check_dims(
    op: str, name: str, x: Array, layout: str, want: Sequence[int | None], bk: Backend
) -> None:
    """``x`` is a float array of ``len(want)`` dimensions whose sizes match ``want`` (``None``:
    any); else a TypeError/ValueError naming ``op``, ``name``, the layout and the shapes."""
    check_float(op, name, x, bk)
    shape = tuple(x.shape)
    if len(shape) != len(want) or any(
        w is not None and w != s for w, s in zip(want, shape, strict=True)
    ):
        expect = tuple("?" if w is None else w for w in want)
        raise ValueError(
            f"{op}: {name} must have shape {layout} = {expect}, got {shape}".replace("'", "")
        )


def check_state(
    op: str, bk: Backend, state: Array | None, shape: tuple[int, ...], layout: str, like: Array
) -> Array:
    """The state a call starts from: ``state`` (any float dtype, checked against ``shape``)
    cast to the compute dtype of ``like`` (the call's first input), or zeros of ``shape`` there
    (on ``like``'s device) when ``None``."""
    xp = bk.xp
    dtype = compute_dtype(xp, like.dtype)
    if state is None:
        return xp.zeros(shape, dtype=dtype, device=bk.device_of(like))
    check_dims(op, "state", state, layout, shape, bk)
    return xp.astype(state, dtype)


def compute_dtype(xp: Namespace, dtype: Any) -> Any:
    """The dtype a recurrence runs in and keeps its state in: float32 (float64 for float64)."""
    return float_compute_dtype(xp, dtype)


def causal_decay(xp: Namespace, a: Array) -> Array:
    """``exp(a_{j+1} + .. + a_i)`` for ``j <= i`` and ``0`` above the diagonal, ``(.., C, C)``,
    of a chunk's per-token log-decays ``a`` ``(.., C)``: the decay from token ``j`` to ``i``.

    Each segment is summed on its own (a cumulative sum down the columns of ``a`` masked to
    ``k > j``, HF Mamba-2's ``segment_sum``), not as a difference of two prefix sums: over a
    64-token chunk the prefix sums reach -200 (``dt A``), and their difference in float32
    loses ~1e-5 of every decay (measured: the chunked scan 13x further from the float64
    reference than the token loop at Mamba-2's sizes, outside float32's tolerance).

    The chunked forms slice each chunk (the last one shorter) rather than zero-pad the
    sequence: a padded version gave wrong outputs under ``jax.jit`` with XLA's CPU flag
    ``--xla_cpu_use_fusion_emitters=false`` (the JAX env's; L = 5 in chunks of 4)."""
    i = xp.arange(a.shape[-1], device=creation_device(a))
    below = i[:, None] > i[None, :]  # (C, C): row k > column j
    seg = xp.cumulative_sum(xp.where(below, a[..., :, None], 0.0), axis=-2)  # sum_{j<k<=i} a_k
    lower = i[:, None] >= i[None, :]
    return xp.where(lower, xp.exp(xp.where(lower, seg, 0.0)), 0.0)


def softplus(xp: Namespace, x: Array) -> Array:
    """``log(1 + exp(x))`` without overflow: ``max(x, 0) + log1p(exp(-|x|))``."""
    return xp.maximum(x, xp.zeros_like(x)) + xp.log1p(xp.exp(-xp.abs(x)))
