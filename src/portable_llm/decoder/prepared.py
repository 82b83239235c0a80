"""The prepared forward: the model's layers bound once, the chosen kernels called directly.

:class:`~portable_llm.decoder.model.Model` checks its weights once at load: when every weight
is a plain array of the model's backend in the model's dtype (or a quantized projection,
embedding or LM head), it builds a :class:`Prepared` forward. Each layer's weights are bound
into typed records (:mod:`portable_llm.decoder.layer_weights`: quantized projections with their
``quantized_linear`` kernel, packed ones where the backend packs them), the kernels of the dense
ops (``linear``, ``rms_norm``, the activation) are chosen once through the backend's
dispatcher, and per forward only what depends on the call is built once and shared by every
layer: RoPE's frequency table and offsets (and its kernel; for the portable kernel, its cos and
sin), the attention mask of each kind of layer, and the attention kernel. The layers then call
those implementations directly: no backend resolution and no argument checks per layer (the
public ops keep theirs for users). The results are bit for bit those of the op-by-op path
(``Model(..., prepared=False)``), which composes the public ops: the same kernels receive the
same arrays and options.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from portable_llm.attn.padding import nonnegative
from portable_llm.attn.sdpa import OP as SDPA
from portable_llm.attn.sdpa_args import SdpaOptions
from portable_llm.attn.visibility import visible
from portable_llm.backends import Backend, backend_of, resolve
from portable_llm.core.dispatch import dispatcher
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.layer_weights import (
    AttnWeights,
    Kernels,
    Layer,
    MlpWeights,
    Packed,
    QLinear,
    bind_layer,
    bind_weight,
    layer_projections,
    preparable,
)
from portable_llm.ops.activations import activation_op
from portable_llm.ops.embedding import embedding
from portable_llm.ops.moe import moe
from portable_llm.ops.quant import QuantizedWeight
from portable_llm.rotary.args import dispatch_args as rope_dispatch_args
from portable_llm.rotary.rope import _angles, _rotate

Fn = Callable[..., Any]

__all__ = [
    "AttnWeights",
    "Kernels",
    "Layer",
    "MlpWeights",
    "Packed",
    "Prepared",
    "QLinear",
    "preparable",
]


def _heads(xp: Any, y: Any, n: int, d: int) -> Any:
    b, L = y.shape[0], y.shape[1]
    return xp.permute_dims(xp.reshape(y, (b, L, n, d)), (0, 2, 1, 3))  # (B, n, L, D)


def _mask_key(cache: Any, window: int | None) -> tuple[Any, ...]:
    """Caches of one kind and window saw the same updates: their masks are equal."""
    return (type(cache), window, getattr(cache, "max_size", None), getattr(cache, "keep", None))


def _rope_tables(
    xp: Any, x: Any, offsets: Any, inv: Any, *, offset: int, dims: int, traditional: bool,
    attention: float,
) -> tuple[Any, Any]:  # fmt: skip
    """cos and sin of the portable RoPE kernel (``rotary.rope._rope``, its steps) for ``x``
    ``(B, .., L, D)``: ``(L, D')`` or ``(B, 1.., L, D')``, in x's dtype."""
    L = x.shape[-2]
    positions = xp.arange(offset, offset + L, device=getattr(x, "device", None))  # (L,)
    if offsets is not None:  # () -> (L,); (B,) -> (B, L)
        positions = xp.reshape(offsets, (*tuple(offsets.shape), 1)) + positions
    cos, sin = _angles(xp, positions, inv, attention)  # (L, h) or (B, L, h)
    if cos.ndim == 3:  # (B, L, h) -> (B, 1.., L, h) against x (B, .., L, D)
        shape = (cos.shape[0], *(1,) * (x.ndim - 3), *tuple(cos.shape)[1:])
        cos, sin = xp.reshape(cos, shape), xp.reshape(sin, shape)
    return xp.astype(cos, x.dtype), xp.astype(sin, x.dtype)


class Prepared:
    """The forward of a model whose weights were checked at load (see the module docstring).

    Parameters
    ----------
    config : DecoderConfig
    bk : Backend
    dtype : the backend's float dtype of every weight
    embed, norm, lm_head : arrays ``(V, E)``, ``(E,)``, ``(V, E)`` or ``None`` (tied)
    blocks : the model's :class:`~portable_llm.decoder.model.Block` records
    """

    def __init__(
        self,
        config: DecoderConfig,
        bk: Backend,
        dtype: Any,
        embed: Any,
        norm: Any,
        lm_head: Any,
        blocks: Sequence[Any],
    ) -> None:
        self.config = config
        self.bk = bk
        self.xp = bk.xp
        self.embed, self.norm = embed, norm
        self.head = embed if lm_head is None else lm_head  # (V, E)
        d = self.dispatch = dispatcher(bk)
        self.layers = [bind_layer(b, lambda w: bind_weight(d, w)) for b in blocks]
        self._head = bind_weight(d, self.head)  # QLinear (quantized) or Packed where packed
        projections = [w for layer in self.layers for w in layer_projections(layer)]
        #: Whether a weight is quantized (a compiled step takes them on JAX only).
        self.quantized = isinstance(embed, QuantizedWeight) or any(
            type(w) is QLinear for w in [*projections, self._head]
        )
        self.H, self.H_kv, self.D = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.eps = config.rms_norm_eps
        self.scale = 1.0 / math.sqrt(self.D)
        self.rope = dict(config.rope) if config.rope is not None else None
        self.portable_rope = d.portable_impl("rope")
        E = config.hidden_size
        x = bk.xp.zeros((1, 1, E), dtype=dtype, device=bk.device_of(norm))
        self.kernels = Kernels(
            linear=d.pick("linear", "auto", x, bk.xp.zeros((1, E), dtype=dtype), None),
            rms_norm=d.pick("rms_norm", "auto", x, norm, eps=self.eps),
            act=d.pick(activation_op(config.hidden_act, "model"), "auto", x),
        )

    # -- one forward ---------------------------------------------------------------------------
    def __call__(
        self,
        ids: Any,
        cache: Sequence[Any] | None,
        pad: Any,
        last_only: bool,
        top: tuple[Any, Any, Any] | None = None,
        check_ids: bool = True,
    ) -> Any:
        """Logits ``(B, L | 1, V)`` of ``ids`` ``(B, L)`` (already on the model's backend and
        device; ``pad`` checked by the model). ``top``: the model's ``(embed, norm, head)``
        as they are now (default: those bound here). ``check_ids=False``: the embedding does
        not read the ids back (a decode loop's own ids; out of range: NaN rows)."""
        embed, norm, head = top or (self.embed, self.norm, self.head)
        h = embedding(ids, embed, check=check_ids)  # (B, L, E): the public op
        L = ids.shape[1]
        offset = 0
        if cache is not None:
            offset = cache[0].offset
            pad = cache[0].left_padding
            if pad is not None and backend_of(pad) is not self.bk:
                _, (pad,) = resolve("model", self.bk, pad)
        rows = None if pad is None else offset - pad  # (B,) RoPE offsets of a padded batch
        h = self.run_layers(h, _Step(self, cache, pad, rows, offset, L), self.layers)
        if last_only:
            h = h[:, -1:, :]  # (B, 1, E)
        return self.head_logits(h, norm, head)

    def run_layers(self, h: Any, step: _Step, layers: Sequence[Layer]) -> Any:
        """The decoder layers over ``h`` ``(B, L, E)``; ``step`` holds what they share."""
        xp, kn, eps = self.xp, self.kernels, self.eps
        for i, layer in enumerate(layers):
            r = kn.rms_norm(xp, h, layer.input_norm, eps=eps)
            h = h + step.attention(r, layer.attn, i)
            r = kn.rms_norm(xp, h, layer.post_norm, eps=eps)
            if layer.mlp is not None:
                m = layer.mlp
                gate = kn.project(xp, r, m.w_gate, m.b_gate)  # (B, L, I)
                up = kn.project(xp, r, m.w_up, m.b_up)  # (B, L, I)
                out = kn.project(xp, kn.act(xp, gate) * up, m.w_down, m.b_down)  # (B, L, E)
            else:
                assert layer.moe is not None
                out = moe(r, *layer.moe["arrays"], **layer.moe["options"])
            h = h + out
        return h

    def head_logits(self, h: Any, norm: Any, head: Any) -> Any:
        """The final norm and the LM head: ``(B, L, E)`` -> ``(B, L, V)``."""
        kn = self.kernels
        if head is self.head:
            head = self._head
        elif isinstance(head, QuantizedWeight):  # another head than the one bound at load
            head = bind_weight(self.dispatch, head)
        return kn.project(self.xp, kn.rms_norm(self.xp, h, norm, eps=self.eps), head, None)


class _Step:
    """What one forward builds once and its layers share: RoPE's table and kernel, the masks,
    the attention kernel."""

    def __init__(self, p: Prepared, cache: Any, pad: Any, rows: Any, offset: int, L: int) -> None:
        self.p, self.cache, self.pad, self.rows, self.offset, self.L = (
            p,
            cache,
            pad,
            rows,
            offset,
            L,
        )
        self.rope: tuple[Fn, Any, Any, dict[str, Any]] | None = None
        self.tables: tuple[Any, Any] | None = None  # the portable RoPE's cos and sin
        self.masks: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.sdpa: dict[tuple[Any, ...], Fn] = {}

    def _rope(self, q: Any) -> tuple[Fn, Any, Any, dict[str, Any]]:
        if self.rope is None:
            p, xp = self.p, self.p.xp
            start = self.offset if self.rows is None else nonnegative(xp, self.rows)
            _, (_, offsets, inv), ropts = rope_dispatch_args(q, start, **p.rope, backend=p.bk)
            offsets = offsets if self.rows is None else self.rows  # < 0 only on pad columns
            fn = p.dispatch.pick("rope", "auto", q, offsets, inv, **ropts)
            self.rope = (fn, offsets, inv, ropts)
        return self.rope

    def rotate(self, q: Any, k: Any) -> tuple[Any, Any]:
        """RoPE of ``q`` ``(B, H, L, D)`` and ``k`` ``(B, H_kv, L, D)`` at this step's positions.

        With the portable kernel, its cos and sin tables are computed once per forward (the
        kernel's own steps) and every layer only rotates; a native kernel runs per call.
        """
        fn, offsets, inv, ropts = self._rope(q)
        xp = self.p.xp
        if fn is not self.p.portable_rope:
            return fn(xp, q, offsets, inv, **ropts), fn(xp, k, offsets, inv, **ropts)
        if self.tables is None:
            self.tables = _rope_tables(xp, q, offsets, inv, **ropts)
        cos, sin = self.tables
        dims, traditional = ropts["dims"], ropts["traditional"]
        return (
            _rotate(xp, q, cos, sin, cos, sin, dims, traditional),
            _rotate(xp, k, cos, sin, cos, sin, dims, traditional),
        )

    def _mask(self, layer_cache: Any, window: int | None, k: Any) -> tuple[Any, Any]:
        """``(mask, window)`` of the layer's attention, built once per kind of layer."""
        if layer_cache is None:
            if self.pad is None:
                return "causal", window
            key: tuple[Any, ...] = (None, window)
            got = self.masks.get(key)
            if got is None:
                xp, L = self.p.xp, self.L
                dev = self.p.bk.device_of(k)
                got = self.masks[key] = (
                    visible(xp, L, L, window=window, pad=self.pad, device=dev),
                    None,
                )
            return got
        key = _mask_key(layer_cache, window)
        got = self.masks.get(key)
        if got is None:
            got = self.masks[key] = layer_cache.make_mask(window=window)
        else:  # the same mask, already built for an earlier layer of this kind
            layer_cache._unmasked = False
        return got

    def kv(self, i: int, k: Any, v: Any, window: int | None) -> tuple[Any, Any, Any, Any]:
        """Layer ``i``'s keys and values to attend (its cache updated) and ``(mask, window)``."""
        layer_cache = None if self.cache is None else self.cache[i]
        if layer_cache is not None:
            k, v = layer_cache.update_and_fetch(k, v)
        return (k, v, *self._mask(layer_cache, window, k))

    def attend(self, i: int, q: Any, k: Any, v: Any, window: int | None) -> Any:
        """Layer ``i``'s attention of ``q`` ``(B, H, L, D)`` over its cache and the new keys
        and values ``(B, H_kv, L, D)`` (after RoPE): the output ``(B, H, L, D)``. A forward
        over another kind of cache (paged) overrides this."""
        p = self.p
        k, v, mask, window = self.kv(i, k, v, window)
        causal = isinstance(mask, str) or window is not None
        mask = None if isinstance(mask, str) else mask
        opts = SdpaOptions(scale=p.scale, causal=causal, window=window)
        key = (causal, window, None if mask is None else tuple(mask.shape), tuple(k.shape))
        fn = self.sdpa.get(key)
        if fn is None:
            fn = self.sdpa[key] = p.dispatch.pick(SDPA, "auto", q, k, v, mask, opts=opts)
        return fn(p.xp, q, k, v, mask, opts=opts)  # (B, H, L, D)

    def attention(self, x: Any, a: AttnWeights, i: int) -> Any:
        p = self.p
        xp, kn, H, H_kv, D = p.xp, p.kernels, p.H, p.H_kv, p.D
        B, L = x.shape[0], x.shape[1]
        q = _heads(xp, kn.project(xp, x, a.wq, a.bq), H, D)  # (B, H, L, D)
        k = _heads(xp, kn.project(xp, x, a.wk, a.bk), H_kv, D)  # (B, H_kv, L, D)
        v = _heads(xp, kn.project(xp, x, a.wv, a.bv), H_kv, D)  # (B, H_kv, L, D)
        if a.q_norm is not None:
            q = kn.rms_norm(xp, q, a.q_norm, eps=p.eps)
        if a.k_norm is not None:
            k = kn.rms_norm(xp, k, a.k_norm, eps=p.eps)
        if p.rope is not None:
            q, k = self.rotate(q, k)
        o = self.attend(i, q, k, v, a.window)  # (B, H, L, D)
        o = xp.reshape(xp.permute_dims(o, (0, 2, 1, 3)), (B, L, H * D))  # (B, L, H*D)
        o = kn.project(xp, o, a.wo, None)  # (B, L, E)
        return o if a.bo is None else o + a.bo
