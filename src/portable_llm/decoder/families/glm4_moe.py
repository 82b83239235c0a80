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

from portable_llm.decoder.config_values import read_bool
from portable_llm.decoder.families.base import (
    Family,
    grouped_moe_fields,
    grouped_moe_tensors,
    no_windows,
)

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields GLM-4.5 changes."""
    return {
        "qk_norm": read_bool(d, "use_qk_norm"),
        **grouped_moe_fields(d, n, experts=128, dense=1, size=1408, groups=(1, 1), scale=1.0),
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
