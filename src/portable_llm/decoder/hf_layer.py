"""One decoder layer read from an HF checkpoint's names into a :class:`Layer`.

``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` (or the experts of
``mlp.experts`` and its router ``mlp.gate``), ``input_layernorm`` and
``post_attention_layernorm``: the names of transformers' Llama, which the checkpoint readers
give every family's tensors (GPT-2's and Phi-2's own names are renamed on reading), and the
config fields (:class:`~portable_llm.decoder.config.DecoderConfig`) that choose each layer's
options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.attn.block import AttnWeights
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.layer_weights import Layer
from portable_llm.ops.linear import MlpWeights

__all__ = ["layer_rope", "read_layer"]


def read_layer(cfg: DecoderConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i`` of the weights ``w`` (HF names, the model's backend)."""
    p = f"model.layers.{i}."
    sandwich = cfg.sandwich_norms  # Gemma: post_attention_layernorm norms attention's output
    post = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    dense = moe = None
    if cfg.moe_layers[i]:
        moe = read_moe(cfg, w, p + "mlp.")
    else:
        m = p + "mlp."
        dense = MlpWeights(
            *(w.get(f"{m}{k}_proj.weight") for k in ("gate", "up", "down")),
            *(w.get(f"{m}{k}_proj.bias") for k in ("gate", "up", "down")),
        )
    return Layer(
        input_norm=w[p + "input_layernorm.weight"],
        post_norm=w.get(p + post + ".weight"),
        attn=read_attention(cfg, w, p + "self_attn.", i),
        mlp=dense,
        moe=moe,
        input_bias=w.get(p + "input_layernorm.bias"),
        post_bias=w.get(p + "post_attention_layernorm.bias"),
        parallel=cfg.parallel_block,
        attn_norm=w.get(p + "post_attention_layernorm.weight") if sandwich else None,
        ff_norm=w.get(p + "post_feedforward_layernorm.weight") if sandwich else None,
    )


def read_attention(cfg: DecoderConfig, w: Mapping[str, Any], a: str, i: int) -> AttnWeights:
    """Layer ``i``'s attention under the prefix ``a`` (``model.layers.{i}.self_attn.``)."""
    return AttnWeights(
        wq=w[a + "q_proj.weight"],
        wk=w[a + "k_proj.weight"],
        wv=w[a + "v_proj.weight"],
        wo=w[a + "o_proj.weight"],
        bq=w.get(a + "q_proj.bias"),
        bk=w.get(a + "k_proj.bias"),
        bv=w.get(a + "v_proj.bias"),
        bo=w.get(a + "o_proj.bias"),
        q_norm=w.get(a + "q_norm.weight"),
        k_norm=w.get(a + "k_norm.weight"),
        window=cfg.window(i),
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        norm_eps=cfg.rms_norm_eps,
        rope=layer_rope(cfg, i) is not None,
        **_llama4_attention(cfg, i),
    )


def read_moe(cfg: DecoderConfig, w: Mapping[str, Any], m: str) -> dict[str, Any]:
    """A mixture of experts under the prefix ``m`` (``model.layers.{i}.mlp.``): the public
    ``moe``'s arrays and options."""
    options: dict[str, Any] = {
        "top_k": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router": cfg.router,  # Llama 4: "sigmoid", the scores scale the experts' inputs
        "act": cfg.hidden_act,
    }
    s = m + "shared_expert."
    if s + "gate_proj.weight" in w:  # Qwen2-MoE (gated by shared_expert_gate), Llama 4
        options["shared"] = tuple(w[f"{s}{k}_proj.weight"] for k in ("gate", "up", "down"))
    if m + "shared_expert_gate.weight" in w:  # Qwen2-MoE
        options["shared_gate"] = w[m + "shared_expert_gate.weight"]
    arrays = (w[m + "gate.weight"], *(w[f"{m}experts.{k}_proj"] for k in ("gate", "up", "down")))
    return {"arrays": arrays, "options": options}


def _llama4_attention(cfg: DecoderConfig, i: int) -> dict[str, Any]:
    """Layer ``i``'s options of Llama 4's attention (HF ``Llama4TextAttention``): the chunk of a
    ``chunked_attention`` layer; the weightless q/k norm on RoPE layers (``use_qk_norm``); the
    temperature tuning on the no-RoPE ones (``attn_temperature_tuning``)."""
    chunked = cfg.layer_types[i] == "chunked_attention" and cfg.attention_chunk_size
    no_rope = bool(cfg.no_rope_layers) and cfg.no_rope_layers[i]
    tuned = no_rope and cfg.attn_temperature_tuning
    return {
        "chunk": cfg.attention_chunk_size if chunked else None,
        "qk_l2_norm": cfg.qk_l2_norm and not no_rope,
        "temperature": (cfg.floor_scale, cfg.attn_temperature_scale) if tuned else None,
    }


def layer_rope(cfg: DecoderConfig, i: int) -> Any:
    """Layer ``i``'s RoPE options: none (learned positions, Llama 4's no-RoPE layers), Gemma
    3's ``rope_local`` on its sliding layers, else the model's."""
    if cfg.position_embedding != "rope" or (cfg.no_rope_layers and cfg.no_rope_layers[i]):
        return None
    if cfg.rope_local is not None and cfg.layer_types[i] == "sliding_attention":
        return cfg.rope_local
    return cfg.rope
