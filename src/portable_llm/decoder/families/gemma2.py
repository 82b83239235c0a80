"""Gemma 2 (transformers' ``Gemma2ForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``hidden_activation`` (GeGLU, ``gelu_pytorch_tanh`` by default) for ``hidden_act``;
    ``head_dim`` 256 and tied embeddings by default; ``query_pre_attn_scalar`` (the attention's
    scale is its ``** -0.5``), ``attn_logit_softcapping`` (50) and ``final_logit_softcapping``
    (30); ``sliding_window`` (4096) on the layers ``layer_types`` names ``sliding_attention``
    (v4 files: the even layers); ``attention_bias`` biases ``o_proj`` too.
model
    the embeddings times ``sqrt(E)``; every norm RMSNorm scaled by ``1 + w``; the final logits
    soft-capped.
layer (the recipe below)
    ``h = h + norm(attention(norm(h)))``, ``h = h + norm(mlp(norm(h)))``: the sandwich norms,
    ``post_attention_layernorm`` on the attention's output and ``pre_feedforward_layernorm`` /
    ``post_feedforward_layernorm`` around the MLP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_cap, read_int, read_layer_types, read_real
from portable_llm.decoder.families.base import Family, LayerConfig, read_attention, read_mlp
from portable_llm.decoder.layer_weights import Layer

__all__ = ["FAMILY", "gemma_fields"]


def gemma_fields(
    d: Mapping[str, Any], *, softcaps: tuple[float | None, float | None] = (50.0, 30.0)
) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields Gemma 2 changes (and
    Gemma 3, whose ``softcaps``, the defaults of the attention's and the final soft-capping,
    are none)."""
    scalar = read_real(d, "query_pre_attn_scalar", 256.0, low=0.0, low_open=True)
    return {
        "norm_offset": 1.0,  # the norms scale by 1 + w
        "embed_scale": True,  # the embeddings times sqrt(E)
        "sandwich_norms": True,
        "attn_scale": scalar**-0.5,
        "attn_softcap": read_cap(d, "attn_logit_softcapping", softcaps[0]),
        "final_softcap": read_cap(d, "final_logit_softcapping", softcaps[1]),
    }


def layer_types(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: as given, or (v4) the even layers slide."""
    window = read_int(d, "sliding_window", low=0)
    given = read_layer_types(d)
    if given is not None:
        return window, given
    window = 4096 if window is None else window
    return window, ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def read_layer(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i``: Llama's attention and gated MLP between the sandwich norms."""
    p = f"model.layers.{i}."
    return Layer(
        input_norm=w[p + "input_layernorm.weight"],
        attn=read_attention(cfg, w, i),
        attn_norm=w[p + "post_attention_layernorm.weight"],  # of the attention's output
        post_norm=w[p + "pre_feedforward_layernorm.weight"],
        mlp=read_mlp(w, i),
        ff_norm=w[p + "post_feedforward_layernorm.weight"],  # of the MLP's output
        moe=None,
    )


FAMILY = Family(
    "gemma2",
    aliases={"hidden_activation": "hidden_act"},
    defaults={"head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    whole_heads=True,
    o_bias=True,
    fields=lambda d, n: gemma_fields(d),
    layer_types=layer_types,
    read_layer=read_layer,
)
