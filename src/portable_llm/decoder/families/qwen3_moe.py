"""Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``num_local_experts`` (transformers 4: ``num_experts``; 128) experts of
    ``moe_intermediate_size`` (768), ``num_experts_per_tok`` (8) of them per token, their
    weights renormalised to sum to 1 when ``norm_topk_prob`` (false by default); a layer is a
    MoE layer when it is every ``decoder_sparse_step``-th (1-based) and not listed in
    ``mlp_only_layers`` (those run the dense MLP of ``intermediate_size``); ``attention_bias``
    biases ``q/k/v/o_proj``; ``sliding_window`` applies to every layer when
    ``use_sliding_window`` (HF nulls it otherwise); ``head_dim`` is
    ``hidden_size // num_attention_heads`` unless given.
model
    Llama's.
layer (Llama's recipe, :func:`~portable_llm.decoder.families.base.read_layer`)
    Qwen3's attention: an RMSNorm over each head's ``D`` features of q and k (``q_norm``,
    ``k_norm``) before RoPE; on MoE layers the softmax router ``mlp.gate`` and the experts
    ``mlp.experts`` (HF v5's fused ``gate_up_proj`` ``(X, 2I, E)`` and ``down_proj``
    ``(X, E, I)``, or v4's per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``), no
    shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_bool, read_int, read_sparse_layers
from portable_llm.decoder.families.base import Family

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields Qwen3-MoE changes."""
    x = read_int(d, "num_experts", low=0)
    x = 128 if x is None else x
    return {
        "qk_norm": True,
        "num_experts": x,
        "num_experts_per_tok": read_int(d, "num_experts_per_tok") or 8,
        "norm_topk_prob": read_bool(d, "norm_topk_prob"),
        "moe_intermediate_size": read_int(d, "moe_intermediate_size") or 768,
        "moe_layers": read_sparse_layers(d, n, x),
    }


def layer_types(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: every layer slides when ``use_sliding_window``."""
    window = read_int(d, "sliding_window", low=0) if read_bool(d, "use_sliding_window") else None
    return window, ["full_attention" if window is None else "sliding_attention"] * n


FAMILY = Family(
    "qwen3_moe",
    aliases={"num_local_experts": "num_experts"},  # v5's name (HF's attribute_map)
    defaults={"intermediate_size": 6144},  # the dense MLP of mlp_only_layers
    o_bias=True,
    fields=fields,
    layer_types=layer_types,
)
