"""DeepSeek V3 and Kimi K2 (transformers' ``DeepseekV3ForCausalLM``), read top-down: what they
change of Llama.

config.json
    Multi-head latent attention: ``kv_lora_rank`` (``R``, 512), ``q_lora_rank`` (1536; null:
    a plain ``q_proj``), ``qk_nope_head_dim`` (``d_n``, 128), ``qk_rope_head_dim`` (``d_r``,
    64: HF's ``head_dim`` too, the width RoPE turns), ``v_head_dim`` (``d_v``, 128),
    ``rope_interleave`` (true: the rotary features in pairs ``(2i, 2i + 1)``); the softmax
    scale ``(d_n + d_r) ** -0.5``, times ``mscale ** 2`` under a yarn RoPE with
    ``mscale_all_dim`` (:func:`~portable_llm.attn.latent_args.latent_softmax_scale`);
    ``attention_bias`` biases ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``. The first
    ``first_k_dense_replace`` (3) layers run the dense MLP of ``intermediate_size``, the rest
    a mixture of ``n_routed_experts`` (256; v5's attribute ``num_local_experts``) experts of
    ``moe_intermediate_size`` (2048), ``num_experts_per_tok`` (8) per token, routed by the
    grouped router: sigmoid scores, ``e_score_correction_bias`` for the choice, the best
    ``topk_group`` (4) of ``n_group`` (8) groups, ``norm_topk_prob`` (true),
    ``routed_scaling_factor`` (2.5); beside them ``n_shared_experts`` (1) shared experts, one
    MLP of ``moe_intermediate_size * n_shared_experts``.
model
    Llama's.
layer (the recipe below)
    Llama's norms around :func:`~portable_llm.latent_attention`'s body
    (``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}``, ``kv_a_proj_with_mqa``,
    ``kv_a_layernorm`` (both norms of eps 1e-6, HF's default, not ``rms_norm_eps``),
    ``kv_b_proj``, ``o_proj``), which caches the latent ``c_kv`` and the rotary key, not the
    heads; then the dense MLP or :func:`~portable_llm.moe` (``mlp.gate.weight``,
    ``mlp.gate.e_score_correction_bias`` (kept in float32, as HF keeps it), ``mlp.experts``,
    ``mlp.shared_experts``). The checkpoints' multi-token-prediction modules (layers past
    ``num_hidden_layers``, ``num_nextn_predict_layers``) are not run, as transformers does not
    run them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.attn.latent_args import LatentWeights, absorbed_weights, latent_softmax_scale
from portable_llm.backends import backend_of
from portable_llm.decoder.config_values import read_bool, read_rope
from portable_llm.decoder.families.base import (
    Family,
    LayerConfig,
    grouped_moe_fields,
    grouped_moe_tensors,
    read_count,
    read_mlp,
    read_moe,
)
from portable_llm.decoder.layer_weights import Layer
from portable_llm.ops.quant import QuantizedWeight

__all__ = ["FAMILY", "read_latent_attention"]

#: The eps of ``q_a_layernorm`` and ``kv_a_layernorm`` (HF's ``DeepseekV3RMSNorm`` default).
LATENT_NORM_EPS = 1e-6


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields DeepSeek V3 changes."""
    dn, dr = read_count(d, "qk_nope_head_dim", 128), read_count(d, "qk_rope_head_dim", 64)
    rope = d.get("rope_parameters") or d.get("rope_scaling")  # v5, v4
    return {
        "head_dim": dr,  # HF's head_dim: the rotary width
        "kv_lora_rank": read_count(d, "kv_lora_rank", 512),
        "q_lora_rank": read_count(d, "q_lora_rank", 1536) if d.get("q_lora_rank", 1) else None,
        "qk_nope_head_dim": dn,
        "v_head_dim": read_count(d, "v_head_dim", 128),
        "attn_scale": latent_softmax_scale(dn + dr, rope if isinstance(rope, Mapping) else None),
        **grouped_moe_fields(d, n, experts=256, dense=3, size=2048, groups=(8, 4), scale=2.5),
    }


def read_latent_attention(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> LatentWeights:
    """Layer ``i``'s latent attention (``model.layers.{i}.self_attn.*``), with the absorbed
    form's ``W_UK``, ``W_UV`` formed once from ``kv_b_proj``."""
    a = f"model.layers.{i}.self_attn."
    H, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    wkv_b = w[a + "kv_b_proj.weight"]  # (H (d_n + d_v), R)
    norm = w[a + "kv_a_layernorm.weight"]  # (R,): float, of the model's backend and dtype
    bk = backend_of(norm)
    if bk is None:
        raise TypeError(f"load: {a}kv_a_layernorm.weight is not an array of a backend")
    w_uk, w_uv = absorbed_weights(bk, wkv_b, H, dn, dv)
    if isinstance(wkv_b, QuantizedWeight):
        w_uk, w_uv = (bk.xp.astype(t, norm.dtype) for t in (w_uk, w_uv))
    return LatentWeights(
        wq=w.get(a + "q_proj.weight"),
        wq_a=w.get(a + "q_a_proj.weight"),
        bq_a=w.get(a + "q_a_proj.bias"),
        q_a_norm=w.get(a + "q_a_layernorm.weight"),
        wq_b=w.get(a + "q_b_proj.weight"),
        wkv_a=w[a + "kv_a_proj_with_mqa.weight"],
        bkv_a=w.get(a + "kv_a_proj_with_mqa.bias"),
        kv_a_norm=norm,
        wkv_b=wkv_b,
        w_uk=w_uk,
        w_uv=w_uv,
        wo=w[a + "o_proj.weight"],
        bo=w.get(a + "o_proj.bias"),
        num_heads=H,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=dn,
        qk_rope_head_dim=cfg.head_dim,
        v_head_dim=dv,
        norm_eps=LATENT_NORM_EPS,
    )


def ropes(d: Mapping[str, Any]) -> tuple[dict[str, Any], None]:
    """The RoPE of the ``d_r`` rotary features: in interleaved pairs unless
    ``rope_interleave`` is false (then HF's rotate-half)."""
    return read_rope(d, interleaved=read_bool(d, "rope_interleave", True)), None


def tensors(cfg: Any, i: int, out: dict[str, tuple[int, ...]]) -> None:
    """Layer ``i``'s latent attention in place of Llama's q/k/v/o (``o_proj``'s bias stays
    where ``attention_bias``); a MoE layer's shared experts and correction bias."""
    a, E, H = f"model.layers.{i}.self_attn.", cfg.hidden_size, cfg.num_attention_heads
    for name in [n for n in out if n.startswith(a) and not n.startswith(a + "o_proj.bias")]:
        del out[name]
    R, Rq, dr, dn = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_dim, cfg.qk_nope_head_dim
    if Rq is None:
        out[a + "q_proj.weight"] = (H * (dn + dr), E)
    else:
        out.update({a + "q_a_proj.weight": (Rq, E), a + "q_a_layernorm.weight": (Rq,),
                    a + "q_b_proj.weight": (H * (dn + dr), Rq)})  # fmt: skip
    out[a + "kv_a_proj_with_mqa.weight"] = (R + dr, E)
    out[a + "kv_a_layernorm.weight"] = (R,)
    out[a + "kv_b_proj.weight"] = (H * (dn + cfg.v_head_dim), R)
    out[a + "o_proj.weight"] = (E, H * cfg.v_head_dim)
    if cfg.o_bias:  # attention_bias: the two down-projections too
        if Rq is not None:
            out[a + "q_a_proj.bias"] = (Rq,)
        out[a + "kv_a_proj_with_mqa.bias"] = (R + dr,)
    grouped_moe_tensors(cfg, i, out)


def read_layer(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i``: RMSNorm, latent attention, RMSNorm, the dense MLP or the grouped MoE."""
    p = f"model.layers.{i}."
    moe = cfg.moe_layers[i]
    return Layer(
        input_norm=w[p + "input_layernorm.weight"],
        attn=read_latent_attention(cfg, w, i),
        post_norm=w[p + "post_attention_layernorm.weight"],
        mlp=None if moe else read_mlp(w, i),
        moe=read_moe(cfg, w, i) if moe else None,  # shared_experts read as shared_expert
    )


FAMILY = Family(
    "deepseek_v3",
    aliases={"num_local_experts": "n_routed_experts"},  # v5's attribute name
    defaults={"intermediate_size": 18432, "max_position_embeddings": 4096},
    o_bias=True,
    fields=fields,
    read_layer=read_layer,
    ropes=ropes,
    tensors=tensors,
    names=((".mlp.shared_experts.", ".mlp.shared_expert."),),
    extra_layers=True,  # model.layers.{61..}: the multi-token-prediction modules, not run
)
