"""Mixtral (transformers' ``MixtralForCausalLM``): Mistral with a mixture of experts per layer.

config.json
    Mistral's names; ``rope_theta`` 1e6 and ``rms_norm_eps`` 1e-5 by default;
    ``num_local_experts`` (8) experts of ``intermediate_size``, ``num_experts_per_tok`` (2) per
    token, their softmax weights always renormalised (``MixtralTopKRouter``).
model
    Llama's.
layer (:func:`~portable_llm.decoder.families.base.read_layer`)
    Llama's attention (a window on every layer when set); the MLP is ``mlp.experts`` under the
    router ``mlp.gate``, on every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_int
from portable_llm.decoder.families.base import Family, window_everywhere

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """Mixtral's experts: every layer."""
    size = read_int(d, "intermediate_size", required=True)
    return {
        "num_experts": read_int(d, "num_local_experts") or read_int(d, "num_experts") or 8,
        "num_experts_per_tok": read_int(d, "num_experts_per_tok") or 2,
        "norm_topk_prob": True,
        "moe_intermediate_size": size,
        "moe_layers": (True,) * n,
    }


FAMILY = Family(
    "mixtral",
    defaults={"rope_theta": 1e6, "rms_norm_eps": 1e-5},
    fields=fields,
    layer_types=window_everywhere,
)
