"""Argument checks shared by the ops: each error names the op, the argument and the shapes."""

from __future__ import annotations

import math
import numbers
from typing import Any

from portable_llm.backends.base import Backend
from portable_llm.core.types import Array, Namespace


def float_compute_dtype(xp: Namespace, dtype: Any) -> Any:
    """The dtype reductions accumulate in: float64 for float64 input, float32 otherwise."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def is_half(xp: Namespace, dtype: Any) -> bool:
    """True for float16 and bfloat16 (the dtypes that are upcast to float32 to accumulate)."""
    return dtype != xp.float32 and dtype != xp.float64


def check_float(op: str, name: str, x: Array, bk: Backend) -> None:
    if x.dtype not in bk.float_set:
        raise TypeError(
            f"{op}: {name} must have a float dtype ({', '.join(bk.float_dtypes())}), "
            f"got {bk.dtype_name(x.dtype)} with shape {tuple(x.shape)}"
        )


def check_ndim(op: str, name: str, x: Array, ndim: int, layout: str) -> None:
    if x.ndim < ndim:
        raise ValueError(
            f"{op}: {name} must have at least {ndim} dimension(s) ({layout}), "
            f"got shape {tuple(x.shape)}"
        )


def check_same_dtype(op: str, bk: Backend, /, **arrays: Array) -> None:
    """All given arrays (``None`` skipped) share one dtype; a TypeError lists them otherwise."""
    given = {k: v for k, v in arrays.items() if v is not None}
    dtypes = {v.dtype for v in given.values()}
    if len(dtypes) > 1:
        listed = ", ".join(f"{k}: {bk.dtype_name(v.dtype)}" for k, v in given.items())
        raise TypeError(f"{op}: arrays must share one dtype, got {listed}")


# -- scalar arguments: one policy everywhere ----------------------------------------------------
# Integers: a Python ``int`` or a NumPy integer scalar (``np.int64(3)``), never a ``bool``, a
# float (``3.0``) or an array. Reals: any of those plus Python/NumPy floats. Both come back as
# Python numbers, so later code (and a JAX trace) never sees a NumPy scalar.


def check_int(
    op: str, name: str, value: Any, *, low: int | None = None, high: int | None = None
) -> int:
    """``value`` as a Python int, or ``TypeError``/``ValueError`` naming ``op`` and ``name``.

    ``low``/``high`` are inclusive bounds (``None``: unbounded).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if (low is not None and v < low) or (high is not None and v > high):
        lo = "" if low is None else f">= {low}"
        hi = "" if high is None else f"<= {high}"
        raise ValueError(f"{op}: {name} must be {' and '.join(s for s in (lo, hi) if s)}, got {v}")
    return v


def check_optional_int(
    op: str, name: str, value: Any, *, low: int | None = None, high: int | None = None
) -> int | None:
    """:func:`check_int` that lets ``None`` through."""
    return None if value is None else check_int(op, name, value, low=low, high=high)


def check_bool(op: str, name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``, else a ``TypeError`` naming ``op`` and ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_real(
    op: str,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a Python float, or ``TypeError``/``ValueError`` naming ``op`` and ``name``.

    Bounds are inclusive unless ``low_open``; NaN is always refused, infinities when ``finite``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    bad = math.isnan(v) or (finite and math.isinf(v))
    if low is not None:
        bad = bad or (v <= low if low_open else v < low)
    if high is not None:
        bad = bad or v > high
    if bad:
        parts = ["finite" if finite else "not NaN"]
        if low is not None:
            parts.append(f"{'>' if low_open else '>='} {low}")
        if high is not None:
            parts.append(f"<= {high}")
        raise ValueError(f"{op}: {name} must be {' and '.join(parts)}, got {value!r}")
    return v


# -- mixed precision: one rule for every op that takes weights ---------------------------------


def match_weight(op: str, name: str, w: Array, x: Array, bk: Backend) -> Array:
    """A float weight ``w`` in the activations' dtype: cast when its float dtype differs.

    The rule of every op that takes weights (``rms_norm``, ``linear``, ``mlp``, ``attention``,
    ``moe``, ``embedding``/``unembed``): the computation runs in ``x``'s dtype, as mlx-lm's
    modules do with float32 weights and float16 activations. Non-float weights are a
    ``TypeError`` (``check_float``); arrays of two libraries never reach here (``resolve``).
    ``None`` passes through.
    """
    if w is None:
        return w
    dtype = w.dtype
    if dtype == x.dtype:
        return w
    check_float(op, name, w, bk)
    return bk.astype(w, x.dtype)
