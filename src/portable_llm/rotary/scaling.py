"""RoPE frequency tables: ``theta_i`` for each HF ``rope_type``, computed the way HF computes them.

HF transformers builds its table (``inv_freq``) in float32 with torch, from Python floats; here it
is built on the host with NumPy, op for op in the same order and dtype (float32; float64 for
float64 inputs), with ``pow`` correctly rounded (:func:`_pow`), so the table matches HF's to the
bit wherever torch's float32 ``pow`` is correctly rounded too (all but about 1% of entries,
measured; elsewhere one ulp). Tables are small (``dims / 2`` entries) and cached.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from portable_llm.core.checks import check_int, check_real

__all__ = ["ROPE_TYPES", "RopeSpec", "check_dims", "inv_freq_table", "rope_spec", "uses_length"]

#: The scaling kinds ``scaling["rope_type"]`` (or ``scaling["type"]``) may name.
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
DEFAULT_BASE = 10000.0


@dataclass(frozen=True)
class RopeSpec:
    """A parsed scaling dict: its kind and the fields its formula reads, HF's defaults filled in."""

    kind: str = "default"
    base: float = DEFAULT_BASE
    factor: float = 1.0
    max_position_embeddings: int | None = None  # dynamic: the length beyond which base grows
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float = 1.0  # yarn, longrope: multiplies cos and sin
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope: divides theta_i up to the original length
    long_factor: tuple[float, ...] = ()  # longrope: divides theta_i beyond it
    partial_rotary_factor: float | None = None  # rope(): dims = int(D * factor) when dims=None


def _number(op: str, kind: str, key: str, value: Any, *, positive: bool = True) -> float:
    v = check_real(f"{op}: scaling {kind!r}", key, value, finite=False)
    if not math.isfinite(v):
        raise ValueError(f"{op}: scaling {kind!r}: {key} must be a finite number, got {value!r}")
    if positive and v <= 0:
        raise ValueError(f"{op}: scaling {kind!r}: {key} must be > 0, got {value!r}")
    return v


def _length(op: str, kind: str, key: str, value: Any) -> int:
    v = check_int(f"{op}: scaling {kind!r}", key, value)
    if v < 1:
        raise ValueError(f"{op}: scaling {kind!r}: {key} must be an int >= 1, got {value!r}")
    return v


def _required(op: str, kind: str, d: Mapping[str, Any], key: str) -> Any:
    if key not in d:
        raise ValueError(
            f"{op}: scaling of type {kind!r} needs the field {key!r} (keys given: {sorted(d)})"
        )
    return d[key]


def rope_spec(
    op: str,
    scaling: Mapping[str, Any] | None,
    *,
    base: float = DEFAULT_BASE,
    max_position_embeddings: int | None = None,
) -> RopeSpec:
    """Parse an HF ``rope_scaling`` / ``rope_parameters`` dict, as it is, into a :class:`RopeSpec`.

    The kind is ``scaling["rope_type"]``, else ``scaling["type"]``, else ``"default"``. Fields HF
    reads from the model config rather than the dict come from the keyword arguments, or from
    the dict under the config's name: ``rope_theta`` (the base; a ``base`` other than the default
    that disagrees is an error), ``max_position_embeddings`` (dynamic; the default of
    ``original_max_position_embeddings`` for llama3, yarn and longrope, as HF's config
    standardisation does; longrope's default ``factor``, over the original length).
    """
    if not check_real(op, "base", base, finite=False) > 1.0:
        raise ValueError(f"{op}: base must be a number > 1, got {base!r}")
    if scaling is None:
        return RopeSpec(base=float(base))
    if not isinstance(scaling, Mapping):
        raise TypeError(f"{op}: scaling must be None or a dict, got {type(scaling).__name__}")
    kind = scaling["rope_type"] if "rope_type" in scaling else scaling.get("type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{op}: unknown scaling type {kind!r}; known types: {', '.join(ROPE_TYPES)}"
        )
    theta = scaling.get("rope_theta")
    if theta is not None:
        theta = _number(op, kind, "rope_theta", theta)
        if base != DEFAULT_BASE and base != theta:
            raise ValueError(f"{op}: base={base!r} disagrees with scaling['rope_theta']={theta!r}")
        base = theta
    mpe = scaling.get("max_position_embeddings")
    if mpe is not None and max_position_embeddings is not None and mpe != max_position_embeddings:
        raise ValueError(
            f"{op}: max_position_embeddings={max_position_embeddings!r} disagrees with "
            f"scaling['max_position_embeddings']={mpe!r}"
        )
    mpe = _length(op, kind, "max_position_embeddings", mpe) if mpe is not None else None
    if max_position_embeddings is not None:
        mpe = _length(op, kind, "max_position_embeddings", max_position_embeddings)
    prf = scaling.get("partial_rotary_factor")
    if prf is not None and not (_number(op, kind, "partial_rotary_factor", prf) <= 1.0):
        raise ValueError(f"{op}: scaling['partial_rotary_factor'] must be in (0, 1], got {prf!r}")
    spec = RopeSpec(kind=kind, base=float(base), partial_rotary_factor=prf)
    if kind == "default":
        return spec
    if kind in ("linear", "dynamic"):
        factor = _number(op, kind, "factor", _required(op, kind, scaling, "factor"))
        if kind == "linear":
            return replace(spec, factor=factor)
        if mpe is None:
            raise ValueError(
                f"{op}: scaling of type 'dynamic' needs max_position_embeddings (the model "
                "config's; pass max_position_embeddings= or put it in the dict)"
            )
        return replace(spec, factor=factor, max_position_embeddings=mpe)
    ompe = scaling.get("original_max_position_embeddings", mpe)  # HF's default: the config's
    if ompe is None:
        raise ValueError(
            f"{op}: scaling of type {kind!r} needs 'original_max_position_embeddings' (or "
            "max_position_embeddings=, its default in HF)"
        )
    ompe = _length(op, kind, "original_max_position_embeddings", ompe)
    if kind == "llama3":
        return _llama3_spec(op, spec, scaling, ompe)
    if kind == "longrope":
        return _longrope(op, spec, scaling, mpe, ompe)
    return _yarn(op, spec, scaling, mpe, ompe)


def _llama3_spec(op: str, spec: RopeSpec, d: Mapping[str, Any], ompe: int) -> RopeSpec:
    fields = ("factor", "low_freq_factor", "high_freq_factor")
    factor, low, high = (_number(op, "llama3", k, _required(op, "llama3", d, k)) for k in fields)
    if low == high:
        raise ValueError(f"{op}: scaling 'llama3': low_freq_factor == high_freq_factor ({low})")
    return replace(
        spec,
        factor=factor,
        original_max_position_embeddings=ompe,
        low_freq_factor=low,
        high_freq_factor=high,
    )


def _yarn(op: str, spec: RopeSpec, d: Mapping[str, Any], mpe: int | None, ompe: int) -> RopeSpec:
    factor = _required(op, "yarn", d, "factor")
    if factor is None:  # HF: the ratio of the extended to the original context (DeepSeek-V3)
        if mpe is None:
            raise ValueError(f"{op}: scaling 'yarn' with factor=None needs max_position_embeddings")
        factor = mpe / ompe
    factor = _number(op, "yarn", "factor", factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = d.get("attention_factor")
    mscale, mscale_all_dim = d.get("mscale"), d.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    return replace(
        spec,
        factor=factor,
        original_max_position_embeddings=ompe,
        attention_factor=_number(op, "yarn", "attention_factor", attention, positive=False),
        beta_fast=_number(op, "yarn", "beta_fast", d.get("beta_fast") or 32),
        beta_slow=_number(op, "yarn", "beta_slow", d.get("beta_slow") or 1),
        truncate=bool(d.get("truncate", True)),
    )


def _longrope(
    op: str, spec: RopeSpec, d: Mapping[str, Any], mpe: int | None, ompe: int
) -> RopeSpec:
    """HF's ``_compute_longrope_parameters``: per-pair factors, and ``attention_factor`` by
    default ``sqrt(1 + ln(factor) / ln(ompe))`` (1 for ``factor <= 1``), where ``factor`` is
    by default ``max_position_embeddings / original_max_position_embeddings`` (Phi-3)."""
    factors: dict[str, tuple[float, ...]] = {}
    for key in ("short_factor", "long_factor"):
        value = _required(op, "longrope", d, key)
        if not isinstance(value, list | tuple) or not value:
            raise ValueError(
                f"{op}: scaling 'longrope': {key} must be a non-empty list of numbers, "
                f"got {value!r}"
            )
        factors[key] = tuple(_number(op, "longrope", f"{key}[{i}]", v) for i, v in enumerate(value))
    attention = d.get("attention_factor")
    factor = d.get("factor")
    if attention is None:
        if factor is None:
            if mpe is None:
                raise ValueError(
                    f"{op}: scaling 'longrope' without 'factor' or 'attention_factor' needs "
                    "max_position_embeddings (HF's factor: max_position_embeddings / "
                    "original_max_position_embeddings)"
                )
            factor = mpe / ompe
        factor = _number(op, "longrope", "factor", factor)
        if factor > 1.0 and ompe < 2:  # its default attention factor divides by ln(ompe)
            raise ValueError(
                f"{op}: scaling 'longrope': original_max_position_embeddings must be >= 2 for "
                f"the default attention_factor, got {ompe}"
            )
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(ompe))
    return replace(
        spec,
        original_max_position_embeddings=ompe,
        attention_factor=_number(op, "longrope", "attention_factor", attention, positive=False),
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
    )


def check_dims(op: str, spec: RopeSpec, dims: int) -> None:
    """The table's formula is defined for ``dims`` (dynamic divides by ``dims - 2``; longrope
    has one factor per pair)."""
    if spec.kind == "dynamic" and dims <= 2:
        raise ValueError(
            f"{op}: scaling 'dynamic' needs dims > 2 (its exponent is dims / (dims - 2))"
        )
    if spec.kind == "longrope":
        for key in ("short_factor", "long_factor"):
            n = len(getattr(spec, key))
            if n != dims // 2:
                raise ValueError(
                    f"{op}: scaling 'longrope': {key} has {n} entries but the rotated width "
                    f"dims={dims} has {dims // 2} pairs"
                )


def uses_length(spec: RopeSpec) -> bool:
    """Whether the table depends on the sequence length ``max(position) + 1``: ``dynamic``
    (its base grows beyond ``max_position_embeddings``) and ``longrope`` (its long factors
    beyond ``original_max_position_embeddings``), as HF's ``dynamic_rope_update``."""
    return spec.kind in ("dynamic", "longrope")


def inv_freq_table(spec: RopeSpec, dims: int, dtype: str, seq_len: int | None = None) -> np.ndarray:
    """``theta_i`` for ``i < dims / 2`` as a read-only NumPy array of ``dtype`` (float32/float64).

    ``seq_len`` (``max(position) + 1``) matters only for ``dynamic`` and ``longrope``; HF's
    dynamic table stays the initial one up to ``max_position_embeddings`` and is recomputed
    beyond it; longrope's divides by ``short_factor`` up to ``original_max_position_embeddings``
    and by ``long_factor`` beyond it (HF decides per forward, by that forward's positions).
    """
    if spec.kind == "dynamic":
        assert spec.max_position_embeddings is not None
        grown = seq_len is not None and seq_len > spec.max_position_embeddings
        seq_len = seq_len if grown else None
    elif spec.kind == "longrope":  # one table per side of the original length
        ompe = spec.original_max_position_embeddings
        assert ompe is not None
        seq_len = ompe + 1 if seq_len is not None and seq_len > ompe else None
    else:
        seq_len = None
    return _table(spec, dims, dtype, seq_len)


@lru_cache(maxsize=256)
def _table(spec: RopeSpec, dims: int, dtype: str, seq_len: int | None) -> np.ndarray:
    dt = np.dtype(dtype).type
    exponent = np.arange(0, dims, 2).astype(dt) / dims  # HF: arange(0, dim, 2).float() / dim
    kind, base, factor = spec.kind, spec.base, spec.factor
    if kind == "dynamic":
        out = _dynamic(spec, dims, dt, exponent, seq_len)
    elif kind == "yarn":
        out = _yarn_table(spec, dims, dt, exponent)
    elif kind == "longrope":  # HF: 1.0 / (ext_factors * base**inv_freq_shape), float32 factors
        factors = spec.short_factor if seq_len is None else spec.long_factor
        out = 1.0 / (np.asarray(factors, dtype=dt) * _pow(base, exponent))
    else:
        out = 1.0 / _pow(base, exponent)
        if kind == "linear":
            out = out / factor
        elif kind == "llama3":
            out = _llama3(spec, out)
    out = np.asarray(out, dtype=dt)
    out.flags.writeable = False
    return out


def _pow(base: Any, exponent: np.ndarray) -> np.ndarray:
    """``base ** exponent`` correctly rounded to the exponent's dtype (float64, rounded once).

    NumPy's float32 ``pow`` and torch's round differently in up to a fifth of the entries of a
    table; torch's is (nearly) correctly rounded, so this matches HF's ``inv_freq`` in all but
    about one entry in a hundred (measured for bases 1e4, 5e5, 1e6 and D = 64, 80, 96, 128).
    """
    return (np.float64(base) ** exponent.astype(np.float64)).astype(exponent.dtype)


def _rdiv(scalar: float, t: np.ndarray) -> np.ndarray:
    # torch evaluates ``python_scalar / tensor`` as ``reciprocal(tensor) * scalar``; so does HF.
    return (1.0 / t) * scalar


def _dynamic(
    spec: RopeSpec, dims: int, dt: Any, exponent: np.ndarray, seq_len: int | None
) -> np.ndarray:
    mpe, factor = spec.max_position_embeddings, spec.factor
    assert mpe is not None
    if seq_len is None:  # HF's initial table: Python floats, seq_len = max_position_embeddings
        base: Any = spec.base * ((factor * mpe / mpe) - (factor - 1)) ** (dims / (dims - 2))
    else:  # HF's forward: seq_len is a tensor, so the new base is computed in float32
        grown = (factor * dt(seq_len) / mpe - (factor - 1)) ** (dims / (dims - 2))
        base = spec.base * grown
    return 1.0 / _pow(base, exponent)


def _llama3(spec: RopeSpec, inv_freq: np.ndarray) -> np.ndarray:
    factor, old_len = spec.factor, spec.original_max_position_embeddings
    low, high = spec.low_freq_factor, spec.high_freq_factor
    assert old_len is not None
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = _rdiv(2 * math.pi, inv_freq)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (_rdiv(old_len, wavelen) - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn_table(spec: RopeSpec, dims: int, dt: Any, exponent: np.ndarray) -> np.ndarray:
    base, factor, old_len = spec.base, spec.factor, spec.original_max_position_embeddings
    assert old_len is not None

    def correction_dim(rotations: float) -> float:
        return (dims * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # HF: prevent a singularity
    pos_freqs = _pow(base, exponent)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dims // 2, dtype=dt) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
