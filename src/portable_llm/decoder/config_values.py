"""The checked readers of ``config.json`` values: one rule per kind (an int, a real, a bool, a
soft-capping value), each refusing a value of the wrong type or range with a ValueError naming
the key. :mod:`portable_llm.decoder.config` and the family files
(:mod:`portable_llm.decoder.families`) read with them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.core.checks import check_int, check_real

__all__ = [
    "read_bool",
    "read_cap",
    "read_int",
    "read_real",
    "read_rope_layers",
    "read_sparse_layers",
]


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


def read_sparse_layers(d: Mapping[str, Any], n: int, experts: int) -> tuple[bool, ...]:
    """Which of the ``n`` layers are MoE layers, by Qwen2-MoE's and Qwen3-MoE's rule (HF's
    ``DecoderLayer``): every ``decoder_sparse_step``-th layer (1-based) not listed in
    ``mlp_only_layers``, none when ``experts`` is 0."""
    step = read_int(d, "decoder_sparse_step") or 1
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list | tuple):
        raise ValueError(f"config.json: mlp_only_layers must be a list of ints, got {only!r}")
    dense = {read_int({"mlp_only_layers": i}, "mlp_only_layers", low=0) for i in only}
    return tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n))


def read_rope_layers(d: Mapping[str, Any], n: int) -> tuple[bool, ...]:
    """Whether each of the ``n`` layers applies RoPE (Llama 4, SmolLM3): ``no_rope_layers``
    lists a flag per layer, 1 where it does; without it (v4 files), every
    ``no_rope_layer_interval``-th layer (default 4) has none."""
    given = d.get("no_rope_layers")
    if given:
        if not isinstance(given, list | tuple) or len(given) != n:
            raise ValueError(f"config.json: no_rope_layers must list {n} flags, got {given!r}")
        return tuple(bool(g) for g in given)
    step = read_int(d, "no_rope_layer_interval") or 4
    return tuple((i + 1) % step != 0 for i in range(n))
