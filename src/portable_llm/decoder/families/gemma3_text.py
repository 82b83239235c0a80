"""Gemma 3 (transformers' ``Gemma3ForCausalLM``, ``gemma3_text``): Gemma 2 with q/k norms, no
soft-capping by default, and a RoPE per layer type.

config.json
    Gemma 2's names (``hidden_activation``, ``query_pre_attn_scalar``); ``head_dim`` 256,
    ``rope_theta`` 1e6 and tied embeddings by default; the soft-capping values absent by
    default; ``layer_types`` (v4 files: every ``sliding_window_pattern``-th (6) layer is full,
    ``sliding_window`` 4096); ``rope_parameters`` per layer type (v4: ``rope_local_base_freq``,
    10000, for the sliding layers).
model
    Gemma 2's: the embeddings times ``sqrt(E)``, ``1 + w`` RMSNorms.
layer (:func:`~portable_llm.decoder.families.base.read_layer`, ``sandwich_norms``)
    Gemma 2's sandwich, the queries and keys RMS-normed per head; the sliding layers take the
    RoPE of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_int, read_layer_types, read_real, read_rope
from portable_llm.decoder.families.base import Family
from portable_llm.decoder.families.gemma2 import gemma_fields

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """Gemma 2's fields (no soft-capping by default) and the q/k norms."""
    return {**gemma_fields(d, softcaps=(None, None)), "qk_norm": True}


def layer_types(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: as given, or (v4) every ``sliding_window_pattern``-th
    layer full and the others sliding."""
    window = read_int(d, "sliding_window", low=0)
    given = read_layer_types(d)
    if given is not None:
        return window, given
    window = 4096 if window is None else window
    pattern = read_int(d, "sliding_window_pattern") or 6
    return window, [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
    ]


def ropes(d: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(rope, rope of the sliding layers)``: ``rope_parameters`` per layer type (v5), or
    ``rope_theta`` and ``rope_local_base_freq`` (v4)."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values()):
        full, local = params.get("full_attention"), params.get("sliding_attention")
        if not isinstance(full, Mapping) or not isinstance(local, Mapping):
            raise ValueError(
                "config.json: rope_parameters per layer type must give full_attention and "
                f"sliding_attention, got keys {sorted(params)}"
            )
        return read_rope({**d, "rope_parameters": full}), read_rope({**d, "rope_parameters": local})
    base = read_real(d, "rope_local_base_freq", 10000.0, low=1.0, low_open=True)
    return read_rope(d), read_rope(
        {"rope_parameters": {"rope_type": "default", "rope_theta": base}}
    )


FAMILY = Family(
    "gemma3_text",
    aliases={"hidden_activation": "hidden_act"},
    defaults={
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
    },
    whole_heads=True,
    o_bias=True,
    fields=fields,
    layer_types=layer_types,
    ropes=ropes,
)
