"""The decoder: embedding, N blocks (RMSNorm, attention, RMSNorm, MLP or MoE), norm, LM head.

Each block is a few calls of the public ops, with the weights of the layer bound once at load
time (:class:`Block`); the forward pass resolves nothing per layer beyond what the ops do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_llm.attn.block import attention
from portable_llm.backends import Backend, backend_of
from portable_llm.caches.check import check_caches
from portable_llm.caches.kv import KVCache, RotatingKVCache
from portable_llm.caches.page_pool import PagePool
from portable_llm.core.arrays import asarray, creation_device, to_numpy
from portable_llm.core.checks import check_int
from portable_llm.decoder.compiled import CompiledStep, compiled_step
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.paged_step import forward as paged_forward
from portable_llm.decoder.prepared import (
    Prepared,
    check_learned_positions,
    position_ids,
    preparable,
)
from portable_llm.ops.activations import activation
from portable_llm.ops.embedding import embedding, unembed
from portable_llm.ops.linear import linear, mlp
from portable_llm.ops.moe import moe
from portable_llm.ops.norm import layer_norm, rms_norm
from portable_llm.ops.quant import projection_op

__all__ = ["Block", "Model"]


@dataclass(frozen=True)
class Block:
    """One decoder layer's weights, bound as the keyword arguments of the ops it calls."""

    input_norm: Any  # (E,)
    post_norm: Any  # (E,), or None (parallel)
    attn: dict[str, Any]  # keyword arguments of portable_llm.attn.block
    o_bias: Any  # (E,) or None
    mlp: tuple[Any, ...] | None  # (w_gate, w_up, w_down) of a dense layer; w_gate may be None
    mlp_options: dict[str, Any]  # act and biases: keyword arguments of portable_llm.mlp
    moe: dict[str, Any] | None  # arrays and keyword arguments of portable_llm.ops.moe
    input_bias: Any = None  # (E,): LayerNorm's bias (GPT-2, Phi-2)
    post_bias: Any = None  # (E,)
    parallel: bool = False  # Phi-2: h + attention(norm(h)) + mlp(norm(h))
    layer_norm: bool = False  # the norms are LayerNorm (with input_bias, post_bias)
    attn_norm: Any = None  # (E,): Gemma's norm of the attention output (sandwich norms)
    ff_norm: Any = None  # (E,): Gemma's norm of the MLP output

    def norm(self, h: Any, w: Any, b: Any, eps: float) -> Any:
        if self.layer_norm:
            return layer_norm(h, w, b, eps=eps)
        return rms_norm(h, w, eps=eps)

    def __call__(
        self,
        h: Any,
        *,
        cache: Any,
        left_padding: Any,
        eps: float,
        reduce: Callable[[Any], Any] | None = None,
    ) -> Any:
        """The layer on hidden states ``h`` ``(B, L, E)``. ``reduce``: on a tensor-parallel
        rank (:mod:`portable_llm.partition`), the all-reduce that completes its partial
        sums, applied to the attention's and the feed-forward's outputs before their biases
        and norms; ``None`` on one device."""
        r = self.norm(h, self.input_norm, self.input_bias, eps)
        a = attention(r, **self.attn, cache=cache, left_padding=left_padding)
        if reduce is not None:
            a = reduce(a)
        if self.o_bias is not None:  # HF's o_proj bias (Llama/Qwen3 attention_bias)
            a = a + self.o_bias
        if self.parallel:  # HF PhiDecoderLayer: attn_outputs + feed_forward + residual
            return (a + self._feed_forward(r, reduce)) + h
        if self.attn_norm is not None:  # Gemma's sandwich: the output normed before the sum
            a = self.norm(a, self.attn_norm, None, eps)
        h = h + a
        r = self.norm(h, self.post_norm, self.post_bias, eps)
        m = self._feed_forward(r, reduce)
        if self.ff_norm is not None:
            m = self.norm(m, self.ff_norm, None, eps)
        return h + m

    def _feed_forward(self, r: Any, reduce: Callable[[Any], Any] | None = None) -> Any:
        m = self._partial_feed_forward(r)
        return m if reduce is None else reduce(m)

    def _partial_feed_forward(self, r: Any) -> Any:
        if self.moe is not None:
            return moe(r, *self.moe["arrays"], **self.moe["options"])
        assert self.mlp is not None
        w_gate, w_up, w_down = self.mlp
        if w_gate is None:  # the plain MLP: down(act(up(r))), HF's order of roundings
            up = linear(r, w_up, self.mlp_options["b_up"])
            act = activation(self.mlp_options["act"])(up)
            return linear(act, w_down, self.mlp_options["b_down"])
        return mlp(r, *self.mlp, **self.mlp_options)


def _block(cfg: DecoderConfig, w: dict[str, Any], i: int) -> Block:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    attn = {
        "wq": w[a + "q_proj.weight"],
        "wk": w[a + "k_proj.weight"],
        "wv": w[a + "v_proj.weight"],
        "wo": w[a + "o_proj.weight"],
        "bq": w.get(a + "q_proj.bias"),
        "bk": w.get(a + "k_proj.bias"),
        "bv": w.get(a + "v_proj.bias"),
        "q_norm": w.get(a + "q_norm.weight"),
        "k_norm": w.get(a + "k_norm.weight"),
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "norm_eps": cfg.rms_norm_eps,
        "rope": _layer_rope(cfg, i),
        "window": cfg.window(i),
        "scale": cfg.attn_scale,  # Gemma: query_pre_attn_scalar ** -0.5
        "softcap": cfg.attn_softcap,
        **_llama4_attention(cfg, i),
    }
    m = p + "mlp."
    dense = moe_args = None
    mlp_options: dict[str, Any] = {"act": cfg.hidden_act}
    if cfg.moe_layers[i]:
        options: dict[str, Any] = {
            "top_k": cfg.num_experts_per_tok,
            "norm_topk_prob": cfg.norm_topk_prob,
            "router": cfg.router,  # Llama 4: "sigmoid", the scores scale the experts' inputs
            "act": cfg.hidden_act,
        }
        s = m + "shared_expert."
        if s + "gate_proj.weight" in w:  # Qwen2-MoE (gated by shared_expert_gate), Llama 4
            options["shared"] = tuple(w[f"{s}{k}_proj.weight"] for k in ("gate", "up", "down"))
        if m + "shared_expert_gate.weight" in w:  # Qwen2-MoE
            options["shared_gate"] = w[m + "shared_expert_gate.weight"]
        arrays = (
            w[m + "gate.weight"],
            *(w[f"{m}experts.{k}_proj"] for k in ("gate", "up", "down")),
        )
        moe_args = {"arrays": arrays, "options": options}
    else:
        dense = tuple(w.get(f"{m}{k}_proj.weight") for k in ("gate", "up", "down"))
        mlp_options.update({f"b_{k}": w.get(f"{m}{k}_proj.bias") for k in ("gate", "up", "down")})
    sandwich = cfg.sandwich_norms  # Gemma: post_attention_layernorm norms attention's output
    post = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    return Block(
        input_norm=w[p + "input_layernorm.weight"],
        post_norm=w.get(p + post + ".weight"),
        attn_norm=w.get(p + "post_attention_layernorm.weight") if sandwich else None,
        ff_norm=w.get(p + "post_feedforward_layernorm.weight") if sandwich else None,
        attn=attn,
        o_bias=w.get(a + "o_proj.bias"),
        mlp=dense,
        mlp_options=mlp_options,
        moe=moe_args,
        input_bias=w.get(p + "input_layernorm.bias"),
        post_bias=w.get(p + "post_attention_layernorm.bias"),
        parallel=cfg.parallel_block,
        layer_norm=cfg.norm == "layer",
    )


class Model:
    """A loaded decoder: call it on token ids to get logits.

    Build one with :func:`portable_llm.load`. ``model(ids)`` runs the full causal forward;
    ``model(ids, cache=cache)`` runs ``L`` new tokens after those the caches hold
    (:meth:`make_cache`): prefill is the prompt at once, decode one token at a time.
    ``tokenizer`` (:class:`~portable_llm.models.Tokenizer`) and ``generation_config`` (a dict)
    come from the folder when it has them.

    ``prepared`` (default ``True``): when every weight is a plain array of the model's backend
    and dtype, or a :class:`~portable_llm.QuantizedWeight` of that backend (projections,
    embedding, LM head), the forward is the prepared one (:mod:`portable_llm.decoder.prepared`:
    weights bound into typed records, kernels chosen once, the mask and RoPE table built once
    per forward); ``False``, or a mixed-dtype float weight, composes the public ops layer by
    layer (:attr:`prepared` is then ``None``). Both give the same logits, bit for bit.

    ``activations`` (default ``"float"``): ``"int8"`` multiplies every quantized projection's
    codes by its input rounded to 8-bit blocks (``quantized_linear_int8``: llama.cpp's way,
    judged by KL divergence, :doc:`gguf`); it needs the prepared forward and at least one
    quantized projection (else a ValueError). Float weights are multiplied as they are.
    """

    def __init__(
        self,
        config: DecoderConfig,
        weights: dict[str, Any],
        backend: Backend,
        *,
        tokenizer: Any = None,
        generation_config: dict[str, Any] | None = None,
        prepared: bool = True,
        compile: bool = True,
        activations: str = "float",
    ) -> None:
        projection_op(activations, "model")  # the name checked before any weight is bound
        self.config = config
        self.backend = backend
        if config.norm_offset:  # Gemma's norms scale by 1 + w: the scale formed once, here
            off = config.norm_offset
            weights = {k: _offset_norm(backend, k, w, off) for k, w in weights.items()}
        self.embed = weights["model.embed_tokens.weight"]  # (V, E)
        self.dtype = self.embed.dtype
        #: Where the weights live (:func:`portable_llm.load`'s ``device``); inputs go there.
        self.device = backend.device_of(self.embed)
        self.norm = weights["model.norm.weight"]  # (E,)
        self.norm_bias = weights.get("model.norm.bias")  # (E,): a final LayerNorm's bias
        self.lm_head = weights.get("lm_head.weight")  # (V, E); None when tied
        self.head_bias = weights.get("lm_head.bias")  # (V,): Phi-2's
        #: Learned absolute position embeddings ``(P, E)`` (GPT-2's ``wpe``), or ``None``.
        self.positions = weights.get("model.embed_positions.weight")
        self.blocks = [_block(config, weights, i) for i in range(config.num_hidden_layers)]
        self.tokenizer = tokenizer
        self.generation_config = dict(generation_config or {})
        #: The prepared forward (:mod:`portable_llm.decoder.prepared`): built when ``prepared``
        #: and every weight is a plain array of the model's backend and dtype (or a quantized
        #: weight of that backend); ``None`` runs the op-by-op path (the public ops, each
        #: checking its arguments).
        self.prepared: Prepared | None = None
        if prepared and preparable(backend, self.dtype, self._top_arrays(), self.blocks):
            self.prepared = Prepared(
                config, backend, self.dtype, self.embed, self.norm, self.lm_head, self.blocks,
                norm_bias=self.norm_bias, head_bias=self.head_bias, positions=self.positions,
                activations=activations,
            )  # fmt: skip
        #: The activations of the quantized projections: ``"float"`` or ``"int8"``.
        self.activations = activations
        if activations == "int8":
            _check_int8(self.prepared)
        #: The compiled decode step (:mod:`portable_llm.decoder.compiled`; JAX, and MLX for
        #: float weights), run by a call with one token per row and caches that hold the
        #: prompt; ``None`` elsewhere.
        self.compiled: CompiledStep | None = None
        if compile and self.prepared is not None:
            self.compiled = compiled_step(self.prepared)

    @property
    def quantized_projections(self) -> int:
        """How many projections (the LM head included) the prepared forward binds quantized:
        those that :attr:`activations` rules (0 without a prepared forward)."""
        return 0 if self.prepared is None else self.prepared.quantized_projections

    def _top_arrays(self) -> list[Any]:
        top = (self.embed, self.norm, self.lm_head, self.norm_bias, self.head_bias, self.positions)
        return [a for a in top if a is not None]

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({c.model_type}, layers={c.num_hidden_layers}, E={c.hidden_size}, "
            f"H={c.num_attention_heads}, H_kv={c.num_key_value_heads}, V={c.vocab_size}, "
            f"backend={self.backend.name!r}, dtype={self.backend.dtype_name(self.dtype)}"
            + (", activations='int8')" if self.activations == "int8" else ")")
        )

    def __call__(
        self,
        ids: Any,
        /,
        *,
        cache: Sequence[Any] | None = None,
        left_padding: Any = None,
        last_only: bool = False,
    ) -> Any:
        """Logits of the next token at every position.

        Parameters
        ----------
        ids : integer array of any backend, or nested list, shape ``(B, L)``
            Converted to the model's backend and moved to its :attr:`device` when elsewhere.
        cache : list of caches, one per layer, optional
            From :meth:`make_cache`: the ``L`` tokens follow those the caches hold, and their
            keys and values are added to them.
        left_padding : integer array, shape ``(B,)``, optional
            Without a cache: the pad tokens at the start of each row
            (:func:`~portable_llm.left_pad`), masked out, with row ``b``'s positions starting
            at ``-left_padding[b]``; each count in ``[0, L]``. With a cache, give it to
            :meth:`make_cache` instead.
        last_only : bool
            Only the logits of the last position (``L = 1`` in the result): what decoding needs,
            without the ``(B, L, V)`` head over the whole prompt.

        Returns
        -------
        array, shape ``(B, L, V)`` (``(B, 1, V)`` with ``last_only``), the model's dtype
        """
        bk = self.backend
        if backend_of(ids) is not bk or bk.device_of(ids) != self.device:
            ids = asarray(ids, backend=bk.name, device=self.device)
        if ids.ndim != 2:
            raise ValueError(f"model: ids must have shape (B, L), got {tuple(ids.shape)}")
        if cache is not None:
            if len(cache) != len(self.blocks):
                raise ValueError(
                    f"model: cache must hold one cache per layer ({len(self.blocks)}), "
                    f"got {len(cache)}"
                )
            if left_padding is not None:
                raise ValueError("model: with a cache, give left_padding to make_cache()")
            self._check_caches(ids, cache)
        elif left_padding is not None:
            host = _check_left_padding(left_padding, tuple(ids.shape))
            if backend_of(left_padding) is not bk or bk.device_of(left_padding) != self.device:
                left_padding = asarray(host, backend=bk.name, device=self.device)
        offset = 0 if cache is None else cache[0].offset
        check_learned_positions("model", self.config, offset, ids.shape[1])
        if self.prepared is not None:
            return self._prepared(ids, cache, left_padding, last_only, check_ids=True)
        eps = self.config.rms_norm_eps
        h = self.embed_ids(ids, cache=cache, left_padding=left_padding)  # (B, L, E)
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache[i]
            h = block(h, cache=layer_cache, left_padding=left_padding, eps=eps)
        return self.project(h, last_only=last_only)  # (B, L, V)

    def embed_ids(self, ids: Any, /, *, cache: Any = None, left_padding: Any = None) -> Any:
        """The hidden states ``(B, L, E)`` the first layer takes: the token embedding (times
        ``sqrt(E)`` for Gemma), plus GPT-2's learned positions at the caches' offset. The
        op-by-op forward's first step, and a pipeline's first stage
        (:mod:`portable_llm.partition`); ``ids`` on the model's backend and device."""
        bk = self.backend
        h = embedding(ids, self.embed)  # (B, L, E)
        if self.config.embed_scale:  # Gemma: h * sqrt(E), rounded to the dtype as HF's
            root = math.sqrt(self.config.hidden_size)
            h = h * bk.xp.asarray(root, dtype=h.dtype, device=bk.device_of(h))
        if self.positions is not None:  # GPT-2: h = wte[ids] + wpe[positions]
            start, pad = (0, left_padding) if cache is None else (
                cache[0].offset, cache[0].left_padding
            )  # fmt: skip
            if pad is not None:
                start = start - asarray(pad, backend=bk.name, device=self.device)  # (B,)
            pos = position_ids(bk.xp, start, ids.shape[1], creation_device(h))
            h = h + embedding(pos, self.positions)
        return h

    def project(self, h: Any, /, *, last_only: bool = False) -> Any:
        """Logits ``(B, L, V)`` (``(B, 1, V)`` with ``last_only``) of the last layer's hidden
        states: the final norm, the LM head (tied or not) and Gemma 2's soft-capping. The
        op-by-op forward's last step, and a pipeline's last stage."""
        bk, eps = self.backend, self.config.rms_norm_eps
        if last_only:
            h = h[:, -1:, :]  # (B, 1, E)
        if self.config.norm == "layer":
            h = layer_norm(h, self.norm, self.norm_bias, eps=eps)
        else:
            h = rms_norm(h, self.norm, eps=eps)
        if self.lm_head is None:
            logits = unembed(h, self.embed)  # (B, L, V)
        else:
            logits = linear(h, self.lm_head, self.head_bias)  # (B, L, V)
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            c = bk.xp.asarray(cap, dtype=logits.dtype, device=bk.device_of(logits))
            logits = bk.xp.tanh(logits / c) * c
        return logits

    def _prepared(
        self, ids: Any, cache: Any, left_padding: Any, last_only: bool, *, check_ids: bool
    ) -> Any:
        """The compiled step where it applies, else the prepared forward."""
        assert self.prepared is not None
        head = self.embed if self.lm_head is None else self.lm_head
        top = (self.embed, self.norm, head)
        if self.compiled is not None and self.compiled.applies(ids, cache):
            return self.compiled(ids, cache, top)
        return self.prepared(ids, cache, left_padding, last_only, top, check_ids=check_ids)

    def decode_step(self, ids: Any, /, *, cache: Sequence[Any]) -> Any:
        """Logits ``(B, 1, V)`` of one new token per row after what ``cache`` holds.

        ``ids`` ``(B, 1)``: an integer array of the model's backend on its device, as a
        sampler gives them. ``model(ids, cache=cache, last_only=True)``, without the host read
        of the ids' range check: an id outside ``[0, V)`` gives NaN logits, not a ValueError,
        and nothing waits for the device, so a lazy backend (MLX) can queue the next step
        before this one ran. Runs the compiled step (:attr:`compiled`) where there is one, the
        prepared forward elsewhere; other ids (a list, another backend) go through ``model``.
        """
        bk = self.backend
        if (
            self.prepared is None
            or backend_of(ids) is not bk
            or bk.device_of(ids) != self.device
            or ids.ndim != 2
            or len(cache) != len(self.blocks)
        ):
            return self(ids, cache=cache, last_only=True)
        self._check_caches(ids, cache)
        check_learned_positions("model", self.config, cache[0].offset, ids.shape[1])
        return self._prepared(ids, cache, None, True, check_ids=False)

    def _check_caches(self, ids: Any, cache: Sequence[Any]) -> None:
        """Every layer's cache takes the keys ``(B, H_kv, L, D)`` of ``ids`` before the first
        layer writes to any (:func:`~portable_llm.caches.check.check_caches`): a refused
        update leaves every cache as it was."""
        c = self.config
        shape = (ids.shape[0], c.num_key_value_heads, ids.shape[1], c.head_dim)
        check_caches("model", cache, backend=self.backend, shape=shape, dtype=self.dtype)

    # -- what generation needs (portable_llm.generation.protocol) -------------------------------
    @property
    def vocab_size(self) -> int:
        """``V``: the config's ``vocab_size``."""
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The default stop ids: ``generation_config.json``'s ``eos_token_id``, else
        ``config.json``'s."""
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            return tuple(self.config.eos_token_id)
        return tuple(int(i) for i in eos) if isinstance(eos, list | tuple) else (int(eos),)

    @property
    def max_seq_len(self) -> int | None:
        """The config's ``max_position_embeddings`` (``None`` when it has none)."""
        return self.config.max_position_embeddings

    @property
    def recompute_after(self) -> int | None:
        """``original_max_position_embeddings`` of a ``longrope`` RoPE (Phi-3), else ``None``:
        when a generated sequence first grows past it, :func:`~portable_llm.generate` runs
        every token again with the long factors, as transformers' Phi-3 generation does
        (:class:`~portable_llm.generation.protocol.RecomputingModel`)."""
        rope = self.config.rope if self.config.position_embedding == "rope" else None
        scaling = (rope or {}).get("scaling") or {}
        if scaling.get("rope_type") != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])

    def make_page_pools(self, num_pages: int, page_size: int) -> list[PagePool]:
        """One empty :class:`~portable_llm.PagePool` per layer: ``num_pages`` pages of
        ``page_size`` tokens, ``(H_kv, D)`` heads, the model's dtype, backend and device."""
        cfg = self.config
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        where = {"backend": self.backend.name, "device": self.device}
        return [PagePool(*shape, self.dtype, **where) for _ in range(cfg.num_hidden_layers)]

    def forward_paged(
        self,
        ids: Sequence[Sequence[int]],
        /,
        *,
        caches: Sequence[Sequence[Any]],
        logits: bool = True,
    ) -> Any:
        """Logits ``(B, V)`` of the last position of each row after its tokens ``ids[b]`` (one
        length ``L`` for all rows), over paged caches: ``caches[b]`` is row ``b``'s
        :class:`~portable_llm.PagedKVCache` per layer (over :meth:`make_page_pools`' pools).
        ``logits=False``: only fill the caches; returns ``None``. See
        :func:`portable_llm.decoder.paged_step.forward`."""
        return paged_forward(self, caches, [list(row) for row in ids], logits=logits)

    def make_cache(self, *, left_padding: Any = None, step: int = 256) -> list[Any]:
        """One KV cache per layer: a :class:`~portable_llm.KVCache`, or for a sliding-window
        layer a :class:`~portable_llm.RotatingKVCache` of the window's size.

        On a backend that compiles per shape (:attr:`Backend.static_shapes
        <portable_llm.backends.Backend.static_shapes>`, JAX), and wherever the model has a
        compiled step (:attr:`compiled`: MLX too), each ``KVCache`` returns fixed-size views
        (``static_shapes=True``), so decode steps reuse the compiled program; the model attends
        with the caches' own masks, which hide the unused slots.

        ``left_padding`` (``(B,)``): the pad tokens of each row of a left-padded batch
        (:func:`~portable_llm.left_pad`).
        """
        # Fixed-size views where shapes compile (JAX) and where a compiled step runs (MLX).
        static = self.backend.static_shapes or self.compiled is not None
        caches: list[Any] = []
        for i in range(self.config.num_hidden_layers):
            window = self.config.window(i)
            if window is None:
                caches.append(KVCache(step=step, left_padding=left_padding, static_shapes=static))
            else:
                caches.append(RotatingKVCache(window, step=step, left_padding=left_padding))
        return caches


def _check_int8(prepared: Prepared | None) -> None:
    """A model of ``activations="int8"`` runs the prepared forward (where its quantized
    projections are bound to ``quantized_linear_int8``) and has at least one of them."""
    if prepared is None:
        raise ValueError(
            "model: activations='int8' runs in the prepared forward, which this model does not "
            "have (prepared=False, or weights of mixed dtypes or backends)"
        )
    if prepared.quantized_projections == 0:
        raise ValueError(
            "model: activations='int8' multiplies quantized weights' codes, and this model has "
            "no quantized projection (a float checkpoint, or loaded with dequantize=True)"
        )


def _llama4_attention(cfg: DecoderConfig, i: int) -> dict[str, Any]:
    """Layer ``i``'s options of Llama 4's attention (HF ``Llama4TextAttention``): the chunk of a
    ``chunked_attention`` layer; the weightless q/k norm on RoPE layers (``use_qk_norm``); the
    temperature tuning on the no-RoPE ones (``attn_temperature_tuning``)."""
    chunked = cfg.layer_types[i] == "chunked_attention" and cfg.attention_chunk_size
    no_rope = bool(cfg.no_rope_layers) and cfg.no_rope_layers[i]
    tuned = no_rope and cfg.attn_temperature_tuning
    return {
        "chunk": cfg.attention_chunk_size if chunked else None,
        "qk_l2_norm": cfg.qk_l2_norm and not no_rope,
        "temperature": (cfg.floor_scale, cfg.attn_temperature_scale) if tuned else None,
    }


def _layer_rope(cfg: DecoderConfig, i: int) -> Any:
    """Layer ``i``'s RoPE options: none (learned positions, Llama 4's no-RoPE layers), Gemma
    3's ``rope_local`` on its sliding layers, else the model's."""
    if cfg.position_embedding != "rope" or (cfg.no_rope_layers and cfg.no_rope_layers[i]):
        return None
    if cfg.rope_local is not None and cfg.layer_types[i] == "sliding_attention":
        return cfg.rope_local
    return cfg.rope


def _offset_norm(bk: Backend, name: str, w: Any, offset: float) -> Any:
    """A norm weight ``w`` as its scale ``offset + w`` (Gemma's ``1 + w``; mlx-lm forms it so
    too): the same products as HF's float32 order in a float32 model; in bfloat16 the scale is
    rounded once to bfloat16. Other weights as they are."""
    if name.endswith(("layernorm.weight", "norm.weight")):
        return w + bk.xp.asarray(offset, dtype=w.dtype, device=bk.device_of(w))
    return w


def _check_left_padding(left_padding: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Pad counts of a full forward: one int in ``[0, L]`` per row of ``ids`` ``(B, L)``; the
    counts on the host."""
    B, L = shape
    host = np.asarray(to_numpy(left_padding) if backend_of(left_padding) else left_padding)
    if host.shape != (B,) or host.dtype.kind not in "iu":
        raise ValueError(
            f"model: left_padding must be an integer array of shape (B,) = ({B},) for ids of "
            f"shape {shape}, got {host.dtype} with shape {host.shape}"
        )
    for b, pad in enumerate(host):
        check_int("model", f"left_padding[{b}] (ids of shape {shape})", pad, low=0, high=L)
    return host
