"""Qwen2-MoE (transformers' ``Qwen2MoeForCausalLM``): Qwen2 with sparse layers and a gated
shared expert.

config.json
    Qwen2's names; ``qkv_bias`` (true by default) biases q/k/v; ``num_experts`` (60) experts of
    ``moe_intermediate_size`` (1408), ``num_experts_per_tok`` (4), ``norm_topk_prob``; a shared
    expert of ``shared_expert_intermediate_size`` (5632) gated by ``shared_expert_gate``; every
    ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` is sparse; with
    ``use_sliding_window``, the odd-numbered layers below ``max_window_layers`` slide.
model
    Llama's.
layer (:func:`~portable_llm.decoder.families.base.read_layer`)
    Llama's, the sparse layers' MLP the experts (``mlp.experts``, router ``mlp.gate``) plus the
    gated ``mlp.shared_expert``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_bool, read_int, read_sparse_layers
from portable_llm.decoder.families.base import Family, mlp_tensors, qwen2_layer_types

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """Qwen2-MoE's biases and experts."""
    x = read_int(d, "num_experts", low=0)
    x = 60 if x is None else x
    return {
        "qkv_bias": read_bool(d, "qkv_bias", True),
        "num_experts": x,
        "num_experts_per_tok": read_int(d, "num_experts_per_tok") or 4,
        "norm_topk_prob": read_bool(d, "norm_topk_prob"),
        "moe_intermediate_size": read_int(d, "moe_intermediate_size") or 1408,
        "shared_expert_intermediate_size": read_int(d, "shared_expert_intermediate_size") or 5632,
        "moe_layers": read_sparse_layers(d, n, x),
    }


def tensors(cfg: Any, i: int, out: dict[str, tuple[int, ...]]) -> None:
    """A sparse layer's gated shared expert, beside its experts."""
    if cfg.moe_layers[i]:
        p, E = f"model.layers.{i}.mlp.", cfg.hidden_size
        mlp_tensors(out, p + "shared_expert.", E, cfg.shared_expert_intermediate_size, False)
        out[p + "shared_expert_gate.weight"] = (1, E)


FAMILY = Family(
    "qwen2_moe",
    fields=fields,
    tensors=tensors,
    layer_types=lambda d, n: qwen2_layer_types(d, n, every_other=True),
)
