"""LFM2 (transformers' ``Lfm2ForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``norm_eps`` for ``rms_norm_eps`` (1e-5); ``layer_types`` of ``"full_attention"`` and
    ``"conv"`` (transformers 4 and the original files: ``full_attn_idxs``, the attention
    layers' indices, every layer when absent); ``conv_L_cache`` (3), the convolution's taps
    ``K``; ``conv_bias`` (false) biases the three conv-layer projections and the convolution;
    the MLP's width from ``intermediate_size`` (``block_ff_dim``) by
    ``block_auto_adjust_ff_dim`` (true: ``2/3`` of it, times ``block_ffn_dim_multiplier``,
    rounded up to ``block_multiple_of``); tied embeddings by default (``tie_embedding``);
    ``rope_theta`` 1e6, ``num_key_value_heads`` 8 and ``max_position_embeddings`` 128000 by
    default (HF's class defaults).
model
    Llama's; the final norm is named ``model.embedding_norm``.
layer (the recipe below)
    ``h = h + mixer(operator_norm(h))``, ``h = h + mlp(ffn_norm(h))``, the mixer being, by
    ``layer_types``:

    - ``"full_attention"``: Llama's attention with an RMSNorm over each head's ``D`` features
      of q and k (``q_layernorm``, ``k_layernorm``) before RoPE; ``out_proj`` for ``o_proj``;
    - ``"conv"``: the short convolution (:class:`ShortConv`): ``in_proj`` ``(3E, E)`` gives
      ``B``, ``C`` and ``x``; ``B * x`` goes through the causal depthwise convolution of ``K``
      taps (:func:`~portable_llm.short_conv`, its state the last ``K - 1`` inputs); ``C``
      gates its output; ``out_proj`` ``(E, E)``.

    The MLP is SwiGLU under the names ``feed_forward.w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from portable_llm.backends import backend_of
from portable_llm.decoder.config_values import read_bool, read_int, read_real
from portable_llm.decoder.families.base import (
    Family,
    LayerConfig,
    drop_attention,
    read_attention,
    read_mlp,
)
from portable_llm.decoder.layer_weights import Layer
from portable_llm.decoder.mixer import RecurrentMixer, zero_pads
from portable_llm.ops.kernels import KernelSet
from portable_llm.ops.short_conv import short_conv_body

__all__ = ["FAMILY", "ShortConv"]

LAYER_TYPES = ("full_attention", "conv")


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields LFM2 changes."""
    return {
        "qk_norm": True,
        "intermediate_size": _ff_width(d),
        "mixer": MappingProxyType({
            "conv_L_cache": read_int(d, "conv_L_cache") or 3,
            "conv_bias": read_bool(d, "conv_bias"),
        }),
    }  # fmt: skip


def _ff_width(d: Mapping[str, Any]) -> int:
    """The MLP's width (HF ``Lfm2MLP``): with ``block_auto_adjust_ff_dim``, ``2/3`` of
    ``intermediate_size``, times ``block_ffn_dim_multiplier`` and rounded up to a multiple of
    ``block_multiple_of``."""
    width = read_int(d, "intermediate_size", required=True)
    if not read_bool(d, "block_auto_adjust_ff_dim", True):
        return int(width)
    width = int(2 * width / 3)
    if d.get("block_ffn_dim_multiplier", 1.0) is not None:
        width = int(read_real(d, "block_ffn_dim_multiplier", 1.0, low=0.0) * width)
        step = read_int(d, "block_multiple_of") or 256
        width = step * ((width + step - 1) // step)
    return width


def layer_types(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: no window; the types as given, or (v4)
    ``"full_attention"`` at ``full_attn_idxs`` (every layer when absent) and ``"conv"``
    elsewhere."""
    given = d.get("layer_types")
    if given is None:
        idxs = d.get("full_attn_idxs")
        attention = set(range(n)) if idxs is None else set(idxs)
        given = ["full_attention" if i in attention else "conv" for i in range(n)]
    if not isinstance(given, list | tuple) or any(k not in LAYER_TYPES for k in given):
        raise ValueError(f"config.json: lfm2's layer_types must list {LAYER_TYPES}, got {given!r}")
    return None, list(given)


@dataclass(frozen=True)
class ShortConv(RecurrentMixer):
    """LFM2's ``Lfm2ShortConv``: ``out_proj(C * conv(B * x))`` with ``B, C, x`` the thirds of
    ``in_proj(h)``; its state the convolution's last ``K - 1`` inputs ``(B, K - 1, E)``."""

    in_proj: Any  # (3E, E)
    conv: Any  # (E, K): HF conv.weight (E, 1, K) squeezed
    out_proj: Any  # (E, E)
    in_bias: Any = None  # (3E,)
    conv_bias: Any = None  # (E,)
    out_bias: Any = None  # (E,)

    projections: ClassVar[tuple[str, ...]] = ("in_proj", "out_proj")

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        E, K = self.conv.shape
        return ((K - 1, E),)  # the convolution's last K - 1 inputs

    def mix(
        self, xp: Any, kn: KernelSet, x: Any, state: tuple[Any, ...] | None, *,
        pads: Any, all_states: bool,
    ) -> tuple[Any, tuple[Any, ...]]:  # fmt: skip
        x = zero_pads(xp, x, pads)  # HF: the pad tokens' inputs are zeros
        bcx = kn.project(xp, x, self.in_proj, self.in_bias)  # (B, L, 3E)
        E = bcx.shape[-1] // 3
        b, c, h = bcx[..., :E], bcx[..., E : 2 * E], bcx[..., 2 * E :]  # (B, L, E) each
        # the convolution's inputs at the pads are zeros too: with in_proj's bias (conv_bias)
        # HF's would let the pads' B * x into the state; without it, both are zeros anyway
        y, conv_state = short_conv_body(
            xp, kn.choose, zero_pads(xp, b * h, pads), self.conv, bias=self.conv_bias,
            state=None if state is None else state[0], silu=False, all_states=all_states,
        )  # fmt: skip
        return kn.project(xp, c * y, self.out_proj, self.out_bias), (conv_state,)  # (B, L, E)


def read_layer(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i``: attention or the short convolution, then the SwiGLU MLP."""
    p = f"model.layers.{i}."
    conv = cfg.layer_types[i] == "conv"
    return Layer(
        input_norm=w[p + "input_layernorm.weight"],  # HF operator_norm
        post_norm=w[p + "post_attention_layernorm.weight"],  # HF ffn_norm
        attn=None if conv else read_attention(cfg, w, i),
        mixer=_read_conv(w, p + "conv.") if conv else None,
        mlp=read_mlp(w, i),
        moe=None,
    )


def _read_conv(w: Mapping[str, Any], c: str) -> ShortConv:
    weight = w[c + "conv.weight"]  # (E, 1, K)
    E, _, K = weight.shape
    bk = backend_of(weight)
    assert bk is not None, "a checkpoint's tensors are arrays of the model's backend"
    return ShortConv(
        in_proj=w[c + "in_proj.weight"],
        conv=bk.xp.reshape(weight, (E, K)),
        out_proj=w[c + "out_proj.weight"],
        in_bias=w.get(c + "in_proj.bias"),
        conv_bias=w.get(c + "conv.bias"),
        out_bias=w.get(c + "out_proj.bias"),
    )


def tensors(cfg: Any, i: int, out: dict[str, tuple[int, ...]]) -> None:
    """Layer ``i``'s tensors where LFM2's differ from Llama's: a conv layer has its short
    convolution's and no attention's."""
    if cfg.layer_types[i] != "conv":
        return
    drop_attention(out, i)
    E, K, c = cfg.hidden_size, cfg.mixer["conv_L_cache"], f"model.layers.{i}.conv."
    out |= {c + "in_proj.weight": (3 * E, E), c + "conv.weight": (E, 1, K),
            c + "out_proj.weight": (E, E)}  # fmt: skip
    if cfg.mixer["conv_bias"]:
        out |= {c + "in_proj.bias": (3 * E,), c + "conv.bias": (E,), c + "out_proj.bias": (E,)}


FAMILY = Family(
    "lfm2",
    aliases={
        "norm_eps": "rms_norm_eps",
        "tie_embedding": "tie_word_embeddings",
        "block_ff_dim": "intermediate_size",
    },
    defaults={
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "num_key_value_heads": 8,
        "max_position_embeddings": 128_000,
    },
    fields=fields,
    layer_types=layer_types,
    read_layer=read_layer,
    names=(
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".operator_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        (".feed_forward.w1.", ".mlp.gate_proj."),
        (".feed_forward.w3.", ".mlp.up_proj."),
        (".feed_forward.w2.", ".mlp.down_proj."),
        ("model.embedding_norm.", "model.norm."),
    ),
    tensors=tensors,
)
