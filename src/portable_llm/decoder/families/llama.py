"""Llama (transformers' ``LlamaForCausalLM``): the layer every other family is read against.

config.json
    HF's usual names; ``attention_bias`` biases q/k/v and ``o_proj``, ``mlp_bias`` the MLP;
    ``hidden_size`` splits into whole heads.
model
    token embedding, the layers, a final RMSNorm, the LM head (tied when
    ``tie_word_embeddings``).
layer (:func:`~portable_llm.decoder.families.base.read_layer`)
    ``h = h + attention(norm(h))``, ``h = h + mlp(norm(h))``: RMSNorm, RoPE attention with
    grouped KV heads, a SwiGLU MLP. No sliding window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_bool
from portable_llm.decoder.families.base import Family, no_windows

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The one field Llama reads beyond the common ones: ``mlp_bias``."""
    return {"mlp_bias": read_bool(d, "mlp_bias")}


FAMILY = Family("llama", whole_heads=True, o_bias=True, fields=fields, layer_types=no_windows)
