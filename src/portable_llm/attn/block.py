"""The attention block of Llama/Qwen/Mistral: projections, q/k RMSNorm, RoPE, attention, output.

A front and a body: :func:`attention` checks its arguments and resolves the backend once, then
calls :func:`attention_body`, which a model's prepared, compiled and paged forwards call too.
The body runs the kernels of ``linear`` (or ``quantized_linear``), ``rms_norm``, ``rope`` and
``scaled_dot_product_attention`` through a kernel set (:mod:`portable_llm.ops.kernels`: chosen
per call here, once per model there) and asks an :class:`AttentionState` for RoPE's positions
and the keys to attend (a KV cache, a paged cache, the padding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from portable_llm.attn.kv_glue import block_kv_mask, block_offset
from portable_llm.attn.padding import nonnegative, row_offsets
from portable_llm.attn.sdpa import OP as SDPA
from portable_llm.attn.sdpa import empty, sdpa_args
from portable_llm.attn.sdpa_args import check_sinks, int_option
from portable_llm.attn.temperature import temperature_body
from portable_llm.backends import resolve
from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import (
    check_float,
    check_int,
    check_real,
    check_same_dtype,
    match_weight,
)
from portable_llm.core.dispatch import IMPLS, pick
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.activations import sigmoid
from portable_llm.ops.kernels import Kernels, KernelSet, offset_rms_norm
from portable_llm.ops.linear import check_linear
from portable_llm.ops.quant import QuantizedWeight
from portable_llm.rotary.args import dispatch_args as rope_dispatch_args

__all__ = [
    "ROPE_OPTIONS",
    "AttentionState",
    "AttnWeights",
    "CallState",
    "attention",
    "attention_body",
    "check_rope_options",
]

OP = "attention"

#: The keys a ``rope=`` dict may hold: the options of :func:`portable_llm.rotary.rope`.
ROPE_OPTIONS: tuple[str, ...] = (
    "base",
    "traditional",
    "scaling",
    "dims",
    "max_position_embeddings",
)
_DEFAULT_ROPE: Mapping[str, Any] = MappingProxyType({})


def _positive(name: str, value: Any) -> int:
    """A count ``>= 1``: Python or NumPy integers (core.checks' policy), else a ValueError."""
    return int(int_option(OP, name, value, low=1))


def check_rope_options(op: str, rope: Mapping[str, Any] | None) -> None:
    """A ValueError naming the keys of a block's ``rope=`` dict that are not
    :data:`ROPE_OPTIONS`."""
    unknown = sorted(set(rope or ()) - set(ROPE_OPTIONS))
    if unknown:
        raise ValueError(
            f"{op}: unknown rope option(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(ROPE_OPTIONS)}"
        )


def _check_padding(be: Any, pad: Any, L: int) -> None:
    """``left_padding`` values in ``[0, L]``: one host read (skipped for traced values)."""
    if be.is_traced(pad):
        return
    for b, n in enumerate(to_numpy(pad).tolist()):
        check_int(OP, f"left_padding[{b}] (pad tokens of row {b} of L={L})", n, low=0, high=L)


# Over 80 lines for its signature and docstring (HF's every attention option, ~110 lines); the
# code is the named checks below, then attention_body.
def attention(
    x: Any,
    /,
    *,
    wq: Any,
    wk: Any,
    wv: Any,
    wo: Any,
    wg: Any = None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None = None,
    bq: Any = None,
    bk: Any = None,
    bv: Any = None,
    bg: Any = None,
    q_norm: Any = None,
    k_norm: Any = None,
    norm_eps: float = 1e-6,
    rope: Mapping[str, Any] | None = _DEFAULT_ROPE,
    mask: Any = "causal",
    window: int | None = None,
    chunk: int | None = None,
    qk_l2_norm: bool = False,
    temperature: tuple[float, float] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Any = None,
    offset: Any = 0,
    cache: Any = None,
    left_padding: Any = None,
    block_size: int = 256,
    impl: str = "auto",
    backend: str | None = None,
) -> Any:
    """Multi-head (grouped-query) self-attention with HF's weight layout and order of operations.

    ``q = x wq^T + bq``, ``k = x wk^T + bk``, ``v = x wv^T + bv`` split into heads; optional
    RMSNorm of each q and k head (Qwen3's ``q_norm``/``k_norm``); RoPE on q and k at positions
    ``offset .. offset + L - 1``; :func:`scaled_dot_product_attention`; heads merged and
    projected by ``wo`` (no bias, as in Llama/Qwen).

    Parameters
    ----------
    x : array, shape ``(B, L, E)``, float dtype
        ``B = 0`` or ``L = 0`` gives an empty ``(B, L, E_out)`` result.
    wq : array, shape ``(H * D, E)`` (HF ``q_proj.weight``)
        Weights, biases and norms may have another float dtype than ``x``: they are cast to
        ``x``'s (the one mixed-precision rule, ``docs/mixed-precision.md``). Integer weights
        are a TypeError.
    wk, wv : array, shape ``(H_kv * D, E)``
    wo : array, shape ``(E_out, H * D)`` (HF ``o_proj.weight``; usually ``E_out = E``)
    wg : array, shape ``(H * D, E)``, optional
        Qwen3-Next's output gate: the heads' merged output is multiplied by
        ``sigmoid(x wg^T)`` before ``wo`` (HF ``Qwen3NextAttention``: the second ``D`` of
        each head's ``2 D`` rows of ``q_proj``).
    num_heads, num_kv_heads : int
        ``H`` and ``H_kv`` (HF ``num_attention_heads``, ``num_key_value_heads``; Python or
        NumPy integers);
        ``H % H_kv == 0``.
    head_dim : int, optional
        ``D``; default ``E // H`` (E must then be a multiple of H).
    bq : array, shape ``(H * D,)``, optional
    bk, bv : array, shape ``(H_kv * D,)``, optional (Qwen2 has all three biases)
    bg : array, shape ``(H * D,)``, optional
        The output gate's bias (Qwen3-Next with ``attention_bias``); only with ``wg``.
    q_norm, k_norm : array, shape ``(D,)``, optional
        RMSNorm weights applied to each head of q and k before RoPE (Qwen3), with ``norm_eps``;
        or of shapes ``(H * D,)`` and ``(H_kv * D,)``: one RMSNorm over all heads' features of
        the projection, before it is split into heads (OLMo 2). Both of one kind.
    norm_eps : float
        HF ``rms_norm_eps`` for ``q_norm``/``k_norm``.
    rope : dict or None
        Options of :func:`portable_llm.rotary.rope` (keys :data:`ROPE_OPTIONS`: ``base``,
        ``traditional``, ``scaling``, ``dims``, ``max_position_embeddings``), e.g.
        ``{"base": config.rope_theta, "scaling": config.rope_scaling}``. The default ``{}`` is
        RoPE with :func:`~portable_llm.rotary.rope`'s defaults (base 10000, HF's rotate-half pairs).
        ``None``: no rotary embedding.
    mask, window, softcap, scale, block_size
        As in :func:`scaled_dot_product_attention`; the default ``mask="causal"`` is a decoder's.
        An array mask broadcasts to ``(B, H, L, L)``.
    chunk : int >= 1, optional
        Llama 4's chunked attention (``attention_chunk_size``): each query sees the keys of its
        own chunk of ``chunk`` positions (:func:`~portable_llm.attn.visibility.visible`), in
        the cache's mask or the padding's; needs ``mask="causal"`` or an array.
    qk_l2_norm : bool
        Llama 4's ``use_qk_norm`` (``Llama4TextL2Norm``): a weightless RMS norm (``norm_eps``)
        of each q and k head, *after* RoPE.
    temperature : (floor_scale, scale), optional
        Llama 4's attention temperature tuning of a layer without RoPE
        (:func:`~portable_llm.attention_temperature`), at the queries' positions.
    sinks : array, shape ``(H,)``, optional
        gpt-oss's attention sinks (HF ``self_attn.sinks``): one logit per query head in every
        softmax row's denominator, with no value (see :func:`scaled_dot_product_attention`).
    offset : int >= 0 or integer array of shape ``(B,)``
        Position of the first token (per sequence for an array); only RoPE reads it. With a
        cache, positions start at ``cache.offset`` (leave ``offset`` at 0).
    cache : KVCache or RotatingKVCache, optional
        The layer's cache (:mod:`portable_llm.caches.kv`): k and v (after RoPE) are stored in
        it, and
        the queries attend to every key it returns, with the mask it builds
        (:meth:`~portable_llm.KVCache.make_mask`: bottom-right causal, the sliding window of a
        rotating cache or of ``window``, its left padding). An array ``mask`` then covers the
        ``S`` keys the cache returns and is and-ed with the cache's.
    left_padding : integer array of shape ``(B,)``, values in ``[0, L]``, optional
        Without a cache: pad tokens at the start of each row (:func:`~portable_llm.left_pad`);
        their keys are masked out and row ``b``'s positions start at ``offset - left_padding[b]``.
        With a cache, give it to the cache.
    impl : {"auto", "portable", "native", "tiled"}
        Passed to every sub-op; ``"tiled"`` picks the tiled attention and the portable path
        for the projections, norms and RoPE.
    backend : str, optional

    Returns
    -------
    array, shape ``(B, L, E_out)``, x's dtype
        Projections, norms and RoPE round to x's dtype after each step (HF's order); attention
        accumulates in float32 (float64 for float64) and rounds once.
    """
    if cache is not None:
        offset = block_offset(OP, cache, offset, left_padding)
        left_padding = cache.left_padding
    h, h_kv = _check_options(impl, num_heads, num_kv_heads, rope)
    gated = wg is not None
    if bg is not None and not gated:
        raise ValueError(f"{OP}: bg is the output gate's bias: give it with wg")
    be, (x, wq, wk, wv, wo, *wg_, bq, bk, bv, bg, q_norm, k_norm, pad, sinks, mask) = _resolve(
        backend, x, (wq, wk, wv, wo, *(wg,) * gated),
        (bq, bk, bv, bg, q_norm, k_norm, left_padding, sinks), mask,
    )  # fmt: skip
    D = _check_shapes(be, x, h, h_kv, head_dim, (wq, wk, wv, wo, bq, bk, bv))
    wg = _check_gate(be, x, wg_[0], bg, h * D) if gated else None
    whole = _qk_norm_whole(be, D, ((q_norm, h), (k_norm, h_kv)))
    sinks = None if sinks is None else check_sinks(OP, be, sinks, x, h, f"head, num_heads={h}")
    if not norm_eps >= 0:  # also rejects NaN
        raise ValueError(f"{OP}: norm_eps must be >= 0, got {norm_eps!r}")
    chunk = int_option(OP, "chunk", chunk, low=1, optional=True)
    temperature = _check_temperature(temperature)
    wq, wk, wv, wo, wg, bq, bk, bv, bg, q_norm, k_norm = _match_dtypes(
        be, x, wq=wq, wk=wk, wv=wv, wo=wo, wg=wg, bq=bq, bk=bk, bv=bv, bg=bg, q_norm=q_norm,
        k_norm=k_norm,
    )  # fmt: skip
    b, L = x.shape[0], x.shape[1]
    rows = None if pad is None else row_offsets(OP, be, offset, pad, b)  # (B,)
    if pad is not None and cache is None:  # a cache checked its own
        _check_padding(be, pad, L)
    if empty(x):  # B = 0 or L = 0: nothing to project or attend (a cache is left untouched)
        return be.xp.zeros((b, L, wo.shape[0]), dtype=x.dtype, device=be.device_of(x))
    weights = AttnWeights(
        wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=None, q_norm=q_norm, k_norm=k_norm,
        window=window, num_heads=h, num_kv_heads=h_kv, head_dim=D, norm_eps=norm_eps,
        rope=rope is not None, qk_l2_norm=bool(qk_l2_norm), temperature=temperature, chunk=chunk,
        sinks=sinks, qk_norm_whole=whole, wg=wg, bg=bg,
    )  # fmt: skip
    state = CallState(be, impl, rope, offset, rows, cache, pad, mask, softcap, scale, block_size)
    kernels = Kernels(be, "portable" if impl == "tiled" else impl)
    return attention_body(be.xp, kernels, x, weights, state, 0)  # (B, L, E_out)


def _check_options(impl: str, num_heads: Any, num_kv_heads: Any, rope: Any) -> tuple[int, int]:
    """``impl``, the head counts ``(H, H_kv)`` and the keys of ``rope``."""
    if impl not in (*IMPLS, "tiled"):
        raise ValueError(f"{OP}: impl must be one of {(*IMPLS, 'tiled')}, got {impl!r}")
    h, h_kv = _positive("num_heads", num_heads), _positive("num_kv_heads", num_kv_heads)
    if h % h_kv:
        raise ValueError(
            f"{OP}: num_heads={h} must be a multiple of num_kv_heads={h_kv} (grouped-query)"
        )
    if rope is not None:
        unknown = sorted(set(rope) - set(ROPE_OPTIONS))
        if unknown:
            raise ValueError(
                f"{OP}: unknown rope option(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(ROPE_OPTIONS)}"
            )
    return h, h_kv


def _resolve(
    backend: Any, x: Any, projections: tuple[Any, ...], others: tuple[Any, ...], mask: Any
) -> tuple[Any, tuple[Any, ...]]:
    """The backend and ``(x, *projections, *others, mask)`` as its arrays; quantized
    projections (ops/quant/) skip the conversion and stay as they are."""
    extra = () if isinstance(mask, str) or mask is None else (mask,)
    quantized = [isinstance(w, QuantizedWeight) for w in projections]
    floats = [None if q else w for w, q in zip(projections, quantized, strict=True)]
    be, arrays = resolve(OP, backend, x, *floats, *others, *extra)
    n = len(projections)
    resolved = [
        w if q else a for w, a, q in zip(projections, arrays[1 : 1 + n], quantized, strict=True)
    ]
    rest = arrays[1 + n : 1 + n + len(others)]
    return be, (arrays[0], *resolved, *rest, arrays[-1] if extra else mask)


def _check_shapes(
    be: Any, x: Any, h: int, h_kv: int, head_dim: Any, weights: tuple[Any, ...]
) -> int:
    """x ``(B, L, E)`` and the projections' shapes and kinds for ``H``, ``H_kv`` heads
    (the q/k norms: :func:`_qk_norm_whole`); returns ``D`` (``head_dim``, default ``E // H``)."""
    wq, wk, wv, wo, bq, bk, bv = weights
    check_float(OP, "x", x, be)
    if x.ndim != 3:
        raise ValueError(f"{OP}: x must have shape (B, L, E), got {tuple(x.shape)}")
    E = x.shape[-1]
    if head_dim is None:
        if E % h:
            raise ValueError(
                f"{OP}: hidden size E={E} (x {tuple(x.shape)}) is not a multiple of "
                f"num_heads={h}; pass head_dim"
            )
        head_dim = E // h
    D = _positive("head_dim", head_dim)
    for name, w, b, n in (("wq", wq, bq, h), ("wk", wk, bk, h_kv), ("wv", wv, bv, h_kv)):
        check_linear(OP, be, x, w, b, name)
        if w.shape[0] != n * D:
            raise ValueError(
                f"{OP}: {name} must have shape ({n * D}, {E}) ({n} heads x head_dim {D}, E), "
                f"got {tuple(w.shape)}"
            )
    check_float(OP, "wo", wo, be)
    if wo.ndim != 2 or wo.shape[1] != h * D:
        raise ValueError(
            f"{OP}: wo must have shape (E_out, {h * D}) (H * D = {h} x {D}), got {tuple(wo.shape)}"
        )
    return D


def _check_gate(be: Any, x: Any, wg: Any, bg: Any, HD: int) -> Any:
    """The output gate ``wg`` ``(H * D, E)`` and its bias (Qwen3-Next), checked as a
    projection of x."""
    check_linear(OP, be, x, wg, bg, "wg")
    if wg.shape[0] != HD:
        raise ValueError(
            f"{OP}: wg must have shape ({HD}, {x.shape[-1]}) (H * D, E: one gate per output "
            f"feature of the heads), got {tuple(wg.shape)}"
        )
    return wg


def _qk_norm_whole(be: Any, D: int, norms: tuple[tuple[Any, int], ...]) -> bool:
    """Whether ``q_norm``/``k_norm`` (each with its head count) span all heads' features
    (OLMo 2: ``(H * D,)``, ``(H_kv * D,)``) rather than each head's (``(D,)``): both alike;
    with one head the two are the same norm."""
    whole = any(nw is not None and n > 1 and tuple(nw.shape) == (n * D,) for nw, n in norms)
    for (nw, n), name in zip(norms, ("q_norm", "k_norm"), strict=True):
        if nw is None:
            continue
        check_float(OP, name, nw, be)
        if tuple(nw.shape) != ((n * D,) if whole else (D,)):
            raise ValueError(
                f"{OP}: {name} must have shape ({D},) (each head's head_dim features) or "
                f"({n * D},) (all {n} heads' features, as OLMo 2), q_norm and k_norm alike; "
                f"got {tuple(nw.shape)}"
            )
    return whole


def _check_temperature(temperature: Any) -> tuple[float, float] | None:
    """Llama 4's ``(floor_scale, scale)`` pair, checked."""
    if temperature is None:
        return None
    if not isinstance(temperature, tuple | list) or len(temperature) != 2:
        raise ValueError(
            f"{OP}: temperature must be a (floor_scale, scale) pair or None, got {temperature!r}"
        )
    return (
        check_real(OP, "temperature[0] (floor_scale)", temperature[0], low=0.0, low_open=True),
        check_real(OP, "temperature[1] (scale)", temperature[1]),
    )


def _match_dtypes(be: Any, x: Any, **weights: Any) -> tuple[Any, ...]:
    """The weights in x's dtype (the one mixed-precision rule, docs/mixed-precision.md), in
    the order given; a QuantizedWeight keeps its own (quantized_linear computes in x's)."""
    out = {
        name: w if isinstance(w, QuantizedWeight) else match_weight(OP, name, w, x, be)
        for name, w in weights.items()
    }
    floats = {n: w for n, w in out.items() if not isinstance(w, QuantizedWeight)}
    check_same_dtype(OP, be, x=x, **floats)
    return tuple(out.values())


@dataclass(frozen=True)
class AttnWeights:
    """One attention layer's weights and shape: projections ``(out, E)`` (float arrays,
    :class:`~portable_llm.QuantizedWeight` or bound with their kernel:
    :class:`~portable_llm.ops.kernels.QLinear`, :class:`~portable_llm.ops.kernels.Packed`),
    optional biases and q/k norms."""

    wq: Any  # (H * D, E)
    wk: Any  # (H_kv * D, E)
    wv: Any  # (H_kv * D, E)
    wo: Any  # (E_out, H * D)
    bq: Any  # (H * D,) or None
    bk: Any  # (H_kv * D,) or None
    bv: Any  # (H_kv * D,) or None
    bo: Any  # (E_out,) or None: HF's o_proj bias, added after the projection
    q_norm: Any  # (D,) or None (Qwen3)
    k_norm: Any  # (D,) or None
    window: int | None  # the layer's sliding window
    num_heads: int  # H
    num_kv_heads: int  # H_kv
    head_dim: int  # D
    norm_eps: float  # of q_norm and k_norm (and of the weightless qk_l2_norm)
    rope: bool = True  # False: the layer does not rotate q and k (Llama 4's no-RoPE layers)
    qk_l2_norm: bool = False  # Llama 4: weightless RMS norm of q and k heads, after RoPE
    temperature: tuple[float, float] | None = None  # Llama 4: (floor_scale, attn_scale)
    chunk: int | None = None  # Llama 4: attention_chunk_size of a chunked_attention layer
    sinks: Any = None  # (H,) or None: gpt-oss's per-head sink logits (x's dtype)
    qk_norm_whole: bool = False  # OLMo 2: q_norm (H * D,), k_norm (H_kv * D,), before the split
    wg: Any = None  # (H * D, E) or None: Qwen3-Next's output gate, sigmoid(x wg^T) * heads
    bg: Any = None  # (H * D,) or None: the gate's bias
    norm_offset: float = 0.0  # Qwen3-Next: q/k norms scale by offset + w, in float32 per call


class AttentionState(Protocol):
    """What :func:`attention_body` asks of the call or forward it runs in: RoPE at the
    positions of the new tokens, and the attention over the keys they see (a KV cache's, a
    paged cache's, or the new ones alone)."""

    def rotate(self, kn: KernelSet, q: Array, k: Array) -> tuple[Array, Array]:
        """RoPE of ``q`` ``(B, H, L, D)`` and ``k`` ``(B, H_kv, L, D)`` (or both unchanged)."""
        ...

    def attend(
        self, kn: KernelSet, i: int, q: Array, k: Array, v: Array, window: int | None,
        chunk: int | None = None, *, sinks: Array | None = None,
    ) -> Array:  # fmt: skip
        """Layer ``i``'s attention of ``q`` over the new keys and values ``(B, H_kv, L, D)``
        (after RoPE) and what came before them: ``(B, H, L, D)``; ``chunk``: Llama 4's chunked
        attention (the one visibility rule's ``chunk``); ``sinks`` ``(H,)``: gpt-oss's attention
        sinks (:func:`~portable_llm.scaled_dot_product_attention`'s ``sinks``; the body passes
        it only to a layer that has them)."""
        ...

    def positions(self) -> Any:
        """The position of each row's first new token: an int (or traced 0-d array), or
        ``(B,)`` (rows of other offsets; a left-padded row's first real token at 0, its pad
        columns below 0)."""
        ...


def attention_body(
    xp: Namespace, kn: KernelSet, x: Array, w: AttnWeights, state: AttentionState, i: int
) -> Array:
    """The attention block of checked arguments: the body of :func:`attention` and of a model's
    layers (prepared, compiled and paged forwards).

    ``kn``: a :class:`~portable_llm.ops.kernels.KernelSet` (chosen per call, bound once, or
    the public ops); ``x`` ``(B, L, E)``;
    ``state``: where RoPE's positions and the keys come from; ``i``: the layer (its cache).
    Returns ``(B, L, E_out)`` in x's dtype.
    """
    B, L = x.shape[0], x.shape[1]
    H, H_kv, D = w.num_heads, w.num_kv_heads, w.head_dim
    q = kn.project(xp, x, w.wq, w.bq)  # (B, L, H * D)
    k = kn.project(xp, x, w.wk, w.bk)  # (B, L, H_kv * D)
    whole = w.qk_norm_whole  # OLMo 2: RMSNorm over all heads' features, before the split
    if whole and w.q_norm is not None:
        q = kn.rms_norm(xp, q, w.q_norm, eps=w.norm_eps)
    if whole and w.k_norm is not None:
        k = kn.rms_norm(xp, k, w.k_norm, eps=w.norm_eps)
    q = xp.permute_dims(xp.reshape(q, (B, L, H, D)), (0, 2, 1, 3))  # (B, H, L, D)
    k = xp.permute_dims(xp.reshape(k, (B, L, H_kv, D)), (0, 2, 1, 3))  # (B, H_kv, L, D)
    v = xp.reshape(kn.project(xp, x, w.wv, w.bv), (B, L, H_kv, D))  # (B, L, H_kv, D)
    v = xp.permute_dims(v, (0, 2, 1, 3))  # (B, H_kv, L, D)
    if w.norm_offset:  # Qwen3-Next: the scale norm_offset + w, in float32 (one rounding)
        q, k = _offset_head_norms(xp, kn, q, k, w)
    elif not whole:  # Qwen3: RMSNorm of each head, before RoPE
        if w.q_norm is not None:
            q = kn.rms_norm(xp, q, w.q_norm, eps=w.norm_eps)
        if w.k_norm is not None:
            k = kn.rms_norm(xp, k, w.k_norm, eps=w.norm_eps)
    if w.rope:
        q, k = state.rotate(kn, q, k)
    if w.qk_l2_norm:  # Llama 4 (Llama4TextL2Norm): weightless, after RoPE
        q = kn.rms_norm(xp, q, None, eps=w.norm_eps)
        k = kn.rms_norm(xp, k, None, eps=w.norm_eps)
    if w.temperature is not None:  # Llama 4's no-RoPE layers: q scaled by its position
        q = temperature_body(xp, q, state.positions(), *w.temperature)
    if w.sinks is None:
        o = state.attend(kn, i, q, k, v, w.window, w.chunk)  # (B, H, L, D)
    else:  # gpt-oss
        o = state.attend(kn, i, q, k, v, w.window, w.chunk, sinks=w.sinks)
    o = xp.reshape(xp.permute_dims(o, (0, 2, 1, 3)), (B, L, H * D))  # (B, L, H*D)
    if w.wg is not None:  # Qwen3-Next: o * sigmoid(x wg^T), the sigmoid rounded once
        o = o * sigmoid(xp, kn.project(xp, x, w.wg, w.bg))
    o = kn.project(xp, o, w.wo, None)  # (B, L, E_out)
    return o if w.bo is None else o + w.bo


def _offset_head_norms(
    xp: Namespace, kn: KernelSet, q: Array, k: Array, w: AttnWeights
) -> tuple[Array, Array]:
    """Qwen3-Next's zero-centred RMSNorm of each head of q ``(B, H, L, D)`` and k, the scale
    ``norm_offset + w`` in float32 (:func:`~portable_llm.ops.kernels.offset_rms_norm`)."""
    opts = {"eps": w.norm_eps, "offset": w.norm_offset}
    if w.q_norm is not None:
        q = offset_rms_norm(xp, kn, q, w.q_norm, **opts)
    if w.k_norm is not None:
        k = offset_rms_norm(xp, kn, k, w.k_norm, **opts)
    return q, k


class CallState:
    """One call of :func:`attention`: RoPE's options and positions, the cache or the padding,
    the SDPA options (the projections, norms and RoPE take ``impl`` through the kernels).
    :class:`~portable_llm.attn.latent.LatentCallState` builds on it."""

    def __init__(
        self, be: Any, impl: str, rope: Mapping[str, Any] | None, offset: Any, rows: Any,
        cache: Any, pad: Any, mask: Any, softcap: Any, scale: Any, block_size: int,
    ) -> None:  # fmt: skip
        self.be, self.impl, self.rope, self.offset, self.rows = be, impl, rope, offset, rows
        self.cache, self.pad, self.mask = cache, pad, mask
        self.softcap, self.scale, self.block_size = softcap, scale, block_size

    def rotate(self, kn: KernelSet, q: Array, k: Array) -> tuple[Array, Array]:
        if self.rope is None:
            return q, k
        xp, rows = self.be.xp, self.rows  # one frequency table for q and k
        start = self.offset if rows is None else nonnegative(xp, rows)
        _, (q, offsets, inv), ropts = rope_dispatch_args(q, start, **self.rope, backend=self.be)
        offsets = offsets if rows is None else rows  # < 0 only on pad columns, masked out
        q = kn.choose("rope", q, offsets, inv, **ropts)(xp, q, offsets, inv, **ropts)
        k = kn.choose("rope", k, offsets, inv, **ropts)(xp, k, offsets, inv, **ropts)
        return q, k

    def positions(self) -> Any:
        return self.offset if self.rows is None else self.rows

    def attend(
        self, kn: KernelSet, i: int, q: Array, k: Array, v: Array, window: int | None,
        chunk: int | None = None, *, sinks: Array | None = None,
    ) -> Array:  # fmt: skip
        be, xp, mask = self.be, self.be.xp, self.mask
        if self.cache is not None or self.pad is not None or chunk is not None:
            dev = be.device_of(q)
            k, v, mask, window = block_kv_mask(
                OP, xp, self.cache, self.pad, k, v, mask, window, dev, chunk=chunk
            )
        args, opts = sdpa_args(
            OP, be, q, k, v, mask, scale=self.scale, window=window, softcap=self.softcap,
            block_size=self.block_size, sinks=sinks,
        )  # fmt: skip
        return pick(be, SDPA, self.impl, *args, **opts)(xp, *args, **opts)  # (B, H, L, D)
