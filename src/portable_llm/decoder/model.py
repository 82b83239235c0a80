"""The decoder: embedding, N layers (norm, attention, norm, MLP or MoE), norm, LM head.

A :class:`Model` reads one :class:`~portable_llm.decoder.layer_weights.Layer` per layer from
the checkpoint (its family's recipe: :mod:`portable_llm.decoder.families`) and runs them with one
forward (:class:`~portable_llm.decoder.forward.Forward`): prepared (kernels chosen once) where
its weights allow, else op by op (the public ops, each checking its arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_llm.backends import Backend, backend_of
from portable_llm.caches.check import check_caches
from portable_llm.caches.hybrid import HybridCache
from portable_llm.caches.kv import KVCache, RotatingKVCache
from portable_llm.caches.page_pool import PagePool
from portable_llm.caches.recurrent import RecurrentCache, RecurrentSlots
from portable_llm.core.arrays import asarray, to_numpy
from portable_llm.core.checks import check_int
from portable_llm.decoder.compiled import CompiledDecode, compile_decode, unavailable
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.families import layer_reader
from portable_llm.decoder.forward import Forward, check_learned_positions, head_weight
from portable_llm.decoder.layer_weights import Layer
from portable_llm.decoder.paged_step import forward as paged_forward
from portable_llm.decoder.prepared import op_by_op, preparable, prepare
from portable_llm.ops.quant import projection_op

__all__ = ["Model"]


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

    ``compile`` (default ``"auto"``): the compiled decode step (:attr:`compiled`) where the
    backend's is on by default (JAX, MLX); ``True`` also where it is asked for (torch on the
    CPU: ``make_fx`` and inductor, which needs a C++ compiler; without one the prepared forward
    runs and :attr:`compile_note` says why); ``False``: none.
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
        compile: bool | str = "auto",
        activations: str = "float",
    ) -> None:
        projection_op(activations, "model")  # the name checked before any weight is bound
        self.config = config
        self.backend = backend
        if config.norm_offset and not config.norm_offset_per_call:  # Gemma's norms scale by
            # 1 + w: the scale formed once, here (Qwen3-Next's: per call, in float32)
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
        #: One record per layer, as read from the checkpoint.
        read = layer_reader(config.model_type)  # decoder/families/: the family's recipe
        self.layers: list[Layer] = [
            read(config, weights, i) for i in range(config.num_hidden_layers)
        ]
        self.tokenizer = tokenizer
        self.generation_config = dict(generation_config or {})
        top = {
            "embed": self.embed, "norm": self.norm, "head": head_weight(self.embed, self.lm_head),
            "norm_bias": self.norm_bias, "head_bias": self.head_bias, "positions": self.positions,
        }  # fmt: skip
        #: The op-by-op forward: the public ops, each checking its arguments (and casting a
        #: weight of another float dtype); what runs when :attr:`prepared` is ``None``.
        self.op_by_op: Forward = op_by_op(config, backend, self.layers, **top)
        #: The prepared forward (:func:`~portable_llm.decoder.prepared.prepare`): built when
        #: ``prepared`` and every weight is a plain array of the model's backend and dtype (or
        #: a quantized weight of that backend); ``None`` runs :attr:`op_by_op`.
        self.prepared: Forward | None = None
        if prepared and preparable(backend, self.dtype, self._top_arrays(), self.layers):
            self.prepared = prepare(
                config, backend, self.dtype, self.layers, **top, activations=activations
            )
        #: The activations of the quantized projections: ``"float"`` or ``"int8"``.
        self.activations = activations
        if activations == "int8":
            _check_int8(self.prepared)
        #: The compiled decode step (:mod:`portable_llm.decoder.compiled`; JAX, and MLX for
        #: float weights), run by a call with one token per row and caches that hold the
        #: prompt; ``None`` elsewhere.
        self.compiled: CompiledDecode | None = None
        #: Why a compiled step that was asked for does not run (``None`` when it runs or was
        #: not asked for): printed beside the decode speed.
        self.compile_note: str | None = None
        if not (isinstance(compile, bool) or compile == "auto"):
            raise ValueError(f"model: compile must be True, False or 'auto', got {compile!r}")
        if compile is not False and self.prepared is not None:
            self.compiled = compile_decode(self.prepared, opt_in=compile is True)
            if compile is True and self.compiled is None:
                self.compile_note = unavailable(self.prepared) or "no compiled step for this model"

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
            if len(cache) != len(self.layers):
                raise ValueError(
                    f"model: cache must hold one cache per layer ({len(self.layers)}), "
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
        return self.op_by_op(ids, cache, left_padding, last_only, self._top())  # (B, L, V)

    def _top(self) -> tuple[Any, Any, Any]:
        """``(embed, norm, head)`` as they are now (the head: the embedding when tied)."""
        return self.embed, self.norm, head_weight(self.embed, self.lm_head)

    def _prepared(
        self, ids: Any, cache: Any, left_padding: Any, last_only: bool, *, check_ids: bool
    ) -> Any:
        """The compiled step where it applies, else the prepared forward."""
        assert self.prepared is not None
        top = self._top()
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
            or len(cache) != len(self.layers)
        ):
            return self(ids, cache=cache, last_only=True)
        self._check_caches(ids, cache)
        check_learned_positions("model", self.config, cache[0].offset, ids.shape[1])
        return self._prepared(ids, cache, None, True, check_ids=False)

    def _check_caches(self, ids: Any, cache: Sequence[Any]) -> None:
        """Every layer's cache takes the keys ``(B, H_kv, L, D)`` of ``ids`` before the first
        layer writes to any (:func:`~portable_llm.caches.check.check_caches`): a refused
        update leaves every cache as it was."""
        B, L, c = ids.shape[0], ids.shape[1], self.config
        dims = [c.cache_dims(i) for i in range(len(cache))]
        shape = [(B, H, L, D) for H, D in dims]  # (B, H_kv, L, D) per layer
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

    @property
    def paged(self) -> bool:
        """Whether :meth:`forward_paged` runs this model: a model of attention layers, or a
        hybrid one whose recurrent mixers state their state's shapes
        (:meth:`~portable_llm.decoder.mixer.RecurrentMixer.state_shapes`: its rows' states
        then live in :meth:`make_state_slots`) and that has a prepared forward. ``False``:
        :class:`~portable_llm.BatchGenerator` runs it request by request, each over its own
        :meth:`make_cache` (:func:`~portable_llm.generation.protocol.check_paged_model`)."""
        mixers = [layer.mixer for layer in self.layers if layer.mixer is not None]
        if not mixers:
            return True
        return self.prepared is not None and all(m.state_shapes() is not None for m in mixers)

    @property
    def recurrent(self) -> bool:
        """Whether a layer has a recurrent token mixer (a hybrid model: LFM2, Qwen3-Next,
        Falcon-H1)."""
        return any(layer.mixer is not None for layer in self.layers)

    def make_page_pools(self, num_pages: int, page_size: int) -> list[PagePool]:
        """One empty :class:`~portable_llm.PagePool` per layer: ``num_pages`` pages of
        ``page_size`` tokens, ``(H_kv, D)`` heads (a latent layer's: ``(1, R + d_r)``,
        :meth:`~portable_llm.decoder.config.DecoderConfig.cache_dims`), the model's dtype,
        backend and device.

        A layer without attention (a recurrent mixer's alone) gets a pool of one head of one
        feature, whose pages hold nothing the forward reads: its caches keep the sequence's
        page ids and offset in step with the other layers' (as the batch generator and the
        prefix cache expect of every layer), for a few bytes per token. Its state lives in
        :meth:`make_state_slots`."""
        cfg = self.config
        where = {"backend": self.backend.name, "device": self.device}
        return [
            PagePool(num_pages, page_size, *(
                cfg.cache_dims(i, paged=True) if layer.attn is not None else (1, 1)
            ), self.dtype, **where)
            for i, layer in enumerate(self.layers)
        ]  # fmt: skip

    def make_state_slots(self, num_slots: int) -> list[RecurrentSlots | None]:
        """Per layer, the :class:`~portable_llm.RecurrentSlots` of a paged batch's rows
        (``num_slots`` to start with; float32, on the model's backend): ``None`` for a layer
        without a recurrent mixer. :class:`~portable_llm.BatchGenerator` gives each request a
        slot and :meth:`forward_paged` the rows' slots."""
        out: list[RecurrentSlots | None] = []
        for layer in self.layers:
            shapes = None if layer.mixer is None else layer.mixer.state_shapes()
            if layer.mixer is not None and shapes is None:
                raise ValueError(
                    f"make_state_slots: {type(layer.mixer).__name__} states no state_shapes(): "
                    f"{self.config.model_type} does not run over pages (model.paged is False)"
                )
            out.append(
                None if shapes is None
                else RecurrentSlots(
                    num_slots, shapes, backend=self.backend.name, device=self.device
                )
            )  # fmt: skip
        return out

    def forward_paged(
        self,
        ids: Sequence[Sequence[int]],
        /,
        *,
        caches: Sequence[Sequence[Any]],
        logits: bool = True,
        state_slots: Sequence[RecurrentSlots | None] | None = None,
        slot_ids: Sequence[int] | None = None,
    ) -> Any:
        """Logits ``(B, V)`` of the last position of each row after its tokens ``ids[b]`` (one
        length ``L`` for all rows), over paged caches: ``caches[b]`` is row ``b``'s
        :class:`~portable_llm.PagedKVCache` per layer (over :meth:`make_page_pools`' pools).
        ``logits=False``: only fill the caches; returns ``None``. A hybrid model also takes its
        recurrent layers' states: ``state_slots`` (:meth:`make_state_slots`) and the rows'
        slots ``slot_ids[b]``. See :func:`portable_llm.decoder.paged_step.forward`."""
        return paged_forward(
            self, caches, [list(row) for row in ids], logits=logits, state_slots=state_slots,
            slot_ids=slot_ids,
        )  # fmt: skip

    def make_cache(self, *, left_padding: Any = None, step: int = 256) -> list[Any]:
        """One cache per layer: for attention a :class:`~portable_llm.KVCache`, or for a
        sliding-window layer a :class:`~portable_llm.RotatingKVCache` of the window's size; for
        a recurrent mixer (:attr:`Layer.mixer <portable_llm.decoder.layer_weights.Layer>`) a
        :class:`~portable_llm.RecurrentCache` (``max_rewind=0``:
        :func:`~portable_llm.speculative_generate` sets its draft length); for a layer with
        both a :class:`~portable_llm.caches.hybrid.HybridCache` of the two.
        A latent attention layer's (DeepSeek V3) is a latent cache: a ``KVCache`` that holds the
        compressed ``c_kv`` ``(B, 1, S, R)`` as its keys and the rotary key ``k_pe`` ``(B, 1,
        S, d_r)`` as its values, ``R + d_r`` numbers per token, not the heads
        (:func:`~portable_llm.latent_attention`).

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
        for i, layer in enumerate(self.layers):
            kv: Any = None
            if layer.attn is not None:
                window = self.config.window(i)
                if window is None:
                    kv = KVCache(step=step, left_padding=left_padding, static_shapes=static)
                else:
                    kv = RotatingKVCache(window, step=step, left_padding=left_padding)
            if layer.mixer is None:
                caches.append(kv)
                continue
            state = RecurrentCache(left_padding=left_padding)
            caches.append(state if kv is None else HybridCache(kv, state))
        return caches


def _check_int8(prepared: Forward | None) -> None:
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
