"""Phi-2 (transformers' ``PhiForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``layer_norm_eps`` (1e-5) for ``rms_norm_eps``; every projection biased (q/k/v, ``dense``
    as ``o_proj``, ``fc1``/``fc2``); ``partial_rotary_factor`` (RoPE on part of each head);
    ``qk_layernorm`` refused (not supported).
model
    LayerNorms with biases; the LM head has a bias.
layer (:func:`~portable_llm.decoder.families.base.read_layer`, ``parallel``)
    ``h = h + attention(norm(h)) + mlp(norm(h))``: one norm, attention and a plain MLP
    (``fc1 -> gelu_new -> fc2``) in parallel. No sliding window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_bool
from portable_llm.decoder.families.base import Family, no_windows

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The fields Phi-2 changes."""
    if read_bool(d, "qk_layernorm"):
        raise ValueError("config.json: Phi with qk_layernorm=true is not supported")
    return {
        "norm": "layer",
        "gated_mlp": False,
        "mlp_bias": True,
        "parallel_block": True,
        "lm_head_bias": True,
    }


FAMILY = Family(
    "phi",
    aliases={"layer_norm_eps": "rms_norm_eps"},
    defaults={"rms_norm_eps": 1e-5, "attention_bias": True},
    o_bias=True,
    fields=fields,
    layer_types=no_windows,
    names=(
        (".self_attn.dense.", ".self_attn.o_proj."),
        (".mlp.fc1.", ".mlp.up_proj."),
        (".mlp.fc2.", ".mlp.down_proj."),
        ("model.final_layernorm.", "model.norm."),
    ),
)
