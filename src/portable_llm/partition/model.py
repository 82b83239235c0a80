"""A decoder split over ranks: the decoder's one forward with the engine's collectives between
its stages.

:class:`PartitionedModel` is a :class:`~portable_llm.decoder.model.Model` (``make_cache``,
``decode_step``, ``generate`` and the rest work unchanged) whose call runs this process's
stages with the decoder's one forward (:class:`~portable_llm.decoder.forward.Forward`): stage 0
embeds (``Forward.embed``), each stage runs its range of layers (``Forward.run_layers``) and
hands the hidden states on, the last stage norms and projects (``Forward.head``), and every
rank gets the logits. What the partition gives the forward is only its stages' layer ranges and
its ``reduce``: within a layer, each rank's attention and MLP (or MoE) give a partial sum over
its heads and intermediate slices, completed by one all-reduce each, applied before any bias or
norm: ``h = h + all_reduce(attention(norm(h)))``, ``h = h + all_reduce(mlp(norm(h)))``. An
``o_proj`` bias is added once, after the sum; a ``down_proj`` bias is held by TP rank 0 only
(zeros elsewhere), so the sum counts it once.

A process that runs its own rank (torch, MLX) runs its layers as the prepared forward (kernels
chosen once, masks and RoPE tables built once per forward), as one device does, where its
weights allow; where one process drives every stage (JAX's pipeline, whose XLA completes the
sums itself) the layers run op by op (the public ops, on each stage's devices).

Batching (:func:`~portable_llm.batch_generate`) runs the rows of a step in one forward over
paged caches (:meth:`PartitionedModel.forward_paged`): each rank's pools
(:meth:`~portable_llm.decoder.model.Model.make_page_pools`, from the rank's config) hold its
KV heads of its layers only, and the stages hand on the rows' hidden states as in a call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from portable_llm.backends import Backend, backend_of
from portable_llm.caches.page_pool import PagePool
from portable_llm.core.arrays import asarray
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.forward import Forward, check_learned_positions, head_weight
from portable_llm.decoder.model import Model
from portable_llm.decoder.paged_step import PagedState
from portable_llm.decoder.paged_step import forward as paged_forward
from portable_llm.decoder.prepared import op_by_op, preparable, prepare
from portable_llm.decoder.states import ForwardState
from portable_llm.partition.engine import Engine

__all__ = ["PartitionedModel"]


class PartitionedModel(Model):
    """This process's share of a partitioned decoder (see :mod:`portable_llm.partition`).

    ``config``: the config of the blocks this process holds (local heads, sizes and layers;
    the full config where one process drives every stage: JAX); ``stages``: the layers of each
    stage this process runs, counted in :attr:`blocks`; ``engine``: the collectives.
    ``full_config`` is the model's own config. ``prepared`` (default ``True``): run this
    rank's layers as the prepared forward where its weights allow; ``False`` composes the
    public ops layer by layer (:attr:`local`: the forward either way). Build one with
    :func:`portable_llm.load`.
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
        prepared: bool = True,
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
        #: This rank's forward, the tensor-parallel all-reduce bound in: prepared where its
        #: weights allow, else op by op (:attr:`Model.prepared
        #: <portable_llm.decoder.model.Model.prepared>` stays ``None``: the one-device forwards
        #: that it drives know nothing of the stages).
        self.local: Forward = self._local_forward(prepared)

    def _local_forward(self, prepared: bool) -> Forward:
        e, bk = self.engine, self.backend
        # A TP rank of a process engine completes its partial sums; JAX's XLA does it itself.
        reduce = e.all_reduce if e.tp_size > 1 and not e.single_controller else None
        top = {
            "embed": self.embed, "norm": self.norm, "head": head_weight(self.embed, self.lm_head),
            "norm_bias": self.norm_bias, "head_bias": self.head_bias, "positions": self.positions,
            "reduce": reduce,
        }  # fmt: skip
        if (
            not prepared
            or e.single_controller
            or not preparable(bk, self.dtype, self._top_arrays(), self.layers)
        ):
            return op_by_op(self.config, bk, self.layers, **top)
        last = e.pp_size - 1 in self.stages
        probe = self.norm if last else self.layers[0].norm_weight  # (E,): the kernels' choice
        return prepare(self.config, bk, self.dtype, self.layers, **top, probe=probe)

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
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(
                f"model: cache must hold one cache per layer of this rank ({len(self.layers)}), "
                f"got {len(cache)}"
            )
        if cache is not None and left_padding is not None:
            raise ValueError("model: with a cache, give left_padding to make_cache()")
        if left_padding is not None:
            left_padding = asarray(left_padding, backend=bk.name, device=self.device)
        B, L = ids.shape
        offset = 0 if cache is None else cache[0].offset
        check_learned_positions("model", self.config, offset, L)  # on every rank alike
        fwd = self.local
        h, state = self._stages(fwd, lambda: fwd.state(cache, left_padding, L), ids, (B, L))
        logits = None
        if h is not None:  # the last stage
            h = h[:, -1:, :] if last_only else h  # (B, L | 1, E)
            logits = fwd.head(h, state, self.norm, head_weight(self.embed, self.lm_head))
        shape = (B, 1 if last_only else L, self.full_config.vocab_size)
        return e.share_logits(logits, shape, self.norm)

    def _stages(
        self, fwd: Forward, new_state: Callable[[], ForwardState], ids: Any, shape: tuple[int, int]
    ) -> tuple[Any, ForwardState]:
        """This process's stages in order: stage 0 embeds ``ids``, a later one takes the hidden
        states ``(B, L, E)`` of the stage before; each runs its range of layers and hands them
        on. Returns the last stage's hidden states (``None`` on a rank without it) and the
        forward state (``new_state()``: one per forward, or one per stage where one process
        drives every stage, each on its own devices: its RoPE table and masks there; all made
        before a layer runs, at the caches' offset of this forward)."""
        e = self.engine
        last = e.pp_size - 1
        h, state = None, new_state()
        states = [state, *(new_state() for _ in list(self.stages)[1:] if e.single_controller)]
        for n, (stage, layers) in enumerate(self.stages.items()):
            state = states[n] if e.single_controller else state
            if stage == 0:
                h = fwd.embed(ids, state, self.embed)  # (B, L, E)
            elif h is None:
                h = e.recv(stage - 1, (*shape, self.config.hidden_size), self.norm)
            else:
                h = e.move(h, stage)
            h = fwd.run_layers(h, state, layers)
            if stage != last and e.pp_rank is not None:
                e.send(h, stage + 1)
                h = None
        return (h if last in self.stages else None), state

    def make_page_pools(self, num_pages: int, page_size: int) -> list[PagePool]:
        """One empty :class:`~portable_llm.PagePool` per layer this process holds: ``num_pages``
        pages of ``page_size`` tokens of the rank's ``(H_kv, D)`` heads (its config's), each
        where its layer's weights are (a rank's device; on JAX, its stage's devices, the pages
        split along the head axis over the TP axis: :meth:`Backend.split_heads
        <portable_llm.backends.Backend.split_heads>`)."""
        cfg, bk = self.config, self.backend
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        return [
            PagePool(*shape, self.dtype, backend=bk.name, device=bk.device_of(layer.norm_weight))
            for layer in self.layers
        ]

    @property
    def recurrent(self) -> bool:
        """Whether the model has a recurrent token mixer on any stage, not only in this rank's
        layers: every rank then takes the same batching path (a Qwen3-Next stage of attention
        layers alone would otherwise run pages while the DeltaNet's stage does not)."""
        return bool(self.full_config.mixer) or super().recurrent

    @property
    def paged(self) -> bool:
        """Whether :meth:`forward_paged` runs this rank's model: not for a hybrid model (its
        recurrent layers' states are kept per request, not split by stage here), which
        :class:`~portable_llm.BatchGenerator` then runs request by request over
        :meth:`make_cache`."""
        return not self.recurrent

    def forward_paged(
        self,
        ids: Sequence[Sequence[int]],
        /,
        *,
        caches: Sequence[Sequence[Any]],
        logits: bool = True,
        state_slots: Sequence[Any] | None = None,
        slot_ids: Sequence[int] | None = None,
    ) -> Any:
        """Logits ``(B, V)`` on every rank of the last position of each row after its tokens
        ``ids[b]`` (one length ``L``), over this rank's paged caches ``caches[b]`` (one
        :class:`~portable_llm.PagedKVCache` per layer it holds, over :meth:`make_page_pools`'
        pools: its KV heads only). The rows run as one batch through the rank's forward
        (:class:`~portable_llm.decoder.paged_step.PagedState`, the all-reduce bound in), stage
        to stage as in :meth:`__call__`; where one process drives every stage (JAX) each row
        runs alone. ``logits=False``: only fill the caches (every rank alike); returns
        ``None``."""
        if self.recurrent:
            raise ValueError(
                f"forward_paged: a partitioned {self.config.model_type} model's recurrent "
                "layers do not run over pages (model.paged is False): run each sequence over "
                "model.make_cache()"
            )
        e, fwd = self.engine, self.local
        chunks = [list(row) for row in ids]
        if e.single_controller:
            return paged_forward(self, caches, chunks, logits=logits)
        bk = self.backend
        B, L = len(chunks), len(chunks[0])
        starts = [seq[0].offset for seq in caches]
        check_learned_positions("forward_paged", self.config, max(starts, default=0), L)
        x = asarray(chunks, backend=bk.name, device=self.device)  # (B, L)
        h, state = self._stages(fwd, lambda: PagedState(fwd.setup, caches, starts, L), x, (B, L))
        if not logits:
            return None
        out = None
        if h is not None:  # the last stage: its rows' last positions
            head = head_weight(self.embed, self.lm_head)
            out = fwd.head(h[:, -1:, :], state, self.norm, head)  # (B, 1, V)
        shared = e.share_logits(out, (B, 1, self.full_config.vocab_size), self.norm)
        return shared[:, -1, :]  # (B, V)
