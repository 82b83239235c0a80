"""GPT-2 (transformers' ``GPT2LMHeadModel``), read top-down: what it changes of Llama.

config.json
    its own names: ``n_embd``, ``n_layer``, ``n_head``, ``n_positions`` (1024),
    ``n_inner`` (``None``: ``4 * n_embd``), ``activation_function`` (``gelu_new``),
    ``layer_norm_epsilon`` (1e-5); no ``head_dim`` (the heads split ``n_embd``); tied
    embeddings; every projection biased. ``scale_attn_weights=false`` and
    ``scale_attn_by_inverse_layer_idx=true`` are refused (not supported).
model
    learned absolute positions (``wpe``, ``n_positions`` rows) added to the token embedding;
    LayerNorms with biases; no RoPE.
layer (:func:`~portable_llm.decoder.families.base.read_layer`)
    Llama's order with LayerNorms, attention from the fused ``c_attn`` (cut at load) and a
    plain MLP (``c_fc -> gelu_new -> c_proj``). No sliding window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_bool
from portable_llm.decoder.families.base import Family, no_windows

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The fields GPT-2 changes."""
    if not read_bool(d, "scale_attn_weights", True) or read_bool(
        d, "scale_attn_by_inverse_layer_idx"
    ):
        raise ValueError(
            "config.json: GPT-2 with scale_attn_weights=false or "
            "scale_attn_by_inverse_layer_idx=true is not supported"
        )
    return {
        "norm": "layer",
        "gated_mlp": False,
        "mlp_bias": True,
        "position_embedding": "learned",
    }


FAMILY = Family(
    "gpt2",
    aliases={
        "n_embd": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_positions": "max_position_embeddings",
        "n_inner": "intermediate_size",
        "activation_function": "hidden_act",
        "layer_norm_epsilon": "rms_norm_eps",
    },
    ignores=("head_dim",),  # a stray one is ignored: GPT2Attention splits E into H heads
    defaults={
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "attention_bias": True,
        "hidden_act": "gelu_new",
    },
    derived=lambda d: {"intermediate_size": 4 * d.get("hidden_size", 0)},  # n_inner=None
    whole_heads=True,
    o_bias=True,
    fields=fields,
    layer_types=no_windows,
)
