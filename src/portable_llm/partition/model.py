"""A decoder split over ranks: the blocks of :class:`~portable_llm.decoder.model.Model` with the
engine's collectives between them.

:class:`PartitionedModel` is a :class:`~portable_llm.decoder.model.Model` (``make_cache``,
``decode_step``, ``generate`` and the rest work unchanged) whose call runs this process's
stages: stage 0 embeds, each stage runs its layers and hands the hidden states on, the last
stage norms and projects, and every rank gets the logits. Within a layer, each rank's attention
and MLP (or MoE) give a partial sum over its heads and intermediate slices, completed by one
all-reduce each: ``h = h + all_reduce(attention(norm(h)))``, ``h = h + all_reduce(mlp(norm(h)))``.
An ``o_proj`` bias is added once, after the sum; a ``down_proj`` bias is held by TP rank 0
only (zeros elsewhere), so the sum counts it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portable_llm.attn.block import attention
from portable_llm.backends import Backend, backend_of
from portable_llm.core.arrays import asarray, creation_device
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.model import Block, Model
from portable_llm.decoder.prepared import position_ids
from portable_llm.ops.activations import activation
from portable_llm.ops.embedding import embedding
from portable_llm.ops.linear import linear, mlp
from portable_llm.ops.moe import moe
from portable_llm.ops.norm import layer_norm, rms_norm
from portable_llm.partition.engine import Engine

__all__ = ["PartitionedModel"]


class PartitionedModel(Model):
    """This process's share of a partitioned decoder (see :mod:`portable_llm.partition`).

    ``config``: the config of the blocks this process holds (local heads, sizes and layers;
    the full config where one process drives every stage: JAX); ``stages``: the layers of each
    stage this process runs, counted in :attr:`blocks`; ``engine``: the collectives.
    ``full_config`` is the model's own config. Build one with :func:`portable_llm.load`.
    """

    def __init__(
        self,
        config: DecoderConfig,
        weights: dict[str, Any],
        backend: Backend,
        *,
        engine: Engine,
        stages: dict[int, range],
        full_config: DecoderConfig,
        tokenizer: Any = None,
        generation_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            config,
            weights,
            backend,
            tokenizer=tokenizer,
            generation_config=generation_config,
            prepared=False,
            compile=False,
        )
        self.engine = engine
        self.stages = dict(stages)
        self.full_config = full_config

    def __repr__(self) -> str:
        c, e = self.full_config, self.engine
        return (
            f"PartitionedModel({c.model_type}, layers={c.num_hidden_layers}, "
            f"E={c.hidden_size}, H={c.num_attention_heads}, H_kv={c.num_key_value_heads}, "
            f"V={c.vocab_size}, backend={self.backend.name!r}, "
            f"dtype={self.backend.dtype_name(self.dtype)}, tensor_parallel={e.tp_size}, "
            f"pipeline_parallel={e.pp_size}, stages here={sorted(self.stages)})"
        )

    @property
    def vocab_size(self) -> int:
        return self.full_config.vocab_size

    def __call__(
        self,
        ids: Any,
        /,
        *,
        cache: Sequence[Any] | None = None,
        left_padding: Any = None,
        last_only: bool = False,
    ) -> Any:
        """Logits ``(B, L, V)`` (``(B, 1, V)`` with ``last_only``) on every rank; the arguments
        are :meth:`Model.__call__ <portable_llm.decoder.model.Model.__call__>`'s."""
        bk, e = self.backend, self.engine
        if backend_of(ids) is not bk or bk.device_of(ids) != self.device:
            ids = asarray(ids, backend=bk.name, device=self.device)
        if ids.ndim != 2:
            raise ValueError(f"model: ids must have shape (B, L), got {tuple(ids.shape)}")
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(
                f"model: cache must hold one cache per layer of this rank ({len(self.blocks)}), "
                f"got {len(cache)}"
            )
        if cache is not None and left_padding is not None:
            raise ValueError("model: with a cache, give left_padding to make_cache()")
        if left_padding is not None:
            left_padding = asarray(left_padding, backend=bk.name, device=self.device)
        B, L = ids.shape
        eps = self.config.rms_norm_eps
        last = e.pp_size - 1
        h = None
        for stage, layers in self.stages.items():
            if stage == 0:
                h = self._embed(ids, cache, left_padding)  # (B, L, E)
            elif h is None:
                h = e.recv(stage - 1, (B, L, self.config.hidden_size), self.norm)
            else:
                h = e.move(h, stage)
            for i in layers:
                c = None if cache is None else cache[i]
                h = self._block(self.blocks[i], h, c, left_padding, eps)
            if stage != last and e.pp_rank is not None:
                e.send(h, stage + 1)
                h = None
        logits = None
        if h is not None and last in self.stages:
            if last_only:
                h = h[:, -1:, :]  # (B, 1, E)
            if self.config.norm == "layer":
                h = layer_norm(h, self.norm, self.norm_bias, eps=eps)
            else:
                h = rms_norm(h, self.norm, eps=eps)
            head = self.embed if self.lm_head is None else self.lm_head
            logits = linear(h, head, self.head_bias)  # (B, L, V)
        shape = (B, 1 if last_only else L, self.full_config.vocab_size)
        return e.share_logits(logits, shape, self.norm)

    def _embed(self, ids: Any, cache: Any, left_padding: Any) -> Any:
        """The first stage's hidden states: the token embedding, plus GPT-2's learned
        positions (as :class:`~portable_llm.decoder.model.Model` adds them)."""
        h = embedding(ids, self.embed)  # (B, L, E)
        if self.positions is None:
            return h
        bk = self.backend
        start, pad = (0, left_padding) if cache is None else (
            cache[0].offset, cache[0].left_padding
        )  # fmt: skip
        if pad is not None:
            start = start - asarray(pad, backend=bk.name, device=self.device)  # (B,)
        pos = position_ids(bk.xp, start, ids.shape[1], creation_device(h))
        return h + embedding(pos, self.positions)

    def _block(self, block: Block, h: Any, cache: Any, left_padding: Any, eps: float) -> Any:
        """One layer: :class:`~portable_llm.decoder.model.Block`'s ops, each partial sum
        (attention, feed-forward) completed by the engine's all-reduce."""
        e = self.engine
        r = block.norm(h, block.input_norm, block.input_bias, eps)
        a = attention(r, **block.attn, cache=cache, left_padding=left_padding)
        if block.parallel:  # Phi-2: one all-reduce of attention + feed-forward
            a = e.all_reduce(a + _feed_forward(block, r))
            return (a if block.o_bias is None else a + block.o_bias) + h
        a = e.all_reduce(a)
        if block.o_bias is not None:  # whole on every rank: added after the sum
            a = a + block.o_bias
        h = h + a
        r = block.norm(h, block.post_norm, block.post_bias, eps)
        return h + e.all_reduce(_feed_forward(block, r))


def _feed_forward(block: Block, r: Any) -> Any:
    """The rank's partial MLP or MoE (its ``down_proj`` bias is zeros on TP ranks but 0)."""
    if block.moe is not None:
        return moe(r, *block.moe["arrays"], **block.moe["options"])
    assert block.mlp is not None
    w_gate, w_up, w_down = block.mlp
    opts = block.mlp_options
    if w_gate is None:  # the plain MLP: down(act(up(r)))
        up = linear(r, w_up, opts["b_up"])
        return linear(activation(opts["act"])(up), w_down, opts["b_down"])
    return mlp(r, *block.mlp, **opts)
