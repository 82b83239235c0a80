"""Multi-head latent attention (MLA) of DeepSeek V2/V3 and Kimi K2 (HF ``DeepseekV3Attention``).

The keys and values of every head come from one small latent per token, so a cache holds the
latent, not the heads::

    q          = q_b_proj(rms_norm(q_a_proj(x)))  (or q_proj(x))     # (B, H, L, d_n + d_r)
    c_kv, k_pe = split(kv_a_proj_with_mqa(x), [R, d_r])                # (B, 1, L, R), (.., d_r)
    c_kv       = rms_norm(c_kv)  (kv_a_layernorm)
    q_pe, k_pe = rope(q[..., d_n:]), rope(k_pe)                       # k_pe: one head, shared
    k_nope, v  = split(kv_b_proj(c_kv), [d_n, d_v]) per head          # the expanded form
    o          = sdpa([q_nope, q_pe], [k_nope, k_pe], v) -> o_proj

The absorbed form (the one the latent cache exists for) folds ``W_UK`` (the ``k_nope`` rows of
``kv_b_proj``) into the query and applies ``W_UV`` (the ``v`` rows) after the attention, so the
heads are never expanded: one key/value head of ``R + d_r`` and ``R`` features::

    scores = [q_nope W_UK, q_pe] . [c_kv, k_pe]      o = (softmax(scores) c_kv) W_UV^T

The checks live in :mod:`portable_llm.attn.latent_args`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from portable_llm.attn.block import CallState
from portable_llm.attn.kv_glue import block_kv_mask
from portable_llm.attn.latent_args import (
    FORMS,
    OP,
    LatentWeights,
    absorbs,
    latent_args,
    latent_softmax_scale,
)
from portable_llm.attn.sdpa import OP as SDPA
from portable_llm.attn.sdpa import sdpa_args
from portable_llm.core.dispatch import pick
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.affine import affine
from portable_llm.ops.kernels import Kernels

__all__ = [
    "FORMS",
    "LatentCallState",
    "LatentState",
    "LatentWeights",
    "absorbs",
    "latent_attention",
    "latent_attention_body",
    "latent_softmax_scale",
]

#: DeepSeek V3 and Kimi K2 lay their rotary features out in interleaved pairs (HF
#: ``rope_interleave=True``, the config's default): RoPE's ``traditional`` pairs.
_DEEPSEEK_ROPE: Mapping[str, Any] = {"traditional": True}


# Over 80 lines for its signature and docstring (every weight and size of HF's
# DeepseekV3Attention); the code is latent_args' checks, then latent_attention_body.
def latent_attention(
    x: Any,
    /,
    *,
    wkv_a: Any,
    kv_a_norm: Any,
    wkv_b: Any,
    wo: Any,
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    wq: Any = None,
    wq_a: Any = None,
    q_a_norm: Any = None,
    wq_b: Any = None,
    bq_a: Any = None,
    bkv_a: Any = None,
    bo: Any = None,
    norm_eps: float = 1e-6,
    rope: Mapping[str, Any] | None = _DEEPSEEK_ROPE,
    scale: float | None = None,
    mask: Any = "causal",
    offset: int = 0,
    cache: Any = None,
    form: str = "auto",
    block_size: int = 256,
    impl: str = "auto",
    backend: str | None = None,
) -> Any:
    """Multi-head latent attention with HF ``DeepseekV3Attention``'s weights and order.

    Parameters
    ----------
    x : array, shape ``(B, L, E)``, float dtype
    wkv_a : array, shape ``(R + d_r, E)`` (HF ``kv_a_proj_with_mqa.weight``)
        ``R = kv_lora_rank``, ``d_r = qk_rope_head_dim``: the latent ``c_kv`` and the one rotary
        key ``k_pe`` every head shares.
    kv_a_norm : array, shape ``(R,)`` (``kv_a_layernorm.weight``; RMSNorm with ``norm_eps``)
    wkv_b : array, shape ``(H * (d_n + d_v), R)`` (``kv_b_proj.weight``)
        Per head ``h``, rows ``h (d_n + d_v) ..`` give ``k_nope`` (``W_UK``, ``d_n`` rows), then
        ``v`` (``W_UV``, ``d_v`` rows).
    wo : array, shape ``(E_out, H * d_v)`` (``o_proj.weight``)
    num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim : int
        ``H``, ``R``, ``d_n``, ``d_r`` (even), ``d_v``: HF's config names.
    wq : array, shape ``(H * (d_n + d_r), E)``, optional
        ``q_proj.weight`` of a model without a query LoRA (``q_lora_rank=None``), or else:
    wq_a, q_a_norm, wq_b : arrays, shapes ``(R_q, E)``, ``(R_q,)``, ``(H * (d_n + d_r), R_q)``
        ``q_a_proj``, ``q_a_layernorm`` and ``q_b_proj`` (``R_q = q_lora_rank``).
    bq_a, bkv_a, bo : arrays, shapes ``(R_q,)``, ``(R + d_r,)``, ``(E_out,)``, optional
        The biases of ``config.attention_bias``.
        Projections may be :class:`~portable_llm.QuantizedWeight`; float weights of another
        float dtype than ``x`` are cast to ``x``'s (the mixed-precision rule).
    norm_eps : float
        Of both RMSNorms (HF's ``DeepseekV3RMSNorm`` default 1e-6 there, not ``rms_norm_eps``).
    rope : dict or None
        Options of :func:`~portable_llm.rope` for the ``d_r`` rotary features; the default
        ``{"traditional": True}`` is DeepSeek's interleaved pairs (``rope_interleave=True``):
        HF rotates them into another order of features, which no dot product sees.
        ``{"base": rope_theta, "scaling": rope_scaling, "traditional": True}`` for a model.
    scale : float, optional
        Default :func:`latent_softmax_scale`: ``(d_n + d_r) ** -0.5``, times ``mscale ** 2``
        under a yarn ``rope["scaling"]`` with ``mscale_all_dim``.
    mask : "causal", None or a boolean/additive array broadcastable to ``(B, H, L, S)``
    offset : int
        Position of the first token (RoPE); with a cache, leave it at 0 (``cache.offset``).
    cache : KVCache, optional
        The compressed cache: it stores ``c_kv`` ``(B, 1, L, R)`` as its keys and ``k_pe``
        ``(B, 1, L, d_r)`` (after RoPE) as its values, ``R + d_r`` numbers per token and layer
        (a full KV cache of the same heads holds ``H (d_n + d_r + d_v)``).
    form : {"auto", "expanded", "absorbed"}
        ``"expanded"``: HF's order (each key's heads expanded through ``kv_b_proj``).
        ``"absorbed"``: ``W_UK`` folded into the query, ``W_UV`` after the attention.
        ``"auto"``: the form of fewer multiplications, :func:`absorbs`.
    block_size, impl, backend
        As in :func:`~portable_llm.attention` (``impl="tiled"``: the tiled attention).

    Returns
    -------
    array, shape ``(B, L, E_out)``, x's dtype
        Each projection and norm rounds to x's dtype (HF's order); the absorbed form rounds
        the absorbed query and the latent output once each; the attention accumulates in
        float32 (float64 for float64).
    """
    be, w, x, opts = latent_args(
        x, wq=wq, wq_a=wq_a, q_a_norm=q_a_norm, wq_b=wq_b, bq_a=bq_a, wkv_a=wkv_a, bkv_a=bkv_a,
        kv_a_norm=kv_a_norm, wkv_b=wkv_b, wo=wo, bo=bo, num_heads=num_heads,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, norm_eps=norm_eps, rope=rope,
        scale=scale, mask=mask, offset=offset, cache=cache, form=form, block_size=block_size,
        impl=impl, backend=backend,
    )  # fmt: skip
    B, L = x.shape[0], x.shape[1]
    if B == 0 or L == 0:  # nothing to project or attend (a cache is left untouched)
        return be.xp.zeros((B, L, w.wo.shape[0]), dtype=x.dtype, device=be.device_of(x))
    state = LatentCallState(be, impl, rope, opts["offset"], None, cache, None, opts["mask"],
                            None, opts["scale"], opts["block_size"])  # fmt: skip
    kernels = Kernels(be, "portable" if impl == "tiled" else impl)
    return latent_attention_body(be.xp, kernels, x, w, state, 0)  # (B, L, E_out)


class LatentState(Protocol):
    """What :func:`latent_attention_body` asks of the call or forward it runs in."""

    #: The state attends over pages of ``[c_kv, k_pe]`` as both keys and values (a paged
    #: forward): the absorbed form only, whose keys and values those are.
    absorbed_only: bool

    def rotate(self, kn: Any, q: Array, k: Array) -> tuple[Array, Array]:
        """RoPE of ``q_pe`` ``(B, H, L, d_r)`` and ``k_pe`` ``(B, 1, L, d_r)``."""
        ...

    def latents(self, kn: Any, i: int, c_kv: Array, k_pe: Array) -> tuple[Array, Array, Any]:
        """Store layer ``i``'s new ``c_kv`` ``(B, 1, L, R)`` and ``k_pe`` ``(B, 1, L, d_r)``
        (in its cache, if any); return every latent to attend, ``(B, 1, S, R)`` and
        ``(B, 1, S, d_r)``, and the mask for them."""
        ...

    def attend_latent(self, kn: Any, i: int, q: Array, k: Array, v: Array, mask: Any) -> Array:
        """Layer ``i``'s attention of ``q`` ``(B, H, L, D)`` over ``k`` ``(B, H_kv, S, D)``
        and ``v`` ``(B, H_kv, S, D_v)`` with ``mask`` (from :meth:`latents`): ``(B, H, L,
        D_v)``."""
        ...


def latent_attention_body(
    xp: Namespace, kn: Any, x: Array, w: LatentWeights, state: LatentState, i: int
) -> Array:
    """Latent attention of checked arguments: the body of :func:`latent_attention` (and of a
    model's layers). ``kn``: the kernel set; ``i``: the layer (its cache). ``(B, L, E_out)``."""
    B, L = x.shape[0], x.shape[1]
    H, dn, dr, R = w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.kv_lora_rank
    if w.wq is not None:
        q = kn.project(xp, x, w.wq, None)  # (B, L, H * (d_n + d_r))
    else:
        q = kn.project(xp, x, w.wq_a, w.bq_a)  # (B, L, R_q)
        q = kn.project(xp, kn.rms_norm(xp, q, w.q_a_norm, eps=w.norm_eps), w.wq_b, None)
    q = xp.permute_dims(xp.reshape(q, (B, L, H, dn + dr)), (0, 2, 1, 3))  # (B, H, L, d_n + d_r)
    ckv = kn.project(xp, x, w.wkv_a, w.bkv_a)  # (B, L, R + d_r)
    c = kn.rms_norm(xp, ckv[..., :R], w.kv_a_norm, eps=w.norm_eps)
    c = xp.reshape(c, (B, 1, L, R))  # (B, 1, L, R): one latent "head"
    k_pe = xp.reshape(ckv[..., R:], (B, 1, L, dr))  # (B, 1, L, d_r)
    q_pe, k_pe = state.rotate(kn, q[..., dn:], k_pe)
    c, k_pe, mask = state.latents(kn, i, c, k_pe)  # (B, 1, S, R), (B, 1, S, d_r)
    absorbed = w.form == "absorbed" or (w.form == "auto" and absorbs(L, w))
    if absorbed or state.absorbed_only:
        o = _absorbed(xp, state, kn, i, q[..., :dn], q_pe, c, k_pe, mask, w)
    else:
        o = _expanded(xp, state, kn, i, q[..., :dn], q_pe, c, k_pe, mask, w)
    o = xp.reshape(xp.permute_dims(o, (0, 2, 1, 3)), (B, L, H * w.v_head_dim))  # (B, L, H*d_v)
    o = kn.project(xp, o, w.wo, None)  # (B, L, E_out)
    return o if w.bo is None else o + w.bo


def _expanded(
    xp: Namespace, state: LatentState, kn: Any, i: int, q_nope: Array, q_pe: Array, c: Array,
    k_pe: Array, mask: Any, w: LatentWeights,
) -> Array:  # fmt: skip
    """HF's order: every key's heads through ``kv_b_proj``, then plain attention (``D = d_n +
    d_r``, ``D_v = d_v``). ``(B, H, L, d_v)``."""
    B, S, H, dn = c.shape[0], c.shape[2], w.num_heads, w.qk_nope_head_dim
    kv = kn.project(xp, c, w.wkv_b, None)  # (B, 1, S, H * (d_n + d_v))
    kv = xp.permute_dims(xp.reshape(kv, (B, S, H, dn + w.v_head_dim)), (0, 2, 1, 3))
    pe = xp.broadcast_to(k_pe, (B, H, S, w.qk_rope_head_dim))  # the shared rotary key
    k = xp.concat([kv[..., :dn], pe], axis=-1)  # (B, H, S, d_n + d_r)
    q = xp.concat([q_nope, q_pe], axis=-1)  # (B, H, L, d_n + d_r)
    return state.attend_latent(kn, i, q, k, kv[..., dn:], mask)  # (B, H, L, d_v)


def _absorbed(
    xp: Namespace, state: LatentState, kn: Any, i: int, q_nope: Array, q_pe: Array, c: Array,
    k_pe: Array, mask: Any, w: LatentWeights,
) -> Array:  # fmt: skip
    """``W_UK`` in the query, ``W_UV`` after the attention: one key/value head of ``R + d_r``
    and ``R`` features (``D = R + d_r``, ``D_v = R``). ``(B, H, L, d_v)``."""
    q_lat = affine(xp, q_nope, w.w_uk)  # (B, H, L, d_n) @ (H, R, d_n)^T: (B, H, L, R)
    q = xp.concat([q_lat, q_pe], axis=-1)  # (B, H, L, R + d_r)
    k = xp.concat([c, k_pe], axis=-1)  # (B, 1, S, R + d_r)
    o = state.attend_latent(kn, i, q, k, c, mask)  # (B, H, L, R)
    return affine(xp, o, w.w_uv)  # (B, H, L, R) @ (H, d_v, R)^T: (B, H, L, d_v)


class LatentCallState(CallState):
    """One call of :func:`latent_attention`: the block's RoPE positions (:class:`CallState`),
    the compressed cache, the attention's options."""

    absorbed_only = False

    def latents(self, kn: Any, i: int, c_kv: Array, k_pe: Array) -> tuple[Array, Array, Any]:
        if self.cache is None:
            return c_kv, k_pe, self.mask
        dev = self.be.device_of(c_kv)
        c_kv, k_pe, mask, _ = block_kv_mask(
            OP, self.be.xp, self.cache, None, c_kv, k_pe, self.mask, None, dev
        )
        return c_kv, k_pe, mask

    def attend_latent(self, kn: Any, i: int, q: Array, k: Array, v: Array, mask: Any) -> Array:
        be = self.be
        args, opts = sdpa_args(
            OP, be, q, k, v, mask, scale=self.scale, window=None, softcap=None,
            block_size=self.block_size,
        )  # fmt: skip
        return pick(be, SDPA, self.impl, *args, **opts)(be.xp, *args, **opts)
