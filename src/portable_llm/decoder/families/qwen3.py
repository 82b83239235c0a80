"""Qwen3 (transformers' ``Qwen3ForCausalLM``): Llama with per-head q/k RMSNorms.

config.json
    Llama's names; ``head_dim`` 128 by default; ``attention_bias`` biases ``o_proj`` too;
    Qwen2's window rule (:func:`~portable_llm.decoder.families.base.qwen2_layer_types`).
model
    Llama's.
layer
    Llama's, the queries and keys RMS-normed per head (``q_norm``, ``k_norm``) before RoPE.
"""

from __future__ import annotations

from portable_llm.decoder.families.base import Family

__all__ = ["FAMILY"]

FAMILY = Family(
    "qwen3", defaults={"head_dim": 128}, o_bias=True, fields=lambda d, n: {"qk_norm": True}
)
