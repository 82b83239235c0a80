"""PyTorch kernels: ``torch.nn.functional``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from portable_llm.core.dispatch import native

_HALF = (torch.float16, torch.bfloat16)


# For float16/bfloat16, F.rms_norm multiplies by the weight in float32 and rounds once, where
# HF rounds the normalised value first: one ulp apart in ~27% of elements. auto keeps HF's exact
# bits there (portable path); float32/float64 have no intermediate rounding to disagree on.
@native(
    "torch", "rms_norm", kernel="torch.nn.functional.rms_norm", auto_dtypes=("float32", "float64")
)
def rms_norm(xp: Any, x: Any, weight: Any, *, eps: float) -> Any:
    # torch.rms_norm is the op F.rms_norm wraps (same kernel, one Python frame less).
    return torch.rms_norm(x, weight.shape, weight, eps)  # weight is (D,): its shape is (D,)


@native("torch", "softmax", kernel="torch.softmax")
def softmax(xp: Any, x: Any, *, axis: int) -> Any:
    if x.dtype in _HALF:
        return torch.softmax(x, axis, dtype=torch.float32).to(x.dtype)
    return torch.softmax(x, axis)


@native("torch", "silu", kernel="torch.nn.functional.silu")
def silu(xp: Any, x: Any) -> Any:
    return F.silu(x)


@native("torch", "gelu", kernel="torch.nn.functional.gelu")
def gelu(xp: Any, x: Any) -> Any:
    return F.gelu(x)


@native("torch", "gelu_tanh", kernel="torch.nn.functional.gelu(approximate='tanh')")
def gelu_tanh(xp: Any, x: Any) -> Any:
    return F.gelu(x, approximate="tanh")


@native("torch", "relu", kernel="torch.relu")
def relu(xp: Any, x: Any) -> Any:
    return torch.relu(x)


@native("torch", "linear", kernel="torch.nn.functional.linear")
def linear(xp: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    return F.linear(x, weight, bias)


# -- attention ---------------------------------------------------------------------------------


def _probe_enable_gqa() -> bool:
    t = torch.zeros(1, 1, 1)
    try:
        F.scaled_dot_product_attention(t, t, t, enable_gqa=False)
    except TypeError:  # torch < 2.5
        return False
    return True


_HAS_GQA = _probe_enable_gqa()


def _sdpa_applies(q: Any, k: Any, v: Any, mask: Any, *, softcap: Any, **_: Any) -> bool:
    if softcap is not None:  # no score hook in the fused kernel
        return False
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        return False  # torch would round an additive mask to q's dtype
    return _HAS_GQA or q.shape[-3] == k.shape[-3]


@native(
    "torch",
    "scaled_dot_product_attention",
    kernel="torch.nn.functional.scaled_dot_product_attention",
    applies=_sdpa_applies,
)
def scaled_dot_product_attention(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    *,
    scale: float,
    causal: bool,
    window: int | None,
    softcap: float | None,
    block_size: int,
) -> Any:
    L, S = q.shape[-2], k.shape[-2]
    # enable_gqa only when needed: torch < 2.5 has no such argument (MHA still runs there).
    gqa: dict[str, Any] = {"enable_gqa": True} if q.shape[-3] != k.shape[-3] else {}
    if causal and window is None and mask is None:
        if L == S:  # torch's is_causal is top-left aligned: bottom-right only when L == S
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
        if L == 1:  # a decode step: bottom-right causal lets its one query see every key
            return F.scaled_dot_product_attention(q, k, v, scale=scale, **gqa)
    attn = mask
    if causal:
        i = torch.arange(L, device=q.device)[:, None] + (S - L)
        j = torch.arange(S, device=q.device)[None, :]
        keep = j <= i if window is None else (j <= i) & (j > i - window)  # (L, S)
        if attn is None:
            attn = keep
        elif attn.dtype == torch.bool:
            attn = attn & keep
        else:
            attn = torch.where(keep, attn, -math.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale, **gqa)
    if mask is not None:  # rows that see no key are zeros, as in the portable path
        sees = attn.any(-1) if attn.dtype == torch.bool else (attn > -math.inf).any(-1)
        out = torch.where(sees[..., None], out, 0.0)
    return out
