"""Qwen2 (transformers' ``Qwen2ForCausalLM``): Llama with biases on q, k and v.

config.json
    Llama's names; q/k/v always biased (``o_proj`` never); ``use_sliding_window`` switches
    ``sliding_window`` on for the layers from ``max_window_layers`` on (or those ``layer_types``
    names): :func:`~portable_llm.decoder.families.base.qwen2_layer_types`, the default rule.
model, layer
    Llama's.
"""

from __future__ import annotations

from portable_llm.decoder.families.base import Family

__all__ = ["FAMILY"]

FAMILY = Family("qwen2", fields=lambda d, n: {"qkv_bias": True})
