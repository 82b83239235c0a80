"""The prepared forward: the model's layers bound once, the chosen kernels called directly.

:class:`~portable_llm.decoder.model.Model` checks its weights once at load: when every weight
is a plain array of the model's backend in the model's dtype (or a quantized projection,
embedding or LM head), it builds a :class:`Prepared` forward. Each layer's weights are bound
into the records the ops' bodies take (:mod:`portable_llm.decoder.layer_weights`: quantized
projections with their ``quantized_linear`` kernel, packed ones where the backend packs them),
the kernels of the dense ops (``linear``, ``rms_norm``, the activation) are chosen once through
the backend's dispatcher (:class:`~portable_llm.ops.kernels.BoundKernels`), and per forward
only what depends on the call is built once and shared by every layer (a :class:`Step`):
RoPE's frequency table and offsets (and its kernel; for the portable kernel, its cos and sin),
the attention mask of each kind of layer, and the attention kernel.

Each layer is the equation: ``h = h + attention_body(norm(h))``, ``h = h + mlp_body(norm(h))``,
the same bodies the public :func:`~portable_llm.attention` and :func:`~portable_llm.mlp` call
after their checks (:func:`~portable_llm.attn.block.attention_body`,
:func:`~portable_llm.ops.linear.mlp_body`), so the results are bit for bit those of the
op-by-op path (``Model(..., prepared=False)``).

Inside a :func:`~portable_llm.trace` block a forward asks the dispatcher for every kernel as it
runs (:meth:`BoundKernels.traced <portable_llm.ops.kernels.BoundKernels.traced>`: the entry the
public ops use, with the same choices), so the trace lists each kernel of each layer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from portable_llm.attn.block import AttnWeights, attention_body
from portable_llm.attn.padding import nonnegative
from portable_llm.attn.sdpa import OP as SDPA
from portable_llm.attn.sdpa_args import SdpaOptions
from portable_llm.attn.visibility import visible
from portable_llm.backends import Backend, backend_of, resolve
from portable_llm.core.arrays import creation_device
from portable_llm.core.dispatch import dispatcher, tracing
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.layer_weights import (
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
from portable_llm.ops.kernels import BOUND_PROJECTIONS, BoundKernels, Kernels
from portable_llm.ops.linear import mlp_body
from portable_llm.ops.moe import moe
from portable_llm.ops.quant import QuantizedWeight
from portable_llm.rotary.args import dispatch_args as rope_dispatch_args
from portable_llm.rotary.rope import rope_tables, rotate

Fn = Callable[..., Any]

__all__ = [
    "AttnWeights",
    "check_learned_positions",
    "position_ids",
    "Layer",
    "MlpWeights",
    "Packed",
    "Prepared",
    "QLinear",
    "Step",
    "preparable",
]


class Prepared:
    """The forward of a model whose weights were checked at load (see the module docstring).

    Parameters
    ----------
    config : DecoderConfig
    bk : Backend
    dtype : the backend's float dtype of every weight
    embed, norm, lm_head : arrays ``(V, E)``, ``(E,)``, ``(V, E)`` or ``None`` (tied)
    blocks : the model's :class:`~portable_llm.decoder.model.Block` records
    norm_bias, head_bias : arrays ``(E,)``, ``(V,)``, optional
        The final LayerNorm's bias (GPT-2, Phi-2) and the LM head's (Phi-2).
    positions : array ``(P, E)``, optional
        Learned absolute position embeddings (GPT-2's ``wpe``), added to the token embeddings
        before the first layer.
    reduce : callable, optional
        On a tensor-parallel rank (:mod:`portable_llm.partition`), the all-reduce that
        completes its partial sums: applied to each layer's attention and feed-forward outputs
        before their biases and norms (``o_proj``'s bias is then added after it); ``None`` on
        one device.
    activations : {"float", "int8"}
        The activations of every quantized projection (:func:`~portable_llm.load`'s): each
        :class:`QLinear` is bound to ``quantized_linear`` or ``quantized_linear_int8``.
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
        *,
        norm_bias: Any = None,
        head_bias: Any = None,
        positions: Any = None,
        reduce: Callable[[Any], Any] | None = None,
        activations: str = "float",
    ) -> None:
        self.config = config
        #: The activations of the quantized projections (``"float"`` or ``"int8"``).
        self.activations = activations
        self.norm_bias, self.head_bias, self.positions = norm_bias, head_bias, positions
        #: The model's norms are LayerNorm (GPT-2, Phi-2), with biases; else RMSNorm.
        self.layer_norm = config.norm == "layer"
        self.bk = bk
        self.xp = bk.xp
        self.embed, self.norm = embed, norm
        self.head = embed if lm_head is None else lm_head  # (V, E)
        d = self.dispatch = dispatcher(bk)
        self.layers = [bind_layer(b, lambda w: bind_weight(d, w, activations)) for b in blocks]
        #: A tensor-parallel rank's all-reduce (``None``: one device); o_proj's bias moves
        #: after it, so the sum counts it once.
        self.reduce = reduce
        if reduce is not None:
            self.layers = [
                replace(layer, attn=replace(layer.attn, bo=None), o_bias=layer.attn.bo)
                for layer in self.layers
            ]
        self._head = bind_weight(d, self.head, activations)  # QLinear, Packed, or the weight
        projections = [w for layer in self.layers for w in layer_projections(layer)]
        #: The projections kept quantized (the LM head included): those ``activations`` rules.
        self.quantized_projections = sum(type(w) is QLinear for w in [*projections, self._head])
        #: Whether a weight is quantized (a compiled step takes them on JAX only).
        self.quantized = isinstance(embed, QuantizedWeight) or self.quantized_projections > 0
        self.H, self.H_kv, self.D = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.eps = config.rms_norm_eps
        scale = config.attn_scale  # Gemma: query_pre_attn_scalar ** -0.5
        self.scale = 1.0 / math.sqrt(self.D) if scale is None else scale
        #: Gemma 2's attention and final-logit soft-capping (None: none).
        self.softcap, self.final_softcap = config.attn_softcap, config.final_softcap
        #: Gemma: the embeddings times sqrt(E), rounded to the model's dtype (HF's normalizer).
        self.embed_scale = None
        if config.embed_scale:
            root, dev = math.sqrt(config.hidden_size), bk.device_of(norm)
            self.embed_scale = bk.xp.asarray(root, dtype=dtype, device=dev)
        self.rope = dict(config.rope) if config.rope is not None else None
        #: Gemma 3: the RoPE of the sliding layers (``local_layers``), apart from the others'.
        self.rope_local = None if config.rope_local is None else dict(config.rope_local)
        self.local_layers = frozenset(
            i for i, kind in enumerate(config.layer_types)
            if self.rope_local is not None and kind == "sliding_attention"
        )  # fmt: skip
        #: Whether the layers rotate q and k (GPT-2's learned positions: no RoPE).
        self.use_rope = config.position_embedding == "rope"
        self.portable_rope = d.portable_impl("rope")
        x = bk.xp.zeros((1, 1, config.hidden_size), dtype=dtype, device=bk.device_of(norm))
        act = activation_op(config.hidden_act, "model")
        #: The dense ops' kernels, chosen once.
        bound = any(type(w) in BOUND_PROJECTIONS for w in [*projections, self._head])
        self.kernels = BoundKernels.choose_for(bk, x, norm, eps=self.eps, act=act, bound=bound)
        #: Every layer is RMSNorm, attention, RMSNorm, a dense MLP (Llama, Qwen, Mistral):
        #: :meth:`run_layers` then writes the two-line layer out, with no helper calls.
        dense = all(
            not layer.parallel and layer.mlp is not None and layer.attn_norm is None
            for layer in self.layers
        )
        self.plain = reduce is None and not self.layer_norm and dense

    @property
    def bound_head(self) -> Any:
        """The LM head as bound at load: the weight, or a :class:`QLinear`/:class:`Packed` one
        with its kernel (a compiled step reuses its kernels)."""
        return self._head

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
        step = self.step(cache, pad, ids.shape[1])
        h = self.run_layers(h, step, self.layers)
        if last_only:
            h = h[:, -1:, :]  # (B, 1, E)
        return self.head_logits(h, norm, head, step.kn)

    def step(self, cache: Sequence[Any] | None, pad: Any, L: int) -> Step:
        """The :class:`Step` of a forward of ``L`` new tokens per row over ``cache`` (or, with
        none, rows left-padded by ``pad``, checked by the model)."""
        offset = 0
        if cache is not None:
            offset = cache[0].offset
            pad = cache[0].left_padding
            if pad is not None and backend_of(pad) is not self.bk:
                _, (pad,) = resolve("model", self.bk, pad)
        rows = None if pad is None else offset - pad  # (B,) RoPE offsets of a padded batch
        return Step(self, cache, pad, rows, offset, L)

    def run_layers(
        self, h: Any, step: Step, layers: Sequence[Layer], *, embedded: bool = False
    ) -> Any:
        """The decoder layers over ``h`` ``(B, L, E)``; ``step`` holds what they share (and,
        with learned positions, where the rows start: their embeddings are added first, and
        Gemma's scale applied, unless ``embedded``: a later pipeline stage's hidden states)."""
        xp, kn = self.xp, step.kn
        if self.positions is not None and not embedded:  # GPT-2: h = wte[ids] + wpe[positions]
            start = step.offset if step.rows is None else step.rows
            pos = position_ids(xp, start, step.L, creation_device(h))
            h = h + self.dispatch.pick("embedding", "masked")(xp, pos, self.positions)
        if self.embed_scale is not None and not embedded:  # Gemma: h * sqrt(E), model's dtype
            h = h * self.embed_scale
        local = step.local() if self.local_layers else step
        if not self.plain:
            for i, layer in enumerate(layers):
                r = self.normed(kn, h, layer.input_norm, layer.input_bias)
                state = local if i in self.local_layers else step
                a = attention_body(xp, kn, r, layer.attn, state, i)
                if self.reduce is not None:  # a tensor-parallel rank: the partial sums added
                    a = self.reduce(a) if layer.o_bias is None else self.reduce(a) + layer.o_bias
                if layer.parallel:  # Phi-2: HF's attn_outputs + feed_forward + residual
                    h = (a + self.feed_forward(kn, r, layer)) + h
                    continue
                if layer.attn_norm is not None:  # Gemma's sandwich: the output normed too
                    a = self.normed(kn, a, layer.attn_norm, None)
                h = h + a
                r = self.normed(kn, h, layer.post_norm, layer.post_bias)
                m = self.feed_forward(kn, r, layer)
                if layer.ff_norm is not None:
                    m = self.normed(kn, m, layer.ff_norm, None)
                h = h + m
            return h
        # RMSNorm and a dense MLP in every layer (Llama, Qwen, Mistral): the equation, with no
        # call between the layer and its kernels and bodies (a decode step's Python overhead).
        eps = self.eps
        for i, layer in enumerate(layers):
            r = kn.rms_norm(xp, h, layer.input_norm, eps=eps)
            h = h + attention_body(xp, kn, r, layer.attn, step, i)
            r = kn.rms_norm(xp, h, layer.post_norm, eps=eps)
            h = h + mlp_body(xp, kn, r, layer.mlp)  # type: ignore[arg-type]  # plain: dense
        return h

    def normed(self, kn: Any, h: Any, w: Any, b: Any) -> Any:
        """The model's norm of ``h``: LayerNorm (weight and bias) or RMSNorm."""
        if self.layer_norm:
            return kn.layer_norm(self.xp, h, w, b, eps=self.eps)
        return kn.rms_norm(self.xp, h, w, eps=self.eps)

    def feed_forward(self, kn: Any, r: Any, layer: Layer) -> Any:
        """The layer's dense MLP or mixture of experts (a tensor-parallel rank's completed by
        the all-reduce)."""
        if layer.mlp is not None:
            m = mlp_body(self.xp, kn, r, layer.mlp)
        else:
            assert layer.moe is not None
            m = moe(r, *layer.moe["arrays"], **layer.moe["options"])
        return m if self.reduce is None else self.reduce(m)

    def head_logits(self, h: Any, norm: Any, head: Any, kn: Any = None) -> Any:
        """The final norm and the LM head: ``(B, L, E)`` -> ``(B, L, V)``; ``kn``: the
        forward's kernels (default: those bound at load)."""
        if kn is None:
            kn = self.kernels
        if head is self.head:
            head = self._head
        elif isinstance(head, QuantizedWeight):  # another head than the one bound at load
            head = bind_weight(self.dispatch, head, self.activations)
        h = self.normed(kn, h, norm, self.norm_bias)
        if kn.bound and type(head) in BOUND_PROJECTIONS:  # its own kernel (another head too)
            logits = head(self.xp, h, self.head_bias)  # (B, L, V)
        else:
            logits = kn.project(self.xp, h, head, self.head_bias)  # (B, L, V)
        if self.final_softcap is not None:  # Gemma 2: cap * tanh(logits / cap), HF's order
            xp = self.xp
            cap = xp.asarray(self.final_softcap, dtype=logits.dtype, device=self.bk.device_of(h))
            logits = xp.tanh(logits / cap) * cap
        return logits


def check_learned_positions(op: str, config: DecoderConfig, start: int, L: int) -> None:
    """Learned absolute positions (GPT-2's ``wpe``: ``max_position_embeddings`` rows, HF's
    ``n_positions``) end at their last row: ``L`` new tokens after ``start`` (the caches'
    offset, in columns of a left-padded batch) must fit in them. The check of every forward
    of such a model (op-by-op, prepared, compiled, paged, partitioned), before anything runs:
    past the table, the prepared path's embedding gives NaN rows. RoPE models are not limited
    here (their ``max_position_embeddings`` is a trained length, not a table).

    Raises
    ------
    ValueError
        ``start + L > max_position_embeddings``, naming both.
    """
    P = config.max_position_embeddings
    if config.position_embedding == "learned" and P is not None and start + L > P:
        raise ValueError(
            f"{op}: a sequence of {start + L} tokens ({start} cached + {L} new) is longer than "
            f"n_positions={P}, the rows of {config.model_type}'s learned position table "
            f"(positions 0..{P - 1})"
        )


def position_ids(xp: Any, start: Any, L: int, device: Any) -> Any:
    """Positions ``start + l`` of ``L`` new tokens: ``(L,)`` for an int (or traced 0-d) start,
    ``(B, L)`` for ``(B,)`` row starts (a left-padded row starts below 0: its pad columns get
    position 0, as they are masked anyway)."""
    steps = xp.arange(L, device=device)  # (L,)
    if getattr(start, "ndim", 0) == 1:
        pos = xp.reshape(start, (start.shape[0], 1)) + steps  # (B, L)
        return xp.where(pos < 0, xp.zeros_like(pos), pos)
    return steps + start  # (L,)


class Step:
    """What one forward builds once and its layers share: its kernels (those bound at load, or
    inside a trace the dispatcher's per call), RoPE's table and kernel, the masks, the attention
    kernel. The :class:`~portable_llm.attn.block.AttentionState` of the layers'
    :func:`~portable_llm.attn.block.attention_body`; the compiled and paged forwards extend it.

    Parameters
    ----------
    p : Prepared
    cache : the layers' KV caches, or ``None``
    pad : ``(B,)`` left padding, or ``None``
    rows : ``(B,)`` RoPE offsets of a padded batch, or ``None``
    offset : the position of the first new token (the caches' offset)
    L : the new tokens per row
    """

    def __init__(self, p: Prepared, cache: Any, pad: Any, rows: Any, offset: Any, L: int) -> None:
        self.p, self.cache, self.pad, self.rows, self.offset, self.L = (
            p,
            cache,
            pad,
            rows,
            offset,
            L,
        )
        #: The kernels of this forward: bound at load, or asked per call inside a trace.
        self.kn: BoundKernels | Kernels = p.kernels.traced() if tracing() else p.kernels
        self.rope: tuple[Fn, Any, Any, dict[str, Any]] | None = None
        self.tables: tuple[Any, Any] | None = None  # the portable RoPE's cos and sin
        self.masks: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.sdpa: dict[tuple[Any, ...], Fn] = {}
        #: The options of this step's RoPE (Gemma 3's sliding layers: their own, :meth:`local`).
        self.rope_options: dict[str, Any] = p.rope or {}

    def local(self) -> Step:
        """This step with the RoPE of the sliding layers (Gemma 3's ``rope_local``): the same
        caches, masks and kernels, its own frequency table and positions' angles."""
        other = copy.copy(self)
        other.rope, other.tables, other.rope_options = None, None, self.p.rope_local or {}
        return other

    def rope_args(self, q: Any) -> tuple[Fn, Any, Any, dict[str, Any]]:
        """RoPE's kernel (``auto``'s), offsets, frequency table and options, once per forward."""
        if self.rope is None:
            p, xp = self.p, self.p.xp
            start = self.offset if self.rows is None else nonnegative(xp, self.rows)
            opts = self.rope_options
            _, (_, offsets, inv), ropts = rope_dispatch_args(q, start, **opts, backend=p.bk)
            offsets = offsets if self.rows is None else self.rows  # < 0 only on pad columns
            fn = p.dispatch.pick("rope", "auto", q, offsets, inv, **ropts)
            self.rope = (fn, offsets, inv, ropts)
        return self.rope

    def rotate(self, kn: Any, q: Any, k: Any) -> tuple[Any, Any]:
        """RoPE of ``q`` ``(B, H, L, D)`` and ``k`` ``(B, H_kv, L, D)`` at this step's positions.

        With the portable kernel, its cos and sin tables are computed once per forward (the
        kernel's own steps, :func:`~portable_llm.rotary.rope.rope_tables`) and every layer only
        rotates; a native kernel runs per call, and so does every kernel inside a trace.
        """
        if self.p.rope is None or not self.p.use_rope:
            return q, k
        fn, offsets, inv, ropts = self.rope or self.rope_args(q)
        xp = self.p.xp
        if not kn.bound:  # inside a trace: the dispatcher's choice per call, recorded
            fq = kn.choose("rope", q, offsets, inv, **ropts)
            fk = kn.choose("rope", k, offsets, inv, **ropts)
            return fq(xp, q, offsets, inv, **ropts), fk(xp, k, offsets, inv, **ropts)
        if fn is not self.p.portable_rope:
            return fn(xp, q, offsets, inv, **ropts), fn(xp, k, offsets, inv, **ropts)
        if self.tables is None:
            off, att = ropts["offset"], ropts["attention"]
            self.tables = rope_tables(xp, q, offsets, inv, offset=off, attention=att)
        cos, sin = self.tables
        dims, traditional = ropts["dims"], ropts["traditional"]
        return (
            rotate(xp, q, cos, sin, cos, sin, dims, traditional),
            rotate(xp, k, cos, sin, cos, sin, dims, traditional),
        )

    def positions(self) -> Any:
        """Each row's first position: the offset, or ``(B,)`` (a padded batch's rows, whose
        first real token is at 0, pad columns below; paged rows of other lengths)."""
        return self.offset if self.rows is None else self.rows

    def kv(
        self, i: int, k: Any, v: Any, window: int | None, chunk: int | None = None
    ) -> tuple[Any, Any, Any, Any]:
        """Layer ``i``'s keys and values to attend (its cache updated) and ``(mask, window)``,
        the mask built once per kind of layer (``chunk``: Llama 4's chunked layers)."""
        c = None if self.cache is None else self.cache[i]
        if c is None:
            if self.pad is None and chunk is None:
                return k, v, "causal", window
            key: tuple[Any, ...] = (None, window, chunk)
            got = self.masks.get(key)
            if got is None:
                xp, L = self.p.xp, self.L
                dev = self.p.bk.device_of(k)
                got = self.masks[key] = (
                    visible(xp, L, L, window=window, chunk=chunk, pad=self.pad, device=dev),
                    None,
                )
            return k, v, *got
        k, v = c.update_and_fetch(k, v)
        # Caches of one kind and window saw the same updates: their masks are equal.
        key = (type(c), window, chunk, getattr(c, "max_size", None), getattr(c, "keep", None))
        got = self.masks.get(key)
        if got is None:
            got = self.masks[key] = c.make_mask(window=window, chunk=chunk)
        else:  # the same mask, already built for an earlier layer of this kind
            c.reuse_mask()
        return k, v, *got

    def attend(
        self, kn: Any, i: int, q: Any, k: Any, v: Any, window: int | None,
        chunk: int | None = None, *, sinks: Any = None,
    ) -> Any:  # fmt: skip
        """Layer ``i``'s attention of ``q`` ``(B, H, L, D)`` over its cache and the new keys
        and values ``(B, H_kv, L, D)`` (after RoPE): the output ``(B, H, L, D)``; ``sinks``
        ``(H,)``: the layer's attention sinks (the SDPA's fifth array). A forward over another
        kind of cache (paged) overrides this."""
        p = self.p
        k, v, mask, window = self.kv(i, k, v, window, chunk)
        causal = isinstance(mask, str) or window is not None
        mask = None if isinstance(mask, str) else mask
        opts = SdpaOptions(scale=p.scale, causal=causal, window=window, softcap=p.softcap)
        arrays = (q, k, v, mask) if sinks is None else (q, k, v, mask, sinks)
        key: tuple[Any, ...] = (
            causal, window, None if mask is None else tuple(mask.shape), tuple(k.shape),
            sinks is not None,
        )  # fmt: skip
        fn = self.sdpa.get(key)
        if not kn.bound:  # inside a trace: asked (and recorded) per layer
            fn = kn.choose(SDPA, *arrays, opts=opts)
        elif fn is None:  # auto's choice, as kn.choose makes it, once per forward
            fn = self.sdpa[key] = p.dispatch.pick(SDPA, "auto", *arrays, opts=opts)
        return fn(p.xp, *arrays, opts=opts)  # (B, H, L, D)
