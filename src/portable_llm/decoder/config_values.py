"""The checked readers of ``config.json`` values: one rule per kind (an int, a real, a bool, a
soft-capping value), each refusing a value of the wrong type or range with a ValueError naming
the key. :mod:`portable_llm.decoder.config` and the family files
(:mod:`portable_llm.decoder.families`) read with them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.core.checks import check_int, check_real

__all__ = ["read_bool", "read_cap", "read_int", "read_real"]


def read_int(d: Mapping[str, Any], key: str, *, required: bool = False, low: int = 1) -> Any:
    value = d.get(key)
    if value is None:
        if required:
            raise ValueError(f"config.json: {key} is missing")
        return None
    try:
        return check_int("config.json", key, value, low=low)
    except TypeError as exc:  # a config value of the wrong type is a ValueError, as the rest
        raise ValueError(str(exc)) from None


def read_real(d: Mapping[str, Any], key: str, default: float, *, low: float, **opts: Any) -> float:
    value = d.get(key)
    if value is None:
        return default
    try:
        return check_real("config.json", key, value, low=low, **opts)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def read_bool(d: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def read_cap(d: Mapping[str, Any], key: str, default: float | None) -> float | None:
    if key in d and d[key] is None:
        return None
    value = d.get(key, default)
    return None if value is None else read_real({key: value}, key, 0.0, low=0.0, low_open=True)
