"""gpt-oss's experts as transformers stores them, read into the decoder's stacked layout.

Each layer ``model.layers.{i}.mlp.experts.`` holds (``X`` experts, ``I`` their width, ``E`` the
hidden size):

=========================  =======================  =============================================
file tensor                shape                    the decoder's (``moe``'s) tensors
=========================  =======================  =============================================
``gate_up_proj``           ``(X, E, 2I)``           ``gate_proj`` = ``[..., 0::2]``, ``up_proj``
                                                    = ``[..., 1::2]``, each transposed to
                                                    ``(X, I, E)`` (gate and up *interleaved*)
``gate_up_proj_bias``      ``(X, 2I)``              ``gate_bias`` ``[:, 0::2]``, ``up_bias``
                                                    ``[:, 1::2]``, ``(X, I)``
``down_proj``              ``(X, I, E)``            ``down_proj`` ``(X, E, I)`` (transposed)
``down_proj_bias``         ``(X, E)``               ``down_bias``
=========================  =======================  =============================================

The MXFP4 checkpoints (OpenAI's, ``quantization_config.quant_method == "mxfp4"``) store the two
projections as ``gate_up_proj_blocks`` ``(X, 2I, E / 32, 16)`` and ``gate_up_proj_scales``
``(X, 2I, E / 32)`` (uint8: the rows are the *output* features, gate and up interleaved), and
``down_proj_blocks`` ``(X, E, I / 32, 16)``, ``down_proj_scales`` ``(X, E, I / 32)``: already
``moe``'s ``(X, N, K)`` layout, read as :class:`~portable_llm.MXFP4Weight` with the even rows the
gate's and the odd rows the up's (:func:`~portable_llm.checkpoint.mxfp4.mxfp4_from_blocks`; the
codes are never decoded). The biases are floats in both forms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from portable_llm.checkpoint.gpt2_layout import Derived

__all__ = ["Mxfp4Source", "gpt_oss_sources"]


class Mxfp4Source(NamedTuple):
    """An MXFP4 weight of the decoder read from a ``*_blocks``/``*_scales`` pair: their file
    names, the shapes they must have, and the rows (axis 1) it takes."""

    blocks: str
    scales: str
    blocks_shape: tuple[int, ...]
    rows: slice


def _interleaved(start: int, transpose: bool) -> Callable[[np.ndarray], np.ndarray]:
    """Every other entry of the last axis from ``start`` (gate: 0, up: 1), experts'
    ``(X, E, I)`` transposed to ``(X, I, E)`` when ``transpose``."""
    if transpose:
        return lambda a: np.ascontiguousarray(np.swapaxes(a[..., start::2], 1, 2))
    return lambda a: np.ascontiguousarray(a[..., start::2])


def _swap(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(a, 1, 2))


def _keep(a: np.ndarray) -> np.ndarray:
    return a


def gpt_oss_sources(
    cfg: Any, files: dict[str, Any]
) -> tuple[dict[str, Derived], dict[str, Mxfp4Source]]:
    """``(float tensors cut from the file's, MXFP4 weights)`` by the decoder's names, for the
    experts of every layer (the table of the module docstring); a layer whose file holds
    ``gate_up_proj_blocks`` reads its projections as MXFP4. The other tensors keep their names
    (the router ``mlp.router`` read as ``mlp.gate``)."""
    E, I, X = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    floats: dict[str, Derived] = {}
    mxfp4: dict[str, Mxfp4Source] = {}
    for i in range(cfg.num_hidden_layers):
        f = f"model.layers.{i}.mlp.experts."
        if f + "gate_up_proj_blocks" in files:
            gu = (f + "gate_up_proj_blocks", f + "gate_up_proj_scales", (X, 2 * I, E // 32, 16))
            mxfp4[f + "gate_proj"] = Mxfp4Source(*gu, slice(0, None, 2))
            mxfp4[f + "up_proj"] = Mxfp4Source(*gu, slice(1, None, 2))
            down = (f + "down_proj_blocks", f + "down_proj_scales", (X, E, I // 32, 16))
            mxfp4[f + "down_proj"] = Mxfp4Source(*down, slice(None))
        else:
            fused = (f + "gate_up_proj", (X, E, 2 * I))
            floats[f + "gate_proj"] = (*fused, _interleaved(0, True))
            floats[f + "up_proj"] = (*fused, _interleaved(1, True))
            floats[f + "down_proj"] = (f + "down_proj", (X, I, E), _swap)
        bias = (f + "gate_up_proj_bias", (X, 2 * I))
        floats[f + "gate_bias"] = (*bias, _interleaved(0, False))
        floats[f + "up_bias"] = (*bias, _interleaved(1, False))
        floats[f + "down_bias"] = (f + "down_proj_bias", (X, E), _keep)
    return floats, mxfp4
