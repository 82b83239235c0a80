"""The checked readers of ``config.json`` values: one rule per kind (an int, a real, a bool, a
soft-capping value), each refusing a value of the wrong type or range with a ValueError naming
the key. :mod:`portable_llm.decoder.config` and the family files
(:mod:`portable_llm.decoder.families`) read with them."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from portable_llm.core.checks import check_int, check_real
from portable_llm.rotary.scaling import ROPE_TYPES, rope_spec

__all__ = [
    "read_bool",
    "read_cap",
    "read_int",
    "read_layer_types",
    "read_real",
    "read_rope",
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


def read_layer_types(d: Mapping[str, Any]) -> list[Any] | None:
    """``layer_types`` as given (a list, checked against the layer count by the config), or
    ``None`` when absent."""
    given = d.get("layer_types")
    if given is not None and not isinstance(given, list | tuple):
        raise ValueError(f"config.json: layer_types must be a list, got {given!r}")
    return None if given is None else list(given)


def read_rope(
    d: Mapping[str, Any],
    *,
    interleaved: bool = False,
    renames: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``{"base", "scaling", "max_position_embeddings"}`` from ``rope_parameters`` (v5) or
    ``rope_theta`` + ``rope_scaling`` (v4), as HF's config standardisation reads them: the
    options of :func:`portable_llm.rotary.rope`, every field checked now (not at the first
    forward). ``rope_theta`` absent: 10000 (a family's other default is in ``d`` already).
    ``interleaved``: the pairs ``(2i, 2i + 1)`` (``traditional``). ``renames``: a family's
    older names of a rope type (Phi-3's ``su`` and ``yarn`` for ``longrope``)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"config.json: rope_parameters must be a dict, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(
            "config.json: rope_parameters per layer type (a dict of dicts) are not supported; "
            f"got keys {sorted(params)}"
        )
    scaling = dict(params)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = (renames or {}).get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"config.json: unknown rope type {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = scaling.get("rope_theta", d.get("rope_theta", 10000.0))
    theta = read_real({"rope_theta": theta}, "rope_theta", 0.0, low=1.0, low_open=True)
    scaling.update(rope_type=kind, rope_theta=theta)
    prf = d.get("partial_rotary_factor")
    if prf is not None:
        scaling.setdefault("partial_rotary_factor", prf)
    mpe = d.get("max_position_embeddings")
    if kind in ("llama3", "yarn", "longrope"):  # HF: the config's own field comes first
        ompe = d.get("original_max_position_embeddings")
        if ompe is not None:
            scaling["original_max_position_embeddings"] = ompe
        elif mpe is not None:
            scaling.setdefault("original_max_position_embeddings", mpe)
    out: dict[str, Any] = {"base": theta, "scaling": MappingProxyType(scaling)}
    if interleaved:  # pairs (2i, 2i + 1)
        out["traditional"] = True
    if kind in ("dynamic", "longrope"):  # longrope: its default factor, mpe / ompe
        out["max_position_embeddings"] = mpe
    rope_spec(
        "config.json",
        out["scaling"],
        base=theta,
        max_position_embeddings=out.get("max_position_embeddings"),
    )
    return out
