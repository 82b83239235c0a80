"""GLM-4.5 (transformers' ``Glm4MoeForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``partial_rotary_factor`` (0.5 by default, in ``rope_parameters`` or beside it): RoPE turns
    the first ``int(head_dim * partial_rotary_factor)`` features of each head (rotate-half
    pairs), the rest pass; ``use_qk_norm`` (false): an RMSNorm over each head's ``D`` features
    of q and k (``q_norm``, ``k_norm``, eps ``rms_norm_eps``) before RoPE; ``attention_bias``
    biases ``q/k/v_proj`` (not ``o_proj``); ``head_dim`` is ``hidden_size //
    num_attention_heads`` unless given. The first ``first_k_dense_replace`` (1) layers run the
    dense MLP of ``intermediate_size``, the rest a mixture of ``n_routed_experts`` (128; v5's
    attribute ``num_local_experts``) experts of ``moe_intermediate_size`` (1408),
    ``num_experts_per_tok`` (8) per token, routed as DeepSeek V3's: sigmoid scores,
    ``e_score_correction_bias`` for the choice, the best ``topk_group`` (1) of ``n_group`` (1)
    groups, ``norm_topk_prob`` (true), ``routed_scaling_factor`` (1.0); beside them
    ``n_shared_experts`` (1) shared experts, one MLP of ``moe_intermediate_size *
    n_shared_experts``. No sliding window; ``rms_norm_eps`` 1e-5.
model
    Llama's.
layer (Llama's recipe, :func:`~portable_llm.decoder.families.base.read_layer`)
    Qwen3's attention (q/k norms per head) under partial RoPE; then the dense MLP or
    :func:`~portable_llm.moe` with ``router="grouped"`` (``mlp.gate.weight``,
    ``mlp.gate.e_score_correction_bias``, kept in float32 as HF keeps it, ``mlp.experts``,
    ``mlp.shared_experts``). The checkpoints' multi-token-prediction layers (past
    ``num_hidden_layers``, ``num_nextn_predict_layers``) are not run, as transformers does not
    run them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_bool, read_int, read_real
from portable_llm.decoder.families.base import Family, grouped_moe_tensors, no_windows

__all__ = ["FAMILY"]


def _count(d: Mapping[str, Any], key: str, default: int, low: int = 1) -> int:
    value = read_int(d, key, low=low)
    return default if value is None else int(value)


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields GLM-4.5 changes."""
    x, dense = _count(d, "n_routed_experts", 128, low=0), _count(d, "first_k_dense_replace", 1, 0)
    size = _count(d, "moe_intermediate_size", 1408)
    return {
        "qk_norm": read_bool(d, "use_qk_norm"),
        "num_experts": x,
        "num_experts_per_tok": _count(d, "num_experts_per_tok", 8),
        "norm_topk_prob": read_bool(d, "norm_topk_prob", True),
        "moe_intermediate_size": size,
        "shared_expert_intermediate_size": size * _count(d, "n_shared_experts", 1, low=0),
        "moe_layers": tuple(x > 0 and i >= dense for i in range(n)),
        "router": "grouped",
        "n_group": _count(d, "n_group", 1),
        "topk_group": _count(d, "topk_group", 1),
        "routed_scaling_factor": read_real(d, "routed_scaling_factor", 1.0, low=0.0),
    }


FAMILY = Family(
    "glm4_moe",
    aliases={"num_local_experts": "n_routed_experts"},  # v5's attribute name
    defaults={
        "intermediate_size": 10944,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "partial_rotary_factor": 0.5,  # HF's __post_init__ default (in rope_parameters in v5)
    },
    fields=fields,
    layer_types=no_windows,
    tensors=grouped_moe_tensors,
    names=((".mlp.shared_experts.", ".mlp.shared_expert."),),
    extra_layers=True,  # model.layers.{46.., 92..}: the multi-token-prediction modules
)
