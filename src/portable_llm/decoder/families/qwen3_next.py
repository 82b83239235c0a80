"""Qwen3-Next (transformers' ``Qwen3NextForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``layer_types``: ``"linear_attention"`` (a Gated DeltaNet) or ``"full_attention"`` per
    layer (HF's default: every ``full_attention_interval``-th, 4, is full); the DeltaNet's
    ``linear_num_key_heads`` (``H_k``), ``linear_key_head_dim`` (``D_k``),
    ``linear_num_value_heads`` (``H``), ``linear_value_head_dim`` (``D_v``) and
    ``linear_conv_kernel_dim`` (``K``); a sparse MoE with a shared expert (``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
    ``norm_topk_prob``) on every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``;
    ``partial_rotary_factor`` (0.25): RoPE on the first quarter of each head; ``head_dim``
    256; ``attention_bias`` biases ``q_proj`` (its gate's rows too), ``k/v/o_proj``. A
    checkpoint's ``mtp.*`` tensors (multi-token prediction) are ignored, as transformers does.
model
    Llama's, with zero-centred RMSNorms: every norm's scale is ``1 + weight``
    (``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``q_norm``,
    ``k_norm``), formed and applied in float32 per call with one rounding, as HF's
    ``Qwen3NextRMSNorm`` (``norm_offset_per_call``; Gemma's is formed once at load), except
    the DeltaNet's gated norm (``linear_attn.norm``: ``weight`` itself).
layer
    ``h = h + mixer(norm(h))``, ``h = h + moe(norm(h))``; the mixer is
    - full attention: Qwen3's (q/k norms per head) with an output gate: ``q_proj`` gives each
      head ``2 D`` rows, the query's ``D`` then the gate's ``D``
      (:func:`split_gated_q_proj`), and the heads' output is multiplied by
      ``sigmoid(x wg^T)`` before ``o_proj``;
    - a Gated DeltaNet (:class:`GatedDeltaNet`): ``in_proj_qkvz`` and ``in_proj_ba`` give q, k,
      v, z and b, a per key-head group (:func:`split_qkvz`, :func:`split_ba`); a depthwise
      causal convolution with SiLU over q, k, v (:func:`~portable_llm.short_conv`); the gated
      delta rule (:func:`~portable_llm.gated_delta_rule`) with L2-normed q and k,
      ``beta = sigmoid(b)`` and ``g = -exp(A_log) softplus(a + dt_bias)``; an RMSNorm of each
      head's output gated by ``silu(z)``; ``out_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import pairwise
from types import MappingProxyType
from typing import Any, ClassVar

from portable_llm.backends import backend_of
from portable_llm.core.checks import float_compute_dtype
from portable_llm.core.types import Array, Namespace
from portable_llm.decoder.config_values import read_bool, read_int, read_sparse_layers
from portable_llm.decoder.families import qwen2_moe
from portable_llm.decoder.families.base import (
    Family,
    LayerConfig,
    drop_attention,
    read_attention,
    read_mlp,
    read_moe,
)
from portable_llm.decoder.layer_weights import Layer
from portable_llm.decoder.mixer import RecurrentMixer, zero_pads
from portable_llm.ops.activations import logistic, sigmoid
from portable_llm.ops.delta_rule import gated_delta_rule_body
from portable_llm.ops.kernels import KernelSet
from portable_llm.ops.recurrent import softplus
from portable_llm.ops.short_conv import short_conv_body

__all__ = ["FAMILY", "GatedDeltaNet", "split_ba", "split_gated_q_proj", "split_qkvz"]

LAYER_TYPES = ("linear_attention", "full_attention")
#: HF's class defaults of the Gated DeltaNet's sizes (``Qwen3NextConfig``).
_LINEAR = {
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields Qwen3-Next changes."""
    x = read_int(d, "num_experts", low=0)
    x = 512 if x is None else x
    linear = {k: read_int(d, k) or v for k, v in _LINEAR.items()}
    if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise ValueError(
            f"config.json: linear_num_value_heads={linear['linear_num_value_heads']} is not a "
            f"multiple of linear_num_key_heads={linear['linear_num_key_heads']}"
        )
    return {
        "qk_norm": True,
        "norm_offset": 1.0,  # the zero-centred norms: scale 1 + w, in float32 per call (HF's)
        "norm_offset_per_call": True,
        "num_experts": x,
        "num_experts_per_tok": read_int(d, "num_experts_per_tok") or 10,
        "norm_topk_prob": read_bool(d, "norm_topk_prob", True),
        "moe_intermediate_size": read_int(d, "moe_intermediate_size") or 512,
        "shared_expert_intermediate_size": read_int(d, "shared_expert_intermediate_size") or 512,
        "moe_layers": read_sparse_layers(d, n, x),
        "mixer": MappingProxyType(linear),
    }


def layer_types(d: Mapping[str, Any], n: int) -> tuple[None, list[str]]:
    """``(sliding_window, layer_types)``: no window; the types as given, or (as HF's config
    builds them) every ``full_attention_interval``-th layer (4) full, the others linear."""
    given = d.get("layer_types")
    if given is None:
        every = read_int(d, "full_attention_interval") or 4
        given = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if not isinstance(given, list | tuple) or any(k not in LAYER_TYPES for k in given):
        raise ValueError(
            f"config.json: qwen3_next's layer_types must list {LAYER_TYPES}, got {given!r}"
        )
    return None, list(given)


def read_layer(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i``: the gated attention or the Gated DeltaNet, then the MoE (or, on
    ``mlp_only_layers``, the dense MLP), each after a zero-centred RMSNorm."""
    p = f"model.layers.{i}."
    linear = cfg.layer_types[i] == "linear_attention"
    moe = cfg.moe_layers[i]
    return Layer(
        input_norm=w[p + "input_layernorm.weight"],
        post_norm=w[p + "post_attention_layernorm.weight"],
        attn=None if linear else _gated_attention(cfg, w, i),
        mixer=_read_deltanet(cfg, w, p + "linear_attn.") if linear else None,
        mlp=None if moe else read_mlp(w, i),
        moe=read_moe(cfg, w, i) if moe else None,  # with the gated shared expert
    )


def _gated_attention(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Any:
    """Qwen3's attention, ``q_proj`` (and its bias) split into the queries and the gate."""
    a = read_attention(cfg, w, i)
    xp, H, D = _xp(a.wq), cfg.num_attention_heads, cfg.head_dim
    wq, wg = split_gated_q_proj(xp, a.wq, H, D)
    bq, bg = (None, None) if a.bq is None else split_gated_q_proj(xp, a.bq, H, D)
    return replace(a, wq=wq, wg=wg, bq=bq, bg=bg, norm_offset=1.0)


def _xp(w: Any) -> Namespace:
    """The namespace of a checkpoint tensor ``w`` (an array of the model's backend)."""
    bk = backend_of(w)
    assert bk is not None, "a checkpoint's tensors are arrays of the model's backend"
    return bk.xp


def split_gated_q_proj(xp: Namespace, w: Array, H: int, D: int) -> tuple[Array, Array]:
    """HF's ``q_proj.weight`` ``(H * 2 D, E)`` (or its bias, ``(H * 2 D,)``) of a gated
    attention as ``(wq, wg)``, each ``(H * D, E)`` (``(H * D,)``): each head's rows are its
    query's ``D``, then its gate's ``D``."""
    rest = tuple(w.shape[1:])
    heads = xp.reshape(w, (H, 2 * D, *rest))  # (H, 2 D, E..)
    q, gate = (xp.reshape(heads[:, a : a + D, ...], (H * D, *rest)) for a in (0, D))
    return q, gate


def split_qkvz(
    xp: Namespace, w: Array, h_k: int, d_k: int, H: int, d_v: int
) -> tuple[Array, Array]:
    """HF's ``in_proj_qkvz.weight`` as ``(w_qkv, w_z)``: ``(2 H_k D_k + H D_v, E)``, the rows of
    q, k and v (the convolution's channels, in HF's order), and ``(H D_v, E)``.

    HF lays the rows out per key-head group ``g`` (HF ``fix_query_key_value_ordering``):
    ``q_g`` (``D_k``), ``k_g`` (``D_k``), ``v_g`` and ``z_g`` (``H / H_k`` value heads of
    ``D_v`` each)."""
    E, r = w.shape[-1], H // h_k
    groups = xp.reshape(w, (h_k, 2 * d_k + 2 * r * d_v, E))  # (H_k, rows per group, E)
    cuts = (0, d_k, 2 * d_k, 2 * d_k + r * d_v, 2 * d_k + 2 * r * d_v)
    q, k, v, z = (xp.reshape(groups[:, a:b, :], (h_k * (b - a), E)) for a, b in pairwise(cuts))
    return xp.concat([q, k, v], axis=0), z


def split_ba(xp: Namespace, w: Array, h_k: int, H: int) -> tuple[Array, Array]:
    """HF's ``in_proj_ba.weight`` ``(2 H, E)`` as ``(w_b, w_a)``, each ``(H, E)``: per key-head
    group, its ``H / H_k`` rows of b then its ``H / H_k`` rows of a."""
    E, r = w.shape[-1], H // h_k
    groups = xp.reshape(w, (h_k, 2 * r, E))
    return xp.reshape(groups[:, :r, :], (H, E)), xp.reshape(groups[:, r:, :], (H, E))


@dataclass(frozen=True)
class GatedDeltaNet(RecurrentMixer):
    """One Gated DeltaNet layer's weights (HF ``Qwen3NextGatedDeltaNet``, its projections
    split by :func:`split_qkvz` and :func:`split_ba`) and its forward, :meth:`mix`.

    Its state is ``(conv, S)``: the convolution's last ``K - 1`` inputs ``(B, K - 1, C)``
    (``C = 2 H_k D_k + H D_v``) and the delta rule's ``(B, H, D_k, D_v)`` (float32).
    """

    w_qkv: Any  # (C, E): q, k, v, the convolution's channels
    w_z: Any  # (H * D_v, E): the output gate
    w_b: Any  # (H, E): beta = sigmoid(x w_b^T)
    w_a: Any  # (H, E): g = -exp(A_log) softplus(x w_a^T + dt_bias)
    conv: Any  # (C, K): HF conv1d.weight.squeeze(1)
    dt_bias: Any  # (H,)
    A_log: Any  # (H,)
    norm: Any  # (D_v,): the gated RMSNorm's weight (not zero-centred)
    w_out: Any  # (E, H * D_v)
    num_k_heads: int  # H_k
    head_k_dim: int  # D_k
    num_v_heads: int  # H
    head_v_dim: int  # D_v
    eps: float

    projections: ClassVar[tuple[str, ...]] = ("w_qkv", "w_z", "w_b", "w_a", "w_out")

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        C, K = self.conv.shape
        H, d_k, d_v = self.num_v_heads, self.head_k_dim, self.head_v_dim
        return ((K - 1, C), (H, d_k, d_v))  # the convolution's window, the delta rule's S

    def mix(
        self, xp: Namespace, kn: KernelSet, x: Array, state: tuple[Any, ...] | None, *,
        pads: Any = None, all_states: bool = False,
    ) -> tuple[Array, tuple[Any, ...]]:  # fmt: skip
        """The layer's output ``(B, L, E)`` of its normed input ``x`` ``(B, L, E)``, and its
        state after the ``L`` tokens (``all_states``: after each, ``(B, L, ...)`` each), from
        ``state`` (``None``: zeros, a sequence's start); pad columns (``pads``) zeroed first,
        as HF's ``apply_mask_to_padding_states``."""
        x = zero_pads(xp, x, pads)
        B, L = x.shape[0], x.shape[1]
        H, d_v, kd = self.num_v_heads, self.head_v_dim, self.num_k_heads * self.head_k_dim
        conv0, s0 = (None, None) if state is None else state
        qkv, conv = short_conv_body(  # (B, L, C): SiLU of the causal convolution
            xp, kn.choose, kn.project(xp, x, self.w_qkv, None), self.conv, bias=None,
            state=conv0, silu=True, all_states=all_states,
        )  # fmt: skip
        q = xp.reshape(qkv[..., :kd], (B, L, self.num_k_heads, self.head_k_dim))
        k = xp.reshape(qkv[..., kd : 2 * kd], (B, L, self.num_k_heads, self.head_k_dim))
        v = xp.reshape(qkv[..., 2 * kd :], (B, L, H, d_v))
        beta = sigmoid(xp, kn.project(xp, x, self.w_b, None))  # (B, L, H), x's dtype
        c = float_compute_dtype(xp, x.dtype)  # HF: g in float32 whatever the model's dtype
        a = xp.astype(kn.project(xp, x, self.w_a, None), c) + xp.astype(self.dt_bias, c)
        g = -xp.exp(xp.astype(self.A_log, c)) * softplus(xp, a)  # (B, L, H), <= 0
        o, S = gated_delta_rule_body(  # (B, L, H, D_v)
            xp, kn.choose, q, k, v, g, beta, state=s0, qk_l2_norm=True, scale=None,
            all_states=all_states,
        )  # fmt: skip
        z = xp.reshape(kn.project(xp, x, self.w_z, None), (B, L, H, d_v))
        o = _gated_norm(xp, kn, o, z, self.norm, eps=self.eps)
        return kn.project(xp, xp.reshape(o, (B, L, H * d_v)), self.w_out, None), (conv, S)


def _gated_norm(xp: Namespace, kn: KernelSet, x: Array, z: Array, w: Array, *, eps: float) -> Array:
    """HF ``Qwen3NextRMSNormGated``: ``rms_norm(x) * w`` (rounded as :func:`~portable_llm.rms_norm`
    rounds) times ``silu(z)``, the product in float32, rounded once to x's dtype.

    Not the public :func:`~portable_llm.gated_rms_norm` (Mamba-2's and Falcon-H1's), which
    rounds once after the weight and the gate: Qwen3-Next's rounds ``rms_norm(x) * w`` to x's
    dtype first, and in bfloat16 the two orders differ by a rounding step. Its norm runs through
    the kernel set's ``rms_norm`` (bound once, traced)."""
    c = float_compute_dtype(xp, x.dtype)
    zc = xp.astype(z, c)
    normed = xp.astype(kn.rms_norm(xp, x, w, eps=eps), c)
    return xp.astype(normed * (zc * logistic(xp, zc)), x.dtype)


def _read_deltanet(cfg: LayerConfig, w: Mapping[str, Any], c: str) -> GatedDeltaNet:
    """The Gated DeltaNet of the tensors under ``c`` (``model.layers.{i}.linear_attn.``):
    HF's ``in_proj_qkvz`` cut by :func:`split_qkvz`, or its two parts ``in_proj_qkv`` and
    ``in_proj_z`` as a GGUF file holds them (each may be a quantized weight)."""
    m = cfg.mixer
    h_k, d_k = m["linear_num_key_heads"], m["linear_key_head_dim"]
    H, d_v = m["linear_num_value_heads"], m["linear_value_head_dim"]
    conv = w[c + "conv1d.weight"]  # (C, 1, K)
    xp = _xp(conv)
    if c + "in_proj_qkv.weight" in w:  # already cut (a GGUF's attn_qkv, attn_gate): as given
        w_qkv, w_z = w[c + "in_proj_qkv.weight"], w[c + "in_proj_z.weight"]
    else:
        w_qkv, w_z = split_qkvz(xp, w[c + "in_proj_qkvz.weight"], h_k, d_k, H, d_v)
    w_b, w_a = split_ba(xp, w[c + "in_proj_ba.weight"], h_k, H)
    return GatedDeltaNet(
        w_qkv=w_qkv, w_z=w_z, w_b=w_b, w_a=w_a,
        conv=xp.reshape(conv, (conv.shape[0], conv.shape[2])),
        dt_bias=w[c + "dt_bias"], A_log=w[c + "A_log"], norm=w[c + "norm.weight"],
        w_out=w[c + "out_proj.weight"], num_k_heads=h_k, head_k_dim=d_k, num_v_heads=H,
        head_v_dim=d_v, eps=cfg.rms_norm_eps,
    )  # fmt: skip


def tensors(cfg: Any, i: int, out: dict[str, tuple[int, ...]]) -> None:
    """Layer ``i``'s tensors where Qwen3-Next's differ from Llama's: a linear-attention layer
    has its Gated DeltaNet's and no attention's; a full-attention layer's ``q_proj`` (and its
    bias) holds the gate's rows too; a sparse layer has Qwen2-MoE's gated shared expert."""
    qwen2_moe.tensors(cfg, i, out)
    p = f"model.layers.{i}."
    if cfg.layer_types[i] != "linear_attention":
        for kind in ("weight", "bias"):
            q = p + "self_attn.q_proj." + kind
            if q in out:  # (H * 2 D, ...): each head's query and its gate
                out[q] = (2 * out[q][0], *out[q][1:])
        return
    drop_attention(out, i)
    m, E, c = cfg.mixer, cfg.hidden_size, p + "linear_attn."
    kd = m["linear_num_key_heads"] * m["linear_key_head_dim"]
    H = m["linear_num_value_heads"]
    vd = H * m["linear_value_head_dim"]
    out |= {
        c + "in_proj_qkvz.weight": (2 * kd + 2 * vd, E),
        c + "in_proj_ba.weight": (2 * H, E),
        c + "conv1d.weight": (2 * kd + vd, 1, m["linear_conv_kernel_dim"]),
        c + "dt_bias": (H,),
        c + "A_log": (H,),
        c + "norm.weight": (m["linear_value_head_dim"],),
        c + "out_proj.weight": (E, vd),
    }


FAMILY = Family(
    "qwen3_next",
    defaults={"head_dim": 256, "intermediate_size": 5632, "partial_rotary_factor": 0.25},
    o_bias=True,
    fields=fields,
    layer_types=layer_types,
    read_layer=read_layer,
    tensors=tensors,
)
