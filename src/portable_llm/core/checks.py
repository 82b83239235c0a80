"""Argument checks shared by the ops: each error names the op, the argument and the shapes."""

from __future__ import annotations

from typing import Any

from portable_llm.backends._base import FLOAT_DTYPES, Backend


def float_compute_dtype(xp: Any, dtype: Any) -> Any:
    """The dtype reductions accumulate in: float64 for float64 input, float32 otherwise."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def is_half(xp: Any, dtype: Any) -> bool:
    """True for float16 and bfloat16 (the dtypes that are upcast to float32 to accumulate)."""
    return dtype != xp.float32 and dtype != xp.float64


def check_float(op: str, name: str, x: Any, bk: Backend) -> None:
    if x.dtype not in bk.float_set:
        raise TypeError(
            f"{op}: {name} must have a float dtype ({', '.join(bk.float_dtypes())}), "
            f"got {bk.dtype_name(x.dtype)} with shape {tuple(x.shape)}"
        )


def check_ndim(op: str, name: str, x: Any, ndim: int, layout: str) -> None:
    if x.ndim < ndim:
        raise ValueError(
            f"{op}: {name} must have at least {ndim} dimension(s) ({layout}), "
            f"got shape {tuple(x.shape)}"
        )


def check_same_dtype(op: str, bk: Backend, /, **arrays: Any) -> None:
    """All given arrays (``None`` skipped) share one dtype; a TypeError lists them otherwise."""
    given = {k: v for k, v in arrays.items() if v is not None}
    dtypes = {v.dtype for v in given.values()}
    if len(dtypes) > 1:
        listed = ", ".join(f"{k}: {bk.dtype_name(v.dtype)}" for k, v in given.items())
        raise TypeError(f"{op}: arrays must share one dtype, got {listed}")


def check_shape(op: str, name: str, x: Any, expected: tuple[int, ...], why: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{op}: {name} must have shape {expected} ({why}), got {tuple(x.shape)}")


def canonical_float(name: str) -> str:
    if name not in FLOAT_DTYPES:
        raise ValueError(f"expected a float dtype ({', '.join(FLOAT_DTYPES)}), got {name!r}")
    return name
