"""The families the decoder runs that live in a file of their own (``<model_type>.py``).

Each file reads top-down as its architecture (the ``config.json`` names it reads, the config
fields that differ from Llama's, its layer recipe) and ends with ``FAMILY``, a
:class:`~portable_llm.decoder.families.base.Family`. :data:`FAMILIES` finds them: every module
of this package with a ``FAMILY`` is one, by its ``model_type`` (adding a family adds its file,
no line here). ``decoder/config.py`` and the model look a family up here; the families not
moved here yet are the branches of ``decoder/config.py`` over Llama's layer
(:func:`~portable_llm.decoder.families.base.read_layer`).
"""

from __future__ import annotations

import importlib
import pkgutil

from portable_llm.decoder.families.base import Family, ReadLayer, read_layer

__all__ = ["FAMILIES", "Family", "layer_reader"]


def _find() -> dict[str, Family]:
    """``model_type`` -> family, of every module here that defines ``FAMILY``, by module name."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            if family.model_type in found:
                raise RuntimeError(f"two family files define model_type {family.model_type!r}")
            found[family.model_type] = family
    return found


#: ``model_type`` -> its family.
FAMILIES: dict[str, Family] = _find()


def layer_reader(model_type: str) -> ReadLayer:
    """The layer recipe of ``model_type``: its family's, else Llama's."""
    family = FAMILIES.get(model_type)
    return read_layer if family is None else family.read_layer
