"""OLMo 2 (transformers' ``Olmo2ForCausalLM``), read top-down: what it changes of Llama.

config.json
    Llama's names; ``rms_norm_eps`` 1e-5 by default; ``attention_bias`` biases ``o_proj`` too.
model
    Llama's.
layer (the recipe below)
    ``h = h + norm(attention(h))``, ``h = h + norm(mlp(h))``: the norms after each sublayer
    (``post_attention_layernorm``, ``post_feedforward_layernorm``), none before it; the
    attention's ``q_norm`` and ``k_norm`` are one RMSNorm over the whole projection (all
    heads' features, ``(H * D,)`` and ``(H_kv * D,)``), before it is split into heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from portable_llm.decoder.families.base import Family, LayerConfig, read_attention, read_mlp
from portable_llm.decoder.layer_weights import Layer

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields OLMo 2 changes."""
    return {"post_norms": True, "qk_norm": True, "qk_norm_whole": True}


def read_layer(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i``: Llama's attention (q/k normed whole) and gated MLP, each output normed."""
    p = f"model.layers.{i}."
    return Layer(
        input_norm=None,  # the attention reads h itself
        attn=replace(read_attention(cfg, w, i), qk_norm_whole=True),
        attn_norm=w[p + "post_attention_layernorm.weight"],  # of the attention's output
        post_norm=None,  # the MLP reads h itself
        mlp=read_mlp(w, i),
        ff_norm=w[p + "post_feedforward_layernorm.weight"],  # of the MLP's output
        moe=None,
    )


FAMILY = Family(
    "olmo2",
    defaults={"rms_norm_eps": 1e-5},
    o_bias=True,
    fields=fields,
    read_layer=read_layer,
)
