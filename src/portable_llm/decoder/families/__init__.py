"""The families the decoder runs that live in a file of their own (``<model_type>.py``).

Each file reads top-down as its architecture (the ``config.json`` names it reads, the config
fields that differ from Llama's, its layer recipe) and ends with a
:class:`~portable_llm.decoder.families.base.Family`; :data:`FAMILIES` lists them by
``model_type``. ``decoder/config.py`` and the model look a family up here; the families not
moved here yet are the branches of ``decoder/config.py`` over Llama's layer
(:func:`~portable_llm.decoder.families.base.read_layer`).
"""

from __future__ import annotations

from portable_llm.decoder.families import (
    cohere2,
    gemma2,
    granite,
    olmo2,
    qwen3_moe,
    smollm3,
    starcoder2,
)
from portable_llm.decoder.families.base import Family, ReadLayer, read_layer

__all__ = ["FAMILIES", "Family", "layer_reader"]

#: ``model_type`` -> its family.
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        gemma2.FAMILY,
        qwen3_moe.FAMILY,
        smollm3.FAMILY,
        olmo2.FAMILY,
        granite.FAMILY,
        starcoder2.FAMILY,
        cohere2.FAMILY,
    )
}


def layer_reader(model_type: str) -> ReadLayer:
    """The layer recipe of ``model_type``: its family's, else Llama's."""
    family = FAMILIES.get(model_type)
    return read_layer if family is None else family.read_layer
