"""Cohere 2 (transformers' ``Cohere2ForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``layer_norm_eps`` for ``rms_norm_eps`` (1e-5); ``logit_scale`` (0.0625); ``head_dim``
    always ``hidden_size // num_attention_heads``; tied embeddings by default;
    ``sliding_window`` (4096) on the layers ``layer_types`` names ``sliding_attention`` (v4
    files: ``sliding_window_pattern``, 4: every 4th layer is global); ``attention_bias``
    biases ``o_proj`` too.
model
    LayerNorm without a bias for every norm, the final one too; the logits times
    ``logit_scale``.
layer
    the parallel block ``h + attention(norm(h)) + mlp(norm(h))`` of one norm
    (``input_layernorm``); RoPE of interleaved pairs ``(2i, 2i + 1)`` on the sliding layers
    only: the global layers have none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_int, read_layer_types, read_real
from portable_llm.decoder.families.base import Family

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields Cohere 2 changes."""
    _, kinds = layer_types(d, n)
    return {
        "norm": "layer",
        "norm_bias": False,
        "parallel_block": True,
        "head_dim": d["hidden_size"] // d["num_attention_heads"],  # HF's, whatever is given
        "logit_scale": read_real(d, "logit_scale", 0.0625, low=0.0, low_open=True),
        "no_rope_layers": tuple(kind == "full_attention" for kind in kinds),
    }


def layer_types(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: as given, or (v4) every
    ``sliding_window_pattern``-th layer is global."""
    window = read_int(d, "sliding_window", low=0) if "sliding_window" in d else 4096
    given = read_layer_types(d)
    if given is not None:
        return window, given
    pattern = read_int(d, "sliding_window_pattern") or 4
    return window, [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]


FAMILY = Family(
    "cohere2",
    aliases={"layer_norm_eps": "rms_norm_eps"},
    defaults={"rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    o_bias=True,
    fields=fields,
    layer_types=layer_types,
    interleaved_rope=True,
)
