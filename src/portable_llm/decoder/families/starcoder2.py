"""StarCoder2 (transformers' ``Starcoder2ForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``norm_epsilon`` for ``rms_norm_eps``; ``use_bias`` (default true) biases every projection
    (q, k, v, o, and the MLP's); ``hidden_act`` ``gelu_pytorch_tanh`` and tied embeddings by
    default, and 2 KV heads; ``sliding_window`` (when set) on every layer.
model
    LayerNorm (weight and bias) for every norm, the final one too.
layer
    Llama's order, LayerNorms, and the plain MLP ``c_proj(act(c_fc(x)))`` (read as
    ``up_proj``/``down_proj``, with no ``gate_proj``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_bool, read_int
from portable_llm.decoder.families.base import Family

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields StarCoder2 changes."""
    bias = read_bool(d, "use_bias", True)
    return {
        "norm": "layer",
        "gated_mlp": False,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
    }


def layer_types(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: the window (when set) on every layer."""
    window = read_int(d, "sliding_window", low=0)
    return window, ["sliding_attention" if window is not None else "full_attention"] * n


FAMILY = Family(
    "starcoder2",
    aliases={"norm_epsilon": "rms_norm_eps"},
    defaults={
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "num_key_value_heads": 2,  # Starcoder2Config's, not num_attention_heads
    },
    fields=fields,
    layer_types=layer_types,
    names=((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj.")),
)
