"""Granite (transformers' ``GraniteForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` and
    ``logits_scaling`` (each 1.0 by default); ``attention_bias`` biases ``o_proj`` too,
    ``mlp_bias`` the MLP.
model
    the embeddings times ``embedding_multiplier``; the logits divided by ``logits_scaling``
    (here: times its inverse).
layer
    Llama's, each sublayer's output times ``residual_multiplier`` before it is added to ``h``;
    the attention's scale is ``attention_multiplier`` (not ``D ** -0.5``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.decoder.config_values import read_bool, read_real
from portable_llm.decoder.families.base import Family

__all__ = ["FAMILY"]


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields Granite changes."""

    def positive(key: str) -> float:  # each a finite real > 0
        return read_real(d, key, 1.0, low=0.0, low_open=True)

    return {
        "embedding_multiplier": positive("embedding_multiplier"),
        "residual_multiplier": positive("residual_multiplier"),
        "attn_scale": positive("attention_multiplier"),
        "logit_scale": 1.0 / positive("logits_scaling"),
        "mlp_bias": read_bool(d, "mlp_bias"),
    }


FAMILY = Family("granite", o_bias=True, fields=fields)
