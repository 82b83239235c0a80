"""Llama 4 (transformers' ``Llama4ForCausalLM``, ``llama4_text``), read top-down: what it
changes of Llama.

config.json
    ``rope_theta`` 5e5 and ``rms_norm_eps`` 1e-5 by default; ``intermediate_size_mlp`` is the
    dense layers' MLP, ``intermediate_size`` the experts' and the shared expert's;
    ``num_local_experts`` (16) experts, ``num_experts_per_tok`` (1); ``moe_layers`` (v4: every
    ``interleave_moe_layer_step``-th layer); ``no_rope_layers`` (v4: every
    ``no_rope_layer_interval``-th layer has none); ``layer_types`` (v4: the RoPE layers
    chunked, the others full) with ``attention_chunk_size`` (8192); ``attn_temperature_tuning``,
    ``floor_scale``, ``attn_scale``; ``use_qk_norm``.
model
    Llama's, RoPE rotating the pairs ``(2i, 2i + 1)``.
layer (:func:`~portable_llm.decoder.families.base.read_layer`)
    Llama's; the RoPE layers attend within chunks and L2-norm q and k (weightless); the no-RoPE
    layers attend to all before them, their queries scaled by the temperature tuning; the MoE
    layers: a sigmoid router whose scores scale the experts' inputs, plus a shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import (
    read_bool,
    read_int,
    read_layer_types,
    read_real,
    read_rope_layers,
)
from portable_llm.decoder.families.base import Family, mlp_tensors

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The fields Llama 4 changes: its attention's options and its experts."""
    size = read_int(d, "intermediate_size", required=True)  # the experts' and the shared one's
    return {
        "intermediate_size": read_int(d, "intermediate_size_mlp", required=True),
        "attention_chunk_size": (
            read_int(d, "attention_chunk_size") if "attention_chunk_size" in d else 8192
        ),  # HF's default when absent
        "no_rope_layers": tuple(not rope for rope in read_rope_layers(d, n)),
        "attn_temperature_tuning": read_bool(d, "attn_temperature_tuning", True),
        "floor_scale": read_real(d, "floor_scale", 8192.0, low=0.0, low_open=True),
        "attn_temperature_scale": read_real(d, "attn_scale", 0.1, low=0.0),
        "qk_l2_norm": read_bool(d, "use_qk_norm", True),
        "router": "sigmoid",
        "num_experts": read_int(d, "num_local_experts") or 16,
        "num_experts_per_tok": read_int(d, "num_experts_per_tok") or 1,
        "moe_intermediate_size": size,
        "shared_expert_intermediate_size": size,
        "moe_layers": _moe_layers(d, n),
    }


def _moe_layers(d: Mapping[str, Any], n: int) -> tuple[bool, ...]:
    """``moe_layers`` (layer indices), or (v4) every ``interleave_moe_layer_step``-th layer."""
    given = d.get("moe_layers")
    if given is None:
        step = read_int(d, "interleave_moe_layer_step") or 1
        given = list(range(step - 1, n, step))
    if not isinstance(given, list | tuple):
        raise ValueError(f"config.json: moe_layers must be a list of ints, got {given!r}")
    chosen = {read_int({"moe_layers": i}, "moe_layers", low=0) for i in given}
    return tuple(i in chosen for i in range(n))


def layer_types(d: Mapping[str, Any], n: int) -> tuple[None, list[str]]:
    """``(None, layer_types)``: as given, or (v4) the RoPE layers chunked, the others full."""
    given = read_layer_types(d)
    if given is not None:
        return None, given
    return None, [
        "chunked_attention" if rope else "full_attention" for rope in read_rope_layers(d, n)
    ]


def tensors(cfg: Any, i: int, out: dict[str, tuple[int, ...]]) -> None:
    """An MoE layer's experts as the reader cuts them from the fused ``gate_up_proj``
    (``checkpoint/gpt2_layout.py: llama4_sources``), and its shared expert."""
    if cfg.moe_layers[i]:
        p, E = f"model.layers.{i}.mlp.", cfg.hidden_size
        X, I_m = cfg.num_experts, cfg.moe_intermediate_size
        del out[p + "experts.gate_up_proj"]
        out[p + "experts.gate_proj"] = out[p + "experts.up_proj"] = (X, I_m, E)
        mlp_tensors(out, p + "shared_expert.", E, cfg.shared_expert_intermediate_size, False)


FAMILY = Family(
    "llama4_text",
    names=((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp.")),
    tensors=tensors,
    defaults={"rope_theta": 5e5, "rms_norm_eps": 1e-5},
    fields=fields,
    layer_types=layer_types,
    interleaved_rope=True,
)
