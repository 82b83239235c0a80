"""Mistral (transformers' ``MistralForCausalLM``): Llama with a sliding window on every layer.

config.json
    Llama's names; ``sliding_window`` (when set) on every layer.
model, layer
    Llama's.
"""

from __future__ import annotations

from portable_llm.decoder.families.base import Family, window_everywhere

__all__ = ["FAMILY"]

FAMILY = Family("mistral", layer_types=window_everywhere)
