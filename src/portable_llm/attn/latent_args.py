"""The checks of :func:`~portable_llm.attn.latent.latent_attention`, its weights record, the
form rule (:func:`absorbs`) and DeepSeek's softmax scale (:func:`latent_softmax_scale`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from portable_llm.attn.block import check_rope_options
from portable_llm.attn.kv_glue import block_offset
from portable_llm.attn.sdpa_args import int_option, real_option
from portable_llm.backends import Backend, resolve
from portable_llm.core.checks import check_float, check_int, match_weight
from portable_llm.core.dispatch import IMPLS
from portable_llm.ops.quant import QuantizedWeight, dequantize

__all__ = [
    "FORMS",
    "OP",
    "LatentWeights",
    "absorbed_weights",
    "absorbs",
    "latent_args",
    "latent_softmax_scale",
]

OP = "latent_attention"

#: The ``form=`` values: the rule of :func:`absorbs`, HF's expanded heads, the absorbed query.
FORMS: tuple[str, ...] = ("auto", "expanded", "absorbed")

_DIMS = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class LatentWeights:
    """One latent attention layer's weights (float arrays in x's dtype, or quantized
    projections) and shape; HF's names in the comments."""

    wq: Any  # (H * (d_n + d_r), E) q_proj, or None (a query LoRA)
    wq_a: Any  # (R_q, E) q_a_proj, or None
    bq_a: Any  # (R_q,) or None
    q_a_norm: Any  # (R_q,) q_a_layernorm, or None
    wq_b: Any  # (H * (d_n + d_r), R_q) q_b_proj, or None
    wkv_a: Any  # (R + d_r, E) kv_a_proj_with_mqa
    bkv_a: Any  # (R + d_r,) or None
    kv_a_norm: Any  # (R,) kv_a_layernorm
    wkv_b: Any  # (H * (d_n + d_v), R) kv_b_proj (the expanded form)
    w_uk: Any  # (H, R, d_n): W_UK^T per head, kv_b_proj's k_nope rows (the absorbed form)
    w_uv: Any  # (H, d_v, R): W_UV per head, kv_b_proj's v rows
    wo: Any  # (E_out, H * d_v) o_proj
    bo: Any  # (E_out,) or None
    num_heads: int  # H
    kv_lora_rank: int  # R
    qk_nope_head_dim: int  # d_n
    qk_rope_head_dim: int  # d_r
    v_head_dim: int  # d_v
    norm_eps: float  # of q_a_layernorm and kv_a_layernorm
    form: str = "auto"  # FORMS


def absorbs(L: int, w: LatentWeights) -> bool:
    """Whether ``form="auto"`` takes the absorbed form for ``L`` queries: when it multiplies
    less. Per head and key, the expanded form spends ``R (d_n + d_v)`` on expanding the key
    and ``L (d_n + d_r + d_v)`` on the scores and values; the absorbed form ``L (2 R + d_r)``
    (the query's and output's ``W_UK``, ``W_UV`` do not grow with the keys). So absorbed when
    ``L (2 R - d_n - d_v) < R (d_n + d_v)``: a decode step and short chunks (DeepSeek V3's
    ``R = 512``, ``d_n = d_v = 128``: ``L <= 170``), not a long prefill."""
    R, dn, dv = w.kv_lora_rank, w.qk_nope_head_dim, w.v_head_dim
    return L * (2 * R - dn - dv) < R * (dn + dv)


def latent_softmax_scale(qk_head_dim: int, scaling: Mapping[str, Any] | None = None) -> float:
    """DeepSeek's softmax scale (HF ``DeepseekV3Attention.scaling``): ``qk_head_dim ** -0.5``,
    times ``mscale ** 2`` when ``scaling`` (HF ``rope_scaling``) is not the default RoPE and
    has a nonzero ``mscale_all_dim``: ``mscale = 0.1 mscale_all_dim ln(factor) + 1`` (1 for
    ``factor <= 1``)."""
    scale = qk_head_dim**-0.5
    s = dict(scaling or {})
    if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
        factor = float(s["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


_ARRAYS = ("wq", "wq_a", "q_a_norm", "wq_b", "bq_a", "wkv_a", "bkv_a", "kv_a_norm", "wkv_b", "wo",
           "bo")  # fmt: skip


def _resolve(
    backend: Any, x: Any, arrays: dict[str, Any], mask: Any
) -> tuple[Backend, Any, dict[str, Any], Any]:
    """The backend, ``x``, the arrays on it (quantized projections as they are) and the mask."""
    plain = {n: a for n, a in arrays.items() if not isinstance(a, QuantizedWeight)}
    extra = () if isinstance(mask, str) or mask is None else (mask,)
    be, got = resolve(OP, backend, x, *plain.values(), *extra)
    arrays.update(zip(plain, got[1 : 1 + len(plain)], strict=True))
    return be, got[0], arrays, got[-1] if extra else mask


def _query(be: Backend, x: Any, a: dict[str, Any], H: int, dq: int) -> None:
    """The query's projections: ``wq`` alone, or the LoRA ``wq_a``, ``q_a_norm``, ``wq_b``."""
    lora = {n: a[n] for n in ("wq_a", "q_a_norm", "wq_b")}
    E = x.shape[-1]
    if a["wq"] is not None:
        given = [n for n, v in lora.items() if v is not None] + (["bq_a"] if a["bq_a"] else [])
        if given:
            raise ValueError(f"{OP}: give wq (q_proj) or the query LoRA, not both; got wq and "
                             f"{', '.join(given)}")  # fmt: skip
        _shape(be, a, "wq", (H * dq, E), f"H * (d_n + d_r) = {H} x {dq}, E")
        return
    missing = [n for n, v in lora.items() if v is None]
    if missing:
        raise ValueError(f"{OP}: without wq (q_proj), the query LoRA needs wq_a, q_a_norm and "
                         f"wq_b; missing {', '.join(missing)}")  # fmt: skip
    rq = a["wq_a"].shape[0]
    _shape(be, a, "wq_a", (rq, E), "q_lora_rank, E", bias="bq_a")
    _vector(be, a, "q_a_norm", rq, "q_lora_rank, the rows of wq_a")
    _shape(be, a, "wq_b", (H * dq, rq), f"H * (d_n + d_r) = {H} x {dq}, q_lora_rank")


def _shape(
    be: Backend, a: dict[str, Any], name: str, want: tuple[int, int], what: str,
    bias: str | None = None,
) -> None:  # fmt: skip
    w = a[name]
    if not isinstance(w, QuantizedWeight):
        check_float(OP, name, w, be)
    if tuple(w.shape) != want:
        raise ValueError(f"{OP}: {name} must have shape {want} ({what}), got {tuple(w.shape)}")
    if bias is not None:
        _vector(be, a, bias, want[0], f"the rows of {name}")


def _vector(be: Backend, a: dict[str, Any], name: str, n: int, what: str) -> None:
    """A norm weight or a bias: float, ``(n,)``; absent biases pass."""
    if a[name] is None:
        return
    check_float(OP, name, a[name], be)
    if tuple(a[name].shape) != (n,):
        raise ValueError(f"{OP}: {name} must have shape ({n},) ({what}), got "
                         f"{tuple(a[name].shape)}")  # fmt: skip


def absorbed_weights(be: Backend, wkv_b: Any, H: int, dn: int, dv: int) -> tuple[Any, Any]:
    """``(W_UK^T (H, R, d_n), W_UV (H, d_v, R))`` from ``kv_b_proj`` ``(H (d_n + d_v), R)``
    (a quantized one dequantized): the absorbed form's weights, formed once (the op's checks,
    a model's load)."""
    xp = be.xp
    w = dequantize(wkv_b) if isinstance(wkv_b, QuantizedWeight) else wkv_b
    w = xp.reshape(w, (H, dn + dv, w.shape[-1]))  # (H, d_n + d_v, R)
    return xp.matrix_transpose(w[:, :dn, :]), w[:, dn:, :]


def latent_args(x: Any, **kw: Any) -> tuple[Backend, LatentWeights, Any, dict[str, Any]]:
    """Check the arguments of :func:`~portable_llm.attn.latent.latent_attention` (its keyword
    names); return the backend, the weights, ``x`` and the call's options (``offset``,
    ``mask``, ``scale``, ``block_size``)."""
    cache, impl, form = kw["cache"], kw["impl"], kw["form"]
    if impl not in (*IMPLS, "tiled"):
        raise ValueError(f"{OP}: impl must be one of {(*IMPLS, 'tiled')}, got {impl!r}")
    if form not in FORMS:
        raise ValueError(f"{OP}: form must be one of {FORMS}, got {form!r}")
    H, R, dn, dr, dv = (int_option(OP, n, kw[n], low=1) for n in _DIMS)
    rope = kw["rope"]
    check_rope_options(OP, rope)
    if rope is not None and dr % 2:
        raise ValueError(f"{OP}: qk_rope_head_dim must be even (RoPE turns pairs), got {dr}")
    offset = check_int(OP, "offset", kw["offset"], low=0)
    if cache is not None:
        offset = block_offset(OP, cache, offset, None)
    be, x, a, mask = _resolve(kw["backend"], x, {n: kw[n] for n in _ARRAYS}, kw["mask"])
    check_float(OP, "x", x, be)
    if x.ndim != 3:
        raise ValueError(f"{OP}: x must have shape (B, L, E), got {tuple(x.shape)}")
    E = x.shape[-1]
    _query(be, x, a, H, dn + dr)
    _shape(be, a, "wkv_a", (R + dr, E), f"kv_lora_rank + d_r = {R} + {dr}, E", bias="bkv_a")
    _vector(be, a, "kv_a_norm", R, "kv_lora_rank")
    _shape(be, a, "wkv_b", (H * (dn + dv), R), f"H * (d_n + d_v) = {H} x {dn + dv}, R")
    wo = a["wo"]
    if not isinstance(wo, QuantizedWeight):
        check_float(OP, "wo", wo, be)
    if len(wo.shape) != 2 or wo.shape[1] != H * dv:
        raise ValueError(f"{OP}: wo must have shape (E_out, {H * dv}) (H * d_v = {H} x {dv}), "
                         f"got {tuple(wo.shape)}")  # fmt: skip
    _vector(be, a, "bo", wo.shape[0], "E_out, the rows of wo")
    norm_eps = real_option(OP, "norm_eps", kw["norm_eps"], "a finite number >= 0", low=None)
    if norm_eps < 0:
        raise ValueError(f"{OP}: norm_eps must be >= 0, got {norm_eps!r}")
    a = {n: v if v is None or isinstance(v, QuantizedWeight) else match_weight(OP, n, v, x, be)
         for n, v in a.items()}  # fmt: skip
    w_uk, w_uv = absorbed_weights(be, a["wkv_b"], H, dn, dv)
    if isinstance(a["wkv_b"], QuantizedWeight):
        w_uk, w_uv = (be.xp.astype(t, x.dtype) for t in (w_uk, w_uv))
    w = LatentWeights(**a, w_uk=w_uk, w_uv=w_uv, num_heads=H, kv_lora_rank=R,
                      qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv,
                      norm_eps=norm_eps, form=form)  # fmt: skip
    scale = kw["scale"]
    if scale is None:
        scale = latent_softmax_scale(dn + dr, None if rope is None else rope.get("scaling"))
    opts = {"offset": offset, "mask": mask, "scale": scale,
            "block_size": int_option(OP, "block_size", kw["block_size"], low=1)}  # fmt: skip
    return be, w, x, opts
