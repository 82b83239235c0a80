"""GPT-2's checkpoint layout (and Phi-3's fused projections), read into the decoder's (Llama's)
names.

GPT-2 stores its projections as ``Conv1D`` weights, ``(in, out)`` (the transpose of
``nn.Linear``'s), with q, k and v fused in one ``attn.c_attn`` ``(E, 3E)``; its names carry a
``transformer.`` prefix in ``GPT2LMHeadModel`` checkpoints and none in the original ``gpt2`` one.
Each tensor the decoder needs is one file tensor, sliced and transposed on the host
(:func:`gpt2_sources`); the buffers old checkpoints carry (``attn.bias``, ``attn.masked_bias``)
are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["GPT2_IGNORED", "Derived", "gpt2_sources", "llama4_sources", "phi3_sources"]

#: A tensor read from one file tensor: ``(file name, its shape, host transform)``.
Derived = tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]

#: Buffers of old GPT-2 checkpoints (the causal mask and its fill value), never weights.
GPT2_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")


def _t(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T)


def _cols(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    """Columns ``start:stop`` of a Conv1D weight ``(E, 3E)``, as a Linear weight ``(O, E)``."""
    return lambda a: np.ascontiguousarray(a[:, start:stop].T)


def _part(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda a: np.ascontiguousarray(a[start:stop])


def gpt2_sources(cfg: Any, files: dict[str, Any]) -> dict[str, Derived]:
    """For each tensor of ``expected_shapes(cfg)`` (a ``gpt2`` config), its file tensor and
    transform; ``files``: the checkpoint's tensor names (the prefix is taken from them)."""
    pre = "transformer." if any(n.startswith("transformer.") for n in files) else ""
    E, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size  # noqa: E741
    P = cfg.max_position_embeddings
    keep = lambda a: a  # noqa: E731
    out: dict[str, Derived] = {
        "model.embed_tokens.weight": (f"{pre}wte.weight", (V, E), keep),
        "model.embed_positions.weight": (f"{pre}wpe.weight", (P, E), keep),
        "model.norm.weight": (f"{pre}ln_f.weight", (E,), keep),
        "model.norm.bias": (f"{pre}ln_f.bias", (E,), keep),
    }
    for i in range(cfg.num_hidden_layers):
        h, p = f"{pre}h.{i}.", f"model.layers.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            for kind in ("weight", "bias"):
                out[f"{p}{ours}.{kind}"] = (f"{h}{theirs}.{kind}", (E,), keep)
        for j, name in enumerate("qkv"):
            cols = (j * E, (j + 1) * E)
            out[f"{p}self_attn.{name}_proj.weight"] = (f"{h}attn.c_attn.weight", (E, 3 * E),
                                                       _cols(*cols))  # fmt: skip
            out[f"{p}self_attn.{name}_proj.bias"] = (f"{h}attn.c_attn.bias", (3 * E,),
                                                     _part(*cols))  # fmt: skip
        out[f"{p}self_attn.o_proj.weight"] = (f"{h}attn.c_proj.weight", (E, E), _t)
        out[f"{p}self_attn.o_proj.bias"] = (f"{h}attn.c_proj.bias", (E,), keep)
        out[f"{p}mlp.up_proj.weight"] = (f"{h}mlp.c_fc.weight", (E, I), _t)
        out[f"{p}mlp.up_proj.bias"] = (f"{h}mlp.c_fc.bias", (I,), keep)
        out[f"{p}mlp.down_proj.weight"] = (f"{h}mlp.c_proj.weight", (I, E), _t)
        out[f"{p}mlp.down_proj.bias"] = (f"{h}mlp.c_proj.bias", (E,), keep)
    return out


def phi3_sources(cfg: Any, files: dict[str, Any]) -> dict[str, Derived]:
    """Phi-3's fused projections cut into the decoder's: ``self_attn.qkv_proj`` ``(H D + 2 H_kv
    D, E)`` into q, k and v (rows in that order), ``mlp.gate_up_proj`` ``(2 I, E)`` into gate
    (the first half) and up (HF ``Phi3MLP``'s ``chunk(2)``). The other tensors keep their names."""
    E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    out: dict[str, Derived] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = (f"{p}self_attn.qkv_proj.weight", (q + 2 * kv, E))
        for name, rows in (("q", (0, q)), ("k", (q, q + kv)), ("v", (q + kv, q + 2 * kv))):
            out[f"{p}self_attn.{name}_proj.weight"] = (*qkv, _part(*rows))
        fused = (f"{p}mlp.gate_up_proj.weight", (2 * I, E))
        out[f"{p}mlp.gate_proj.weight"] = (*fused, _part(0, I))
        out[f"{p}mlp.up_proj.weight"] = (*fused, _part(I, 2 * I))
    return out


def _experts(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    """Columns ``start:stop`` of stacked ``(X, in, out)`` experts, as ``(X, out, in)``."""
    return lambda a: np.ascontiguousarray(np.swapaxes(a[:, :, start:stop], 1, 2))


def llama4_sources(cfg: Any, files: dict[str, Any]) -> dict[str, Derived]:
    """Llama 4's fused experts (HF ``Llama4TextExperts``, stored ``(X, in, out)`` for
    ``torch.bmm``) cut into the decoder's stacked layout: ``feed_forward.experts.gate_up_proj``
    ``(X, E, 2 I)`` into ``mlp.experts.gate_proj`` and ``up_proj`` ``(X, I, E)`` (the first and
    second halves of the last axis, HF's ``chunk(2, dim=-1)``), ``feed_forward.experts.
    down_proj`` ``(X, I, E)`` into ``mlp.experts.down_proj`` ``(X, E, I)``. The other tensors
    keep their names (``feed_forward.`` read as ``mlp.``, the router as ``mlp.gate``)."""
    E, I, X = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    out: dict[str, Derived] = {}
    for i in range(cfg.num_hidden_layers):
        if not cfg.moe_layers[i]:
            continue
        p = f"model.layers.{i}."
        fused = (f"{p}feed_forward.experts.gate_up_proj", (X, E, 2 * I))
        out[f"{p}mlp.experts.gate_proj"] = (*fused, _experts(0, I))
        out[f"{p}mlp.experts.up_proj"] = (*fused, _experts(I, 2 * I))
        down = (f"{p}feed_forward.experts.down_proj", (X, I, E))
        out[f"{p}mlp.experts.down_proj"] = (*down, _experts(0, E))
    return out
