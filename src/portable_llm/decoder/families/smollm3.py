"""SmolLM3 (transformers' ``SmolLM3ForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``no_rope_layers`` (a flag per layer, 1 where the layer applies RoPE; v4 files may give only
    ``no_rope_layer_interval``, default 4: every 4th layer has none); ``use_sliding_window``
    with ``sliding_window`` puts a window on the no-RoPE layers (or where ``layer_types`` says
    ``sliding_attention``); ``rope_theta`` 2e6 and tied embeddings by default;
    ``attention_bias`` biases ``o_proj`` too, ``mlp_bias`` the MLP.
model
    Llama's.
layer
    Llama's, with no RoPE on the NoPE layers (their attention sees positions only through the
    causal mask).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import (
    read_bool,
    read_int,
    read_layer_types,
    read_rope_layers,
)
from portable_llm.decoder.families.base import Family

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields SmolLM3 changes."""
    return {
        "no_rope_layers": tuple(not rope for rope in read_rope_layers(d, n)),
        "mlp_bias": read_bool(d, "mlp_bias"),
    }


def layer_types(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: as given, else (HF's ``__post_init__``) the no-RoPE
    layers slide when ``use_sliding_window`` and ``sliding_window`` are both set."""
    window = read_int(d, "sliding_window", low=0)
    given = read_layer_types(d)
    if given is not None:
        return window, given
    slides = read_bool(d, "use_sliding_window") and window is not None
    rope = read_rope_layers(d, n)
    return window, [
        "sliding_attention" if slides and not rope[i] else "full_attention" for i in range(n)
    ]


FAMILY = Family(
    "smollm3",
    defaults={"rope_theta": 2e6, "tie_word_embeddings": True},
    o_bias=True,
    fields=fields,
    layer_types=layer_types,
)
