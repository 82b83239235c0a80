"""The gated RMSNorm of Mamba-2's mixers (HF ``MambaRMSNormGated``, Falcon-H1's
``FalconH1RMSNormGated``, Qwen3-Next's ``Qwen3NextRMSNormGated``): an RMSNorm over groups of
features with a SiLU gate before or after it::

    norm_before_gate:  y = weight * rms(x) * silu(gate)
    otherwise:         y = weight * rms(x * silu(gate))

where ``rms(v)`` divides each group of ``E / n_groups`` features by ``sqrt(mean(v^2) + eps)``
over that group. Everything runs in float32 (float64 for float64 ``x``) and rounds once.
"""

from __future__ import annotations

from portable_llm.backends import resolve
from portable_llm.core.checks import (
    check_bool,
    check_float,
    check_int,
    check_real,
    float_compute_dtype,
    match_weight,
)
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.activations import logistic

__all__ = ["gated_rms_norm"]

OP = "gated_rms_norm"


@portable(OP, pure=True)
def _gated_rms_norm(
    xp: Namespace, x: Array, gate: Array, weight: Array, *, eps: float, n_groups: int,
    norm_before_gate: bool,
) -> Array:  # fmt: skip
    ct = float_compute_dtype(xp, x.dtype)
    xc, g = xp.astype(x, ct), xp.astype(gate, ct)
    silu = g * logistic(xp, g)
    if not norm_before_gate:
        xc = xc * silu
    shape = tuple(x.shape)
    grouped = xp.reshape(xc, (*shape[:-1], n_groups, shape[-1] // n_groups))  # (N.., G, E / G)
    variance = xp.mean(grouped * grouped, axis=-1, keepdims=True)  # (N.., G, 1)
    y = xp.reshape(grouped * (1.0 / xp.sqrt(variance + eps)), shape) * xp.astype(weight, ct)
    if norm_before_gate:
        y = y * silu
    return xp.astype(y, x.dtype)


def gated_rms_norm(
    x: Array,
    gate: Array,
    weight: Array,
    /,
    *,
    eps: float = 1e-6,
    n_groups: int = 1,
    norm_before_gate: bool = True,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """RMSNorm over groups of features, gated by ``silu(gate)`` before or after the norm.

    ``norm_before_gate``: ``weight * rms(x) * silu(gate)``; otherwise
    ``weight * rms(x * silu(gate))``; ``rms`` normalises each of the ``n_groups`` groups of
    ``E / n_groups`` consecutive features by ``sqrt(mean(v**2) + eps)`` over the group (see
    :mod:`portable_llm.ops.gated_norm`).

    Parameters
    ----------
    x : array, shape ``(N.., E)``, float dtype
    gate : array, shape ``(N.., E)``
        Same shape and dtype as ``x`` (Mamba-2's ``z``).
    weight : array, shape ``(E,)``
        Cast to ``x``'s dtype when it differs (the mixed-precision rule).
    eps : float, >= 0
    n_groups : int, >= 1, dividing ``E``
        HF ``n_groups`` (Mamba-2, Falcon-H1: the mixer's ``n_groups``; Qwen3-Next: 1 per head
        row).
    norm_before_gate : bool
        HF's ``norm_before_gate`` (Falcon-H1's ``mamba_norm_before_gate``).
    impl : {"auto", "portable"}
    backend : str, optional

    Returns
    -------
    array, shape ``(N.., E)``, x's dtype
        Computed in float32 (float64 for float64 ``x``), the weight and the gate included, and
        rounded once (HF's order).
    """
    bk, (x, gate, weight) = resolve(OP, backend, x, gate, weight)
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        check_float(OP, name, t, bk)
    if x.ndim < 1 or tuple(gate.shape) != tuple(x.shape) or gate.dtype != x.dtype:
        raise ValueError(
            f"{OP}: gate must have x's shape and dtype, got x {tuple(x.shape)} {x.dtype}, gate "
            f"{tuple(gate.shape)} {gate.dtype}"
        )
    E = x.shape[-1]
    if tuple(weight.shape) != (E,):
        raise ValueError(f"{OP}: weight must have shape ({E},) (x's last dimension), got "
                         f"{tuple(weight.shape)}")  # fmt: skip
    G = check_int(OP, "n_groups", n_groups, low=1)
    if E % G:
        raise ValueError(f"{OP}: n_groups={G} must divide x's last dimension {E}")
    opts = {
        "eps": check_real(OP, "eps", eps, low=0.0),
        "n_groups": G,
        "norm_before_gate": check_bool(OP, "norm_before_gate", norm_before_gate),
    }
    weight = match_weight(OP, "weight", weight, x, bk)
    out: Array = pick(bk, OP, impl, x, gate, weight, **opts)(bk.xp, x, gate, weight, **opts)
    return out
