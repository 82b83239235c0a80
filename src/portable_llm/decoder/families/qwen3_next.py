"""Qwen3-Next (transformers' ``Qwen3NextForCausalLM``), read top-down: what it changes of Llama.

config.json
    ``layer_types``: ``"linear_attention"`` (a Gated DeltaNet) or ``"full_attention"`` per
    layer (HF's default: every ``full_attention_interval``-th, 4, is full); the DeltaNet's
    ``linear_num_key_heads`` (``H_k``), ``linear_key_head_dim`` (``D_k``),
    ``linear_num_value_heads`` (``H``), ``linear_value_head_dim`` (``D_v``) and
    ``linear_conv_kernel_dim`` (``K``); a sparse MoE with a shared expert (``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
    ``norm_topk_prob``) on every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``;
    ``partial_rotary_factor`` (0.25): RoPE on the first quarter of each head.
model
    Llama's, with the zero-centred RMSNorm of Gemma: every norm's scale is ``1 + weight``
    (``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``q_norm``,
    ``k_norm``), except the DeltaNet's gated norm (``linear_attn.norm``: ``weight``).
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

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from portable_llm.core.checks import float_compute_dtype
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.activations import logistic, sigmoid
from portable_llm.ops.delta_rule import gated_delta_rule
from portable_llm.ops.kernels import KernelSet
from portable_llm.ops.recurrent import softplus
from portable_llm.ops.short_conv import short_conv

__all__ = ["GatedDeltaNet", "split_ba", "split_gated_q_proj", "split_qkvz"]


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
class GatedDeltaNet:
    """One Gated DeltaNet layer's weights (HF ``Qwen3NextGatedDeltaNet``, its projections
    split by :func:`split_qkvz` and :func:`split_ba`) and its forward, :meth:`mix`.

    Its state is ``(conv, S)``: the convolution's last ``K - 1`` inputs ``(B, K - 1, C)``
    (``C = 2 H_k D_k + H D_v``) and the delta rule's ``(B, H, D_k, D_v)``.
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

    def mix(
        self, xp: Namespace, kn: KernelSet, x: Array, state: tuple[Any, Any] | None, *,
        all_states: bool = False,
    ) -> tuple[Array, tuple[Any, Any]]:  # fmt: skip
        """The layer's output ``(B, L, E)`` of its normed input ``x`` ``(B, L, E)``, and its
        state after the ``L`` tokens (``all_states``: after each, ``(B, L, ...)`` each), from
        ``state`` (``None``: zeros, a sequence's start)."""
        B, L = x.shape[0], x.shape[1]
        H, d_v, kd = self.num_v_heads, self.head_v_dim, self.num_k_heads * self.head_k_dim
        conv0, s0 = (None, None) if state is None else state
        qkv, conv = short_conv(  # (B, L, C): SiLU of the causal convolution
            kn.project(xp, x, self.w_qkv, None), self.conv, state=conv0, activation="silu",
            all_states=all_states,
        )  # fmt: skip
        q = xp.reshape(qkv[..., :kd], (B, L, self.num_k_heads, self.head_k_dim))
        k = xp.reshape(qkv[..., kd : 2 * kd], (B, L, self.num_k_heads, self.head_k_dim))
        v = xp.reshape(qkv[..., 2 * kd :], (B, L, H, d_v))
        beta = sigmoid(xp, kn.project(xp, x, self.w_b, None))  # (B, L, H), x's dtype
        a = kn.project(xp, x, self.w_a, None)  # (B, L, H)
        c = float_compute_dtype(xp, x.dtype)  # HF: g in float32 whatever the model's dtype
        a = xp.astype(a, c) + xp.astype(self.dt_bias, c)
        g = -xp.exp(xp.astype(self.A_log, c)) * softplus(xp, a)  # (B, L, H), <= 0
        o, S = gated_delta_rule(  # (B, L, H, D_v)
            q, k, v, g, beta, state=s0, qk_l2_norm=True, all_states=all_states
        )
        z = xp.reshape(kn.project(xp, x, self.w_z, None), (B, L, H, d_v))
        o = gated_rms_norm(xp, kn, o, z, self.norm, eps=self.eps)
        return kn.project(xp, xp.reshape(o, (B, L, H * d_v)), self.w_out, None), (conv, S)


def gated_rms_norm(
    xp: Namespace, kn: KernelSet, x: Array, z: Array, w: Array, *, eps: float
) -> Array:
    """HF ``Qwen3NextRMSNormGated``: ``rms_norm(x) * w`` (rounded as :func:`~portable_llm.rms_norm`
    rounds) times ``silu(z)``, the product in float32, rounded once to x's dtype."""
    c = float_compute_dtype(xp, x.dtype)
    zc = xp.astype(z, c)
    normed = xp.astype(kn.rms_norm(xp, x, w, eps=eps), c)
    return xp.astype(normed * (zc * logistic(xp, zc)), x.dtype)
