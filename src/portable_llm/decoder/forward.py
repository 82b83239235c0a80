"""The decoder's one forward: embed the tokens, run a range of layers, project to logits.

:class:`Forward` is written once and run in every way a model runs: what changes is the kernel
set it was built with (:class:`~portable_llm.ops.kernels.KernelSet`), the forward state it is
given (:mod:`portable_llm.decoder.states`) and the layers it runs:

- the prepared forward (the default): the layers' projections bound at load, the dense ops'
  kernels chosen once (:func:`~portable_llm.decoder.prepared.prepare`);
- the op-by-op forward (``Model(..., prepared=False)``, weights in mixed float dtypes): the
  public ops as the kernel set, each checking its arguments
  (:func:`~portable_llm.decoder.prepared.op_by_op`);
- inside :func:`~portable_llm.trace`: the same forward, its state asking the dispatcher for
  every kernel per call, so the trace lists them;
- the compiled decode step (:mod:`~portable_llm.decoder.compiled`): the prepared forward with
  traced layers and a state that updates the cache buffers functionally;
- the paged forward (:mod:`~portable_llm.decoder.paged_step`): a state over paged caches;
- a partitioned rank (:mod:`portable_llm.partition`): its stages' layer ranges, with the
  tensor-parallel all-reduce as ``reduce``.

Each layer is the equation, ``h = h + attention_body(norm(h))`` and
``h = h + mlp_body(norm(h))``, with the bodies the public :func:`~portable_llm.attention` and
:func:`~portable_llm.mlp` call after their checks, so every way gives the same logits, bit for
bit.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

from portable_llm.attn.block import AttnWeights, attention_body
from portable_llm.attn.latent import LatentWeights, latent_attention_body
from portable_llm.backends import Backend, backend_of, resolve
from portable_llm.core.arrays import creation_device
from portable_llm.core.dispatch import dispatcher
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.layer_weights import Layer
from portable_llm.decoder.mixer import run_mixer
from portable_llm.decoder.states import DenseState, ForwardSetup, ForwardState
from portable_llm.ops.affine import times
from portable_llm.ops.embedding import embedding
from portable_llm.ops.kernels import BOUND_PROJECTIONS, KernelSet, offset_rms_norm
from portable_llm.ops.linear import mlp_body
from portable_llm.ops.quant import QuantizedWeight

__all__ = ["Forward", "check_learned_positions", "head_weight", "position_ids"]


def head_weight(embed: Any, lm_head: Any) -> Any:
    """The LM head ``(V, E)``: ``lm_head``, or the embedding when the head is tied (``None``)."""
    return embed if lm_head is None else lm_head


class Forward:
    """The decoder's forward (see the module docstring): :meth:`embed`, :meth:`run_layers` over
    a range, :meth:`head`, and :meth:`__call__`, the three in a row.

    Parameters
    ----------
    config : DecoderConfig
    bk : Backend
    kernels : KernelSet
        Bound once (:class:`~portable_llm.ops.kernels.BoundKernels`) or the public ops
        (:class:`~portable_llm.ops.checked_kernels.CheckedKernels`).
    layers : the layers, their projections bound where ``bind`` binds them
    embed, norm, head : arrays ``(V, E)``, ``(E,)``, ``(V, E)`` (the head: the embedding when
        tied, :func:`head_weight`)
    bound_head : the head as ``bind`` bound it (default: ``head``)
    bind : callable, optional
        How a projection is bound for ``kernels`` (``None``: not at all, the op-by-op
        forward): another head given to :meth:`head` is bound so per call.
    norm_bias, head_bias : arrays ``(E,)``, ``(V,)``, optional
        The final LayerNorm's bias (GPT-2, Phi-2) and the LM head's (Phi-2).
    positions : array ``(P, E)``, optional
        Learned absolute position embeddings (GPT-2's ``wpe``).
    reduce : callable, optional
        On a tensor-parallel rank (:mod:`portable_llm.partition`), the all-reduce that
        completes its partial sums: applied to each layer's attention and feed-forward outputs
        before their biases and norms (``o_proj``'s bias, :attr:`Layer.o_bias`, after it).
    """

    def __init__(
        self, config: DecoderConfig, bk: Backend, kernels: KernelSet, layers: Sequence[Layer],
        *, embed: Any, norm: Any, head: Any, bound_head: Any = None,
        bind: Callable[[Any], Any] | None = None,
        norm_bias: Any = None, head_bias: Any = None, positions: Any = None,
        reduce: Callable[[Any], Any] | None = None,
    ) -> None:  # fmt: skip
        self.config, self.bk, self.xp = config, bk, bk.xp
        self.dispatch = d = dispatcher(bk)
        self.layers = list(layers)
        self.embed_weight, self.norm_weight, self.head_weight = embed, norm, head
        self.norm_bias, self.head_bias, self.positions = norm_bias, head_bias, positions
        self.bind, self.reduce = bind, reduce
        self._head = head if bound_head is None else bound_head  # QLinear, Packed, the array
        #: Whether a weight is quantized (a compiled step takes them on JAX only).
        self.quantized = False
        #: The projections kept quantized (the LM head included), and the activations they
        #: take (``"float"`` or ``"int8"``): set by :func:`~portable_llm.decoder.prepared.prepare`.
        self.quantized_projections = 0
        self.activations = "float"
        self.kernels = kernels
        use_rope = config.position_embedding == "rope"
        rope_local = config.rope_local if use_rope else None
        scale = config.attn_scale  # Gemma: query_pre_attn_scalar ** -0.5
        self.setup = ForwardSetup(
            bk, bk.xp, d, kernels, rope=dict(config.rope) if use_rope else None,
            rope_local=None if rope_local is None else dict(rope_local),
            scale=1.0 / math.sqrt(config.head_dim) if scale is None else scale,
            softcap=config.attn_softcap, device=bk.device_of(norm),
            portable_rope=d.portable_impl("rope"),
        )  # fmt: skip
        #: The model's norms are LayerNorm (GPT-2, Phi-2), with biases; else RMSNorm.
        self.layer_norm = config.norm == "layer"
        self.eps = config.rms_norm_eps
        #: Gemma 3: the sliding layers, which take the RoPE of their own (``rope_local``).
        self.local_layers = frozenset(
            i for i, kind in enumerate(config.layer_types)
            if rope_local is not None and kind == "sliding_attention"
        )  # fmt: skip
        #: Every layer is RMSNorm, attention, RMSNorm, a dense MLP (Llama, Qwen, Mistral):
        #: :meth:`run_layers` then writes the two-line layer out, with no helper calls.
        #: The norms' scale ``offset + w`` formed per call in float32 (Qwen3-Next; 0: none, or
        #: formed at load).
        self.norm_offset = config.norm_offset if config.norm_offset_per_call else 0.0
        self.plain = (
            reduce is None
            and not self.layer_norm
            and not self.norm_offset
            and config.residual_multiplier == 1.0
            and all(
                not layer.parallel
                and type(layer.attn) is AttnWeights
                and layer.mixer is None
                and layer.mlp is not None
                and layer.attn_norm is None
                and layer.input_norm is not None
                and layer.post_norm is not None
                for layer in self.layers
            )
        )

    @property
    def bound_head(self) -> Any:
        """The LM head as bound at build: the weight, or a :class:`QLinear`/:class:`Packed` one
        with its kernel (a compiled step reuses its kernels)."""
        return self._head

    def with_layers(self, layers: Sequence[Layer]) -> Forward:
        """This forward over other layers of the same shapes (a compiled step's traced ones)."""
        other = copy.copy(self)
        other.layers = list(layers)
        return other

    # -- the forward ---------------------------------------------------------------------------
    def __call__(
        self, ids: Any, cache: Sequence[Any] | None, pad: Any, last_only: bool,
        top: tuple[Any, Any, Any] | None = None, check_ids: bool = True,
    ) -> Any:  # fmt: skip
        """Logits ``(B, L | 1, V)`` of ``ids`` ``(B, L)`` (already on the model's backend and
        device; ``pad`` checked by the model). ``top``: the model's ``(embed, norm, head)``
        as they are now (default: those of the build). ``check_ids=False``: the embedding does
        not read the ids back (a decode loop's own ids; out of range: NaN rows)."""
        embed, norm, head = top or (self.embed_weight, self.norm_weight, self.head_weight)
        state = self.state(cache, pad, ids.shape[1])
        h = self.embed(ids, state, embed, check=check_ids)  # (B, L, E)
        h = self.run_layers(h, state)
        if last_only:
            h = h[:, -1:, :]  # (B, 1, E)
        return self.head(h, state, norm, head)  # (B, L | 1, V)

    def state(self, cache: Sequence[Any] | None, pad: Any, L: int) -> DenseState:
        """The :class:`~portable_llm.decoder.states.DenseState` of a forward of ``L`` new
        tokens per row over ``cache`` (or, with none, rows left-padded by ``pad``)."""
        offset = 0
        if cache is not None:
            offset = cache[0].offset
            pad = cache[0].left_padding
            if pad is not None and backend_of(pad) is not self.bk:
                _, (pad,) = resolve("model", self.bk, pad)
        rows = None if pad is None else offset - pad  # (B,) RoPE offsets of a padded batch
        return DenseState(self.setup, cache, pad, rows, offset, L)

    def embed(self, ids: Any, state: ForwardState, weight: Any, *, check: bool = True) -> Any:
        """The hidden states ``(B, L, E)`` the first layer takes: the token embedding (the
        public op; ``check=False``: the ids are not read back), plus GPT-2's learned positions
        at the state's, times ``sqrt(E)`` for Gemma (rounded to the dtype, as HF's)."""
        xp = self.xp
        h = embedding(ids, weight, check=check)  # (B, L, E)
        if self.positions is not None:  # GPT-2: h = wte[ids] + wpe[positions]
            pos = position_ids(xp, state.positions(), state.L, creation_device(h))
            if self.bind is None:  # the public op (it casts another dtype's table)
                h = h + embedding(pos, self.positions)
            else:
                h = h + self.dispatch.pick("embedding", "masked")(xp, pos, self.positions)
        if self.config.embed_scale:  # Gemma: h * sqrt(E), in the model's dtype
            root = math.sqrt(self.config.hidden_size)
            h = h * xp.asarray(root, dtype=h.dtype, device=self.bk.device_of(h))
        if self.config.embedding_multiplier != 1.0:  # Granite
            h = times(xp, h, self.config.embedding_multiplier)
        return h

    def run_layers(self, h: Any, state: ForwardState, span: Sequence[int] | None = None) -> Any:
        """The decoder layers ``span`` (default: all) over ``h`` ``(B, L, E)``; ``state``
        holds what they share (layer ``i`` keeps its keys in the state's cache ``i``)."""
        xp, kn, layers = self.xp, state.kn, self.layers
        span = range(len(layers)) if span is None else span
        if not self.plain:
            local = state.local() if self.local_layers else state
            for i in span:
                h = self.layer(h, local if i in self.local_layers else state, i)
            return h
        # RMSNorm and a dense MLP in every layer (Llama, Qwen, Mistral): the equation, with no
        # call between the layer and its kernels and bodies (a decode step's Python overhead).
        eps = self.eps
        for i in span:
            layer = layers[i]
            r = kn.rms_norm(xp, h, layer.input_norm, eps=eps)
            h = h + attention_body(xp, kn, r, layer.attn, state, i)  # type: ignore[arg-type]
            r = kn.rms_norm(xp, h, layer.post_norm, eps=eps)
            h = h + mlp_body(xp, kn, r, layer.mlp)  # type: ignore[arg-type]  # plain: dense
        return h

    def layer(self, h: Any, state: ForwardState, i: int) -> Any:
        """Layer ``i`` over ``h`` ``(B, L, E)``: any recipe (LayerNorm, Phi-2's parallel
        block, Gemma's sandwich norms, OLMo 2's norms of the outputs only, Granite's residual
        multiplier, MoE, a recurrent token mixer beside or instead of attention, a
        tensor-parallel rank's all-reduce)."""
        xp, kn, layer = self.xp, state.kn, self.layers[i]
        scale = self.config.residual_multiplier  # Granite: each output times it
        r = self.normed(kn, h, layer.input_norm, layer.input_bias)
        a = self.token_mixers(kn, r, layer, state, i)
        if layer.parallel:  # Phi-2: HF's attn_outputs + feed_forward + residual
            return (a + self.feed_forward(kn, r, layer)) + h
        if layer.attn_norm is not None:  # Gemma's sandwich, OLMo 2: the output normed
            a = self.normed(kn, a, layer.attn_norm, None)
        h = h + (a if scale == 1.0 else times(xp, a, scale))
        r = self.normed(kn, h, layer.post_norm, layer.post_bias)
        m = self.feed_forward(kn, r, layer)
        if layer.ff_norm is not None:
            m = self.normed(kn, m, layer.ff_norm, None)
        return h + (m if scale == 1.0 else times(xp, m, scale))

    def token_mixers(self, kn: KernelSet, r: Any, layer: Layer, state: ForwardState, i: int) -> Any:
        """The token mixers of layer ``i`` over its normed input ``r`` ``(B, L, E)``: the
        attention (DeepSeek V3's: the latent attention over its latent cache), the recurrent
        mixer (its state in the layer's recurrent cache,
        :func:`~portable_llm.decoder.mixer.run_mixer`), or both added (Falcon-H1)."""
        xp = self.xp
        a = None
        if isinstance(layer.attn, LatentWeights):  # DeepSeek V3: over its latent cache
            a = latent_attention_body(xp, kn, r, layer.attn, state, i)
        elif layer.attn is not None:
            a = attention_body(xp, kn, r, layer.attn, state, i)
        if a is not None:
            if self.reduce is not None:  # a tensor-parallel rank: the partial sums added
                a = self.reduce(a)
            if layer.o_bias is not None:  # o_proj's bias, after the sum (counted once)
                a = a + layer.o_bias
        if layer.mixer is not None:
            m = run_mixer(layer.mixer, xp, kn, r, state.recurrent(i), state.pads())
            a = m if a is None else a + m
        return a

    def normed(self, kn: KernelSet, h: Any, w: Any, b: Any) -> Any:
        """The model's norm of ``h``: LayerNorm (weight and bias) or RMSNorm; no weight, no
        norm (OLMo 2's sublayers take ``h`` itself)."""
        if w is None:
            return h
        if self.layer_norm:
            return kn.layer_norm(self.xp, h, w, b, eps=self.eps)
        if self.norm_offset:  # Qwen3-Next: HF's order, (offset + w) applied in float32
            return offset_rms_norm(self.xp, kn, h, w, eps=self.eps, offset=self.norm_offset)
        return kn.rms_norm(self.xp, h, w, eps=self.eps)

    def feed_forward(self, kn: KernelSet, r: Any, layer: Layer) -> Any:
        """The layer's dense MLP or mixture of experts (a tensor-parallel rank's completed by
        the all-reduce)."""
        if layer.mlp is not None:
            m = mlp_body(self.xp, kn, r, layer.mlp)
        else:
            assert layer.moe is not None
            m = layer.moe(r)
        return m if self.reduce is None else self.reduce(m)

    def head(self, h: Any, state: ForwardState, norm: Any, head: Any) -> Any:
        """The final norm, the LM head and Gemma 2's final soft-capping: ``(B, L, E)`` ->
        ``(B, L, V)``. ``head``: the weight (another than the build's is bound here)."""
        kn = state.kn
        if head is self.head_weight:
            head = self._head
        elif self.bind is not None and isinstance(head, QuantizedWeight):
            head = self.bind(head)  # another head than the one bound at build
        h = self.normed(kn, h, norm, self.norm_bias)
        if kn.bound and type(head) in BOUND_PROJECTIONS:  # its own kernel (another head too)
            logits = head(self.xp, h, self.head_bias)  # (B, L, V)
        else:
            logits = kn.project(self.xp, h, head, self.head_bias)  # (B, L, V)
        if self.config.logit_scale != 1.0:  # Granite, Cohere 2
            logits = times(self.xp, logits, self.config.logit_scale)
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), HF's order
            xp = self.xp
            c = xp.asarray(cap, dtype=logits.dtype, device=self.bk.device_of(logits))
            logits = xp.tanh(logits / c) * c
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
