"""One forward of several sequences over paged KV caches (what :mod:`~portable_llm.generation.batch`
runs each step).

:class:`PagedState` is the forward state (:class:`~portable_llm.decoder.states.DenseState`)
with another cache: row ``b`` of the batch is one sequence, whose layer ``i`` keeps its
keys and values in a :class:`~portable_llm.caches.paged.PagedKVCache` of that layer's
:class:`~portable_llm.caches.paged.PagePool`. Each layer appends every row's new keys and
values to the row's cache and attends with :func:`~portable_llm.attn.paged.paged_attention`
over the pool: rows of different lengths in one batch, no padding. RoPE takes each row's own
position (the offset of its cache).

The block tables of a step are built once, at the first layer: every layer's pool allocates
the same page ids for a sequence (the batch generator reserves a sequence's pages in every
layer at once, and frees them at once), so the tables and lengths are the same in every layer.

A model without a prepared forward (weights in mixed float dtypes) runs each sequence alone
through ``model(ids, cache=caches)``: :func:`forward` does that, with the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portable_llm.attn.paged import paged_attention
from portable_llm.caches.check import check_caches, check_pool_pages
from portable_llm.caches.paged import PagedKVCache, block_tables
from portable_llm.caches.recurrent import RecurrentSlots, SlotRows
from portable_llm.core.arrays import asarray
from portable_llm.decoder.forward import check_learned_positions, head_weight
from portable_llm.decoder.mixer import RecurrentState
from portable_llm.decoder.states import DenseState, ForwardSetup
from portable_llm.ops.kernels import KernelSet

__all__ = ["PagedState", "forward"]


class PagedState(DenseState):
    """What the layers of one paged forward share (see the module docstring).

    Parameters
    ----------
    s : ForwardSetup
    caches : one list per row: that sequence's caches, one per layer
    positions : each row's first position (its caches' offset before this forward)
    L : the new tokens per row
    """

    def __init__(
        self, s: ForwardSetup, caches: Sequence[Sequence[PagedKVCache]], positions: list[int],
        L: int, states: Sequence[SlotRows | None] | None = None,
    ) -> None:  # fmt: skip
        rows = None
        if len(positions) > 1:  # (B,) RoPE offsets, one per row
            rows = asarray(positions, backend=s.bk.name, device=s.device)
        super().__init__(s, None, None, rows, positions[0], L)
        self.paged_seqs = caches
        self.paged_tables: tuple[Any, Any] | None = None  # (B, max_pages), (B,): every layer's
        #: Per layer, the rows' recurrent states in their slots (a hybrid model's), or None.
        self.states = states
        self._attended: set[int] = set()  # the layers whose caches attend() advanced
        #: Latent layers attend over pages of ``[c_kv, k_pe]``: the absorbed form's keys.
        self.absorbed_only = True

    def recurrent(self, i: int) -> RecurrentState | None:
        """Layer ``i``'s rows' recurrent states (:class:`~portable_llm.caches.recurrent.
        SlotRows`). A layer without attention advances its caches here, over its pool of one
        feature (``Model.make_page_pools``), so that every layer's pages and offsets agree."""
        if i not in self._attended:
            layer = [seq[i] for seq in self.paged_seqs]
            pool = layer[0].pool
            zero = self.s.xp.zeros((1, 1, self.L, 1), dtype=pool.dtype, device=pool.device)
            for cache in layer:
                cache.append(zero, zero)  # (1, 1, L, 1): nothing the forward reads
        return None if self.states is None else self.states[i]

    def append(self, i: int, k: Any, v: Any) -> Any:
        """Append the rows' keys and values ``(B, H_kv, L, D)`` to their caches of layer ``i``;
        the layer's pool."""
        layer = [seq[i] for seq in self.paged_seqs]
        self._attended.add(i)
        if len(layer) == 1:
            layer[0].append(k, v)
        else:
            for b, cache in enumerate(layer):
                cache.append(k[b : b + 1, ...], v[b : b + 1, ...])  # (1, H_kv, L, D)
        if self.paged_tables is None:
            self.paged_tables = block_tables(layer)
        return layer[0].pool

    def attend(
        self, kn: KernelSet, i: int, q: Any, k: Any, v: Any, window: int | None,
        chunk: int | None = None, *, sinks: Any = None,
    ) -> Any:  # fmt: skip
        """Append the rows' keys and values ``(B, H_kv, L, D)`` to their caches of layer ``i``;
        the paged attention of ``q`` ``(B, H, L, D)`` over them (``sinks`` ``(H,)``: the
        layer's attention sinks)."""
        pool = self.append(i, k, v)
        assert self.paged_tables is not None
        tables, lengths = self.paged_tables
        return paged_attention(
            q, pool, tables, lengths, scale=self.s.scale, window=window, chunk=chunk,
            softcap=self.s.softcap, sinks=sinks,
        )  # fmt: skip

    def latents(self, kn: KernelSet, i: int, c_kv: Any, k_pe: Any) -> tuple[Any, Any, Any]:
        """Latent layer ``i``: the rows' ``[c_kv, k_pe]`` ``(B, 1, L, R + d_r)`` appended to
        their pages as both keys and values (the absorbed form's keys, and values whose first
        ``R`` features are ``c_kv``; twice the numbers of a dense latent cache, and the one
        paged attention kernel); the new latents back (:meth:`attend_latent` reads the
        pages)."""
        both = self.s.xp.concat([c_kv, k_pe], axis=-1)  # (B, 1, L, R + d_r)
        self.append(i, both, both)
        return c_kv, k_pe, None

    def attend_latent(self, kn: KernelSet, i: int, q: Any, k: Any, v: Any, mask: Any) -> Any:
        """The absorbed query ``q`` ``(B, H, L, R + d_r)`` over layer ``i``'s pages: the
        latent output ``(B, H, L, R)`` (``v``'s width: ``c_kv``'s features of the pages)."""
        assert self.paged_tables is not None
        tables, lengths = self.paged_tables
        pool = self.paged_seqs[0][i].pool
        o = paged_attention(q, pool, tables, lengths, scale=self.s.scale, softcap=self.s.softcap)
        return o[..., : v.shape[-1]]  # (B, H, L, R)


def forward(
    model: Any,
    caches: Sequence[Sequence[PagedKVCache]],
    chunks: list[list[int]],
    *,
    logits: bool = True,
    state_slots: Sequence[RecurrentSlots | None] | None = None,
    slot_ids: Sequence[int] | None = None,
) -> Any:
    """The logits ``(B, V)`` of the last position of each row after its tokens ``chunks[b]``
    (all of one length ``L``), which follow what the row's caches hold; the caches then hold
    them too.

    ``caches[b]``: row ``b``'s caches, one per layer. The prepared forward runs the rows as one
    batch (:class:`PagedState`); a model without one runs each row alone. ``logits=False``: only
    fill the caches (a prefill chunk before the last), without the LM head; returns ``None``.
    """
    states = _slot_rows(model, state_slots, slot_ids, len(caches))
    bk, p = model.backend, model.prepared
    start = max((seq[0].offset for seq in caches), default=0)  # the row reaching furthest
    check_learned_positions("forward_paged", model.config, start, len(chunks[0]))
    c, L, op = model.config, len(chunks[0]), "forward_paged"
    attends = [layer.attn is not None for layer in model.layers]
    # a latent layer's pages hold [c_kv, k_pe] (1, R + d_r) per token
    dims = [c.cache_dims(i, paged=True) for i in range(c.num_hidden_layers)]
    shape = [(1, H, L, D) for H, D in dims]
    for b, seq in enumerate(caches):  # every row's every layer takes the chunk, or none does
        kv = [x if a else None for x, a in zip(seq, attends, strict=False)]  # pools of keys
        check_caches(op, kv, backend=bk, shape=shape, dtype=model.dtype, name=f"caches[{b}]")
    check_pool_pages(op, caches, L)
    if p is None and c.kv_lora_rank:
        raise ValueError(
            f"{op}: a latent attention model ({c.model_type}) runs paged in its prepared "
            "forward only (weights of one dtype and backend); this one has none"
        )
    if p is None:
        xp = bk.xp
        rows = [
            model(asarray([chunk], backend=bk.name, device=model.device), cache=seq,
                  last_only=True)[:, -1, :]  # (1, V)
            for seq, chunk in zip(caches, chunks, strict=True)
        ]  # fmt: skip
        return rows[0] if len(rows) == 1 else xp.concat(rows, axis=0)  # (B, V)
    ids = asarray(chunks, backend=bk.name, device=model.device)  # (B, L)
    offsets = [seq[0].offset for seq in caches]
    state = PagedState(p.setup, caches, offsets, len(chunks[0]), states)
    h = p.run_layers(p.embed(ids, state, model.embed), state)  # (B, L, E)
    if not logits:
        return None
    head = head_weight(model.embed, model.lm_head)
    return p.head(h[:, -1:, :], state, model.norm, head)[:, -1, :]  # (B, V)


def _slot_rows(
    model: Any, slots: Sequence[RecurrentSlots | None] | None, ids: Sequence[int] | None, B: int
) -> list[SlotRows | None] | None:
    """Per layer, the rows' states of a hybrid model (``None`` for a layer without a
    recurrent mixer), or ``None`` for a model without one. A hybrid model needs its prepared
    forward (``model.paged``) and a slot per row."""
    if not model.recurrent:
        return None
    op = "forward_paged"
    if not model.paged:
        raise ValueError(
            f"{op}: {model.config.model_type}'s recurrent layers keep their state in no page "
            "and this model has no slots for them (model.paged is False): run each sequence "
            "over model.make_cache(), as BatchGenerator does for such a model"
        )
    if slots is None or ids is None or len(ids) != B or len(slots) != len(model.layers):
        raise ValueError(
            f"{op}: {model.config.model_type}'s recurrent layers need state_slots (one per "
            f"layer, model.make_state_slots()) and slot_ids (one per row: {B}), got "
            f"{None if slots is None else len(slots)} and {None if ids is None else len(ids)}"
        )
    return [
        None if layer.mixer is None or store is None else store.rows(ids)
        for layer, store in zip(model.layers, slots, strict=True)
    ]
