"""gpt-oss (transformers' ``GptOssForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``num_local_experts`` (128; v4 files also ``num_experts``) experts of
    ``intermediate_size`` (2880), ``num_experts_per_tok`` (4) per token; ``swiglu_limit``
    (7.0) and ``swiglu_alpha`` (1.702); ``head_dim`` 64, 8 KV heads, ``rms_norm_eps`` 1e-5,
    untied head;
    ``attention_bias`` (true) biases ``q/k/v/o_proj``; ``sliding_window`` (128) on the layers
    ``layer_types`` names ``sliding_attention`` (default: the even layers, 0-based); YaRN RoPE
    (``rope_parameters``, v4 ``rope_scaling``; default factor 32 over 4096 positions, beta
    32 / 1, ``truncate`` false, ``rope_theta`` 150000). A ``quantization_config`` of
    ``quant_method`` ``mxfp4`` says the experts are stored as MXFP4 ``*_blocks``/``*_scales``.
model
    Llama's.
layer
    Llama's two lines, ``h = h + attention(norm(h))``, ``h = h + moe(norm(h))``; the attention
    with ``self_attn.sinks``, one learned logit per query head in every softmax row (a key
    that takes no value), q/k/v/o biases, RoPE rotate-half with YaRN's frequencies and
    attention factor; a mixture of experts on every layer: the router ``mlp.router`` with a
    bias, the top-k logits' softmax (= the softmax over all experts renormalised over the
    chosen k); each expert ``down(clamped_swiglu(gate(x) + bg, up(x) + bu)) + bd``, HF's
    ``gate_up_proj`` ``(X, E, 2I)`` with gate and up interleaved along its last axis (cut at
    load: :func:`~portable_llm.checkpoint.gpt2_layout.gpt_oss_sources`), ``down_proj``
    ``(X, I, E)``; MXFP4 experts stay quantized (:class:`~portable_llm.MXFP4Weight`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from portable_llm.decoder.config_values import read_int, read_layer_types, read_real
from portable_llm.decoder.families.base import Family, LayerConfig, read_attention
from portable_llm.decoder.layer_weights import Layer
from portable_llm.ops.moe import MoeWeights

__all__ = ["FAMILY"]

#: HF ``GptOssConfig``'s RoPE when ``config.json`` gives none.
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields gpt-oss changes."""
    x = read_int(d, "num_experts", low=1)
    x = 128 if x is None else x
    return {
        "num_experts": x,
        "num_experts_per_tok": read_int(d, "num_experts_per_tok") or 4,
        "norm_topk_prob": True,  # softmax over the top-k logits
        "moe_intermediate_size": read_int(d, "intermediate_size", required=True),
        "moe_layers": (True,) * n,
        "swiglu_limit": read_real(d, "swiglu_limit", 7.0, low=0.0, low_open=True),
        "swiglu_alpha": read_real(d, "swiglu_alpha", 1.702, low=0.0, low_open=True),
    }


def derived(d: Mapping[str, Any]) -> dict[str, Any]:
    """HF's RoPE default (YaRN) when ``config.json`` gives neither ``rope_parameters`` nor
    ``rope_scaling``."""
    return {} if d.get("rope_scaling") else {"rope_parameters": dict(YARN)}


def layer_types(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: as given, or the even layers (0-based) slide."""
    window = read_int(d, "sliding_window", low=0)
    window = 128 if window is None and "sliding_window" not in d else window
    given = read_layer_types(d)
    if given is not None:
        return window, given
    return window, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


def tensors(cfg: Any, i: int, out: dict[str, tuple[int, ...]]) -> None:
    """Layer ``i``'s tensors beyond Llama's MoE layer: the sinks, the router's bias, the
    experts cut and biased (``checkpoint/gpt_oss_layout.py``: floats or MXFP4)."""
    p, E, H = f"model.layers.{i}.", cfg.hidden_size, cfg.num_attention_heads
    X, I = cfg.num_experts, cfg.moe_intermediate_size  # noqa: E741
    m = p + "mlp."
    out[p + "self_attn.sinks"] = (H,)
    out[m + "gate.bias"] = (X,)  # HF mlp.router.bias
    del out[m + "experts.gate_up_proj"]
    out[m + "experts.gate_proj"] = out[m + "experts.up_proj"] = (X, I, E)
    out[m + "experts.gate_bias"] = out[m + "experts.up_bias"] = (X, I)
    out[m + "experts.down_bias"] = (X, E)


def read_layer(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i``: the attention with its sinks, then the biased mixture of experts."""
    p = f"model.layers.{i}."
    m = p + "mlp."
    attn = replace(read_attention(cfg, w, i), sinks=w[p + "self_attn.sinks"])  # (H,)
    moe = MoeWeights(
        w[m + "gate.weight"],  # HF mlp.router.weight (X, E)
        w[m + "experts.gate_proj"],  # (X, I, E): floats or MXFP4
        w[m + "experts.up_proj"],  # (X, I, E)
        w[m + "experts.down_proj"],  # (X, E, I)
        top_k=cfg.num_experts_per_tok,
        norm_topk_prob=True,
        swiglu_limit=cfg.swiglu_limit,
        swiglu_alpha=cfg.swiglu_alpha,
        router_bias=w[m + "gate.bias"],  # (X,)
        experts_gate_bias=w[m + "experts.gate_bias"],  # (X, I)
        experts_up_bias=w[m + "experts.up_bias"],  # (X, I)
        experts_down_bias=w[m + "experts.down_bias"],  # (X, E)
    )
    return Layer(
        input_norm=w[p + "input_layernorm.weight"],
        post_norm=w[p + "post_attention_layernorm.weight"],
        attn=attn,
        mlp=None,
        moe=moe,
    )


FAMILY = Family(
    "gpt_oss",
    aliases={"num_local_experts": "num_experts"},  # v5's name (HF's attribute_map)
    defaults={
        "head_dim": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "attention_bias": True,
        "intermediate_size": 2880,
        "max_position_embeddings": 131072,
    },
    derived=derived,
    o_bias=True,
    fields=fields,
    layer_types=layer_types,
    read_layer=read_layer,
    names=((".mlp.router.", ".mlp.gate."),),
    tensors=tensors,
)
