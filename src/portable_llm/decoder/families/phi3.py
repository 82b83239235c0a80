"""Phi-3 (transformers' ``Phi3ForCausalLM``): Llama with fused projections and longrope.

config.json
    Llama's names; ``rms_norm_eps`` 1e-5 by default; ``sliding_window`` on every layer;
    ``rope_scaling`` of type ``longrope`` (its older names ``su`` and ``yarn`` read as it),
    ``original_max_position_embeddings`` 4096 by default; ``partial_rotary_factor``.
model
    Llama's; past ``original_max_position_embeddings`` the long factors apply to every token
    (the model's ``recompute_after``).
layer (:func:`~portable_llm.decoder.families.base.read_layer`)
    Llama's, read from the fused ``qkv_proj`` and ``gate_up_proj`` (cut at load).
"""

from __future__ import annotations

from portable_llm.decoder.families.base import Family, window_everywhere

__all__ = ["FAMILY"]

FAMILY = Family(
    "phi3",
    defaults={"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
    layer_types=window_everywhere,
    rope_renames={"su": "longrope", "yarn": "longrope"},
)
