"""The recurrent state of a layer as a cache: :class:`RecurrentCache` (one sequence batch, with
speculative rewinds) and :class:`RecurrentSlots` (per-request slots for continuous batching).

A layer of :func:`~portable_llm.short_conv`, :func:`~portable_llm.gated_delta_rule` or
:func:`~portable_llm.ssd_scan` carries a fixed-size state (any tuple of arrays: a convolution
window, a delta-rule or scan matrix) from call to call. Rewinds *keep states*: a recurrent state
cannot be un-applied, so the cache holds the states after each of the last ``max_rewind`` tokens
(the ops' ``all_states=True`` gives them for a chunk) and :meth:`RecurrentCache.trim` restores
one of them. See docs/ops/recurrent.md for why not re-run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portable_llm.backends import Backend, get_backend, resolve
from portable_llm.caches.base import check_padding
from portable_llm.core.checks import check_bool, check_int

__all__ = ["RecurrentCache", "RecurrentSlots", "SlotRows"]


class RecurrentCache:
    """One layer's recurrent state over a batch, rewindable by up to ``max_rewind`` tokens.

    Parameters
    ----------
    max_rewind : int, >= 0
        Tokens :meth:`trim` can take back: the cache keeps the states after each of the last
        ``max_rewind`` tokens (speculative decoding: the number of draft tokens). A public
        attribute: :func:`~portable_llm.speculative_generate` sets it on the caches of
        ``model.make_cache()`` to its draft length.
    left_padding : integer array ``(B,)``, optional
        The pad tokens at the start of each row of a left-padded batch, as the KV caches take
        them (:func:`~portable_llm.left_pad`): a model's recurrent layer zeroes its inputs at
        those columns, so that its state starts from the row's first real token.

    Notes
    -----
    ``state`` is ``None`` before the first update (the ops then start from zeros), else the
    tuple of arrays of the last update.
    """

    def __init__(self, *, max_rewind: int = 0, left_padding: Any = None) -> None:
        self.max_rewind = check_int("RecurrentCache", "max_rewind", max_rewind, low=0)
        self._pad = None if left_padding is None else check_padding(left_padding)
        self._offset = 0
        # (offset, states) for the offsets a trim may return to, oldest first
        self._kept: list[tuple[int, tuple[Any, ...] | None]] = [(0, None)]

    @property
    def offset(self) -> int:
        """Tokens seen so far."""
        return self._offset

    @property
    def left_padding(self) -> Any:
        """The ``(B,)`` pad counts given at construction, or ``None``."""
        return self._pad

    @property
    def state(self) -> tuple[Any, ...] | None:
        """The state after the last token: the tuple given to :meth:`update`, or ``None``."""
        return self._kept[-1][1]

    def __repr__(self) -> str:
        kept = [o for o, _ in self._kept]
        return f"RecurrentCache(offset={self._offset}, kept offsets={kept})"

    def update(self, *states: Any, tokens: int = 1, all_states: bool = False) -> None:
        """Record the state after a chunk of tokens.

        Parameters
        ----------
        *states : arrays
            The layer's state arrays after the chunk, each ``(B, ...)``; with ``all_states``,
            each ``(B, L, ...)``: the state after every token of the chunk (the ops'
            ``all_states=True`` output), which lets :meth:`trim` stop inside the chunk.
        tokens : int, >= 1
            The chunk's length without ``all_states`` (with it: ``L``, read from the arrays).
        all_states : bool
        """
        op = "RecurrentCache.update"
        check_bool(op, "all_states", all_states)
        if not states:
            raise ValueError(f"{op}: give at least one state array")
        prev = self.state
        got = [tuple(s.shape[:1]) + tuple(s.shape[2 if all_states else 1 :]) for s in states]
        if prev is not None and got != [tuple(p.shape) for p in prev]:
            raise ValueError(
                f"{op}: the states' shapes {got} (per token) differ from the cache's "
                f"{[tuple(p.shape) for p in prev]}: one cache holds one layer's state"
            )
        if all_states:
            steps = {int(s.shape[1]) if s.ndim >= 2 else -1 for s in states}
            if len(steps) != 1 or min(steps) < 1:
                raise ValueError(
                    f"{op}: with all_states, every state must be (B, L, ...) with one L >= 1, got "
                    f"shapes {[tuple(s.shape) for s in states]}"
                )
            for t in range(steps.pop()):
                self._offset += 1
                self._kept.append((self._offset, tuple(s[:, t, ...] for s in states)))
        else:
            self._offset += check_int(op, "tokens", tokens, low=1)
            self._kept.append((self._offset, tuple(states)))
        first = self._offset - self.max_rewind  # the oldest offset a trim may reach
        self._kept = [k for k in self._kept if k[0] >= first] or self._kept[-1:]

    def trim(self, n: int, /) -> int:
        """Take back the last ``n`` tokens (speculative decoding's rewind); return ``n``.

        The state becomes the one kept ``n`` tokens back: exactly the state of never having
        taken them. ``ValueError`` when that state was not kept (``n > max_rewind``, or inside
        a chunk updated without ``all_states``).
        """
        op = "RecurrentCache.trim"
        n = check_int(op, "n", n, low=0, high=self._offset)
        target = self._offset - n
        keep = [k for k in self._kept if k[0] <= target]
        if not keep or keep[-1][0] != target:
            kept = [o for o, _ in self._kept]
            raise ValueError(
                f"{op}: no state kept at offset {target} (n={n} from offset {self._offset}; "
                f"kept offsets {kept}, max_rewind={self.max_rewind}); update with "
                "all_states=True to rewind inside a chunk"
            )
        self._kept, self._offset = keep, target
        return n

    def reset(self) -> None:
        """Forget everything: the start of a new sequence."""
        self._offset, self._kept = 0, [(0, None)]


class RecurrentSlots:
    """Per-request recurrent states for continuous batching: ``num_slots`` slots, each holding
    one row of every state array, in buffers ``(num_slots, *shape)`` allocated up front.

    Parameters
    ----------
    num_slots : int, >= 1
    shapes : sequence of tuples
        One row's shape per state array (the ops' state without ``B``: ``(H, D_k, D_v)`` for
        the delta rule, ``(K - 1, C)`` for the convolution).
    dtype : str
        The buffers' float dtype (the ops return their state in float32; the convolution's in
        the activations' dtype).
    backend : str, optional
        Default: NumPy.
    device : optional
        The backend's device for the buffers (a model's: ``"cuda:0"``, ...); default the
        backend's default.
    """

    def __init__(
        self,
        num_slots: int,
        /,
        shapes: Sequence[tuple[int, ...]],
        *,
        dtype: str = "float32",
        backend: str | None = None,
        device: Any = None,
    ) -> None:
        op = "RecurrentSlots"
        self.num_slots = check_int(op, "num_slots", num_slots, low=1)
        self._bk: Backend = get_backend(backend or "numpy")
        if dtype not in self._bk.float_dtypes():
            raise ValueError(f"{op}: dtype must be one of {self._bk.float_dtypes()}, got {dtype!r}")
        self._dtype = self._bk.dtypes[dtype]
        self._device = self._bk.device(device)
        self._shapes = [tuple(check_int(op, "shapes[i][j]", d, low=0) for d in s) for s in shapes]
        if not self._shapes:
            raise ValueError(f"{op}: give at least one state shape")
        self._bufs = [self._zeros((self.num_slots, *s)) for s in self._shapes]
        self._free = list(range(self.num_slots))

    def _zeros(self, shape: tuple[int, ...]) -> Any:
        return self._bk.xp.zeros(shape, dtype=self._dtype, device=self._device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __repr__(self) -> str:
        return f"RecurrentSlots({self.num_slots}, shapes={self._shapes}, free={len(self._free)})"

    def allocate(self) -> int:
        """A free slot, zeroed (a new sequence starts from the zero state); ``RuntimeError``
        when every slot is taken."""
        if not self._free:
            raise RuntimeError(f"RecurrentSlots.allocate: all {self.num_slots} slots are taken")
        slot = self._free.pop(0)
        self.reset(slot)
        return slot

    def _check(self, op: str, slot: Any) -> int:
        slot = check_int(op, "slot", slot, low=0, high=self.num_slots - 1)
        if slot in self._free:
            raise ValueError(f"{op}: slot {slot} is not allocated")
        return slot

    def release(self, slot: int, /) -> None:
        """Give ``slot`` back (its request finished)."""
        self._free.append(self._check("RecurrentSlots.release", slot))

    def reset(self, slot: int, /) -> None:
        """Zero ``slot``'s state (a new prompt in the same slot)."""
        for i, s in enumerate(self._shapes):
            zero = self._zeros((1, *s))
            self._bufs[i] = self._bk.set_slice(self._bufs[i], (slot, *(0,) * len(s)), zero)

    def grow(self, num_slots: int, /) -> None:
        """Hold ``num_slots`` slots (at least as many as now): the new ones free and zeroed,
        the others' states kept."""
        op = "RecurrentSlots.grow"
        n = check_int(op, "num_slots", num_slots, low=self.num_slots)
        xp = self._bk.xp
        more = n - self.num_slots
        if more:
            self._bufs = [
                xp.concat([b, self._zeros((more, *s))], axis=0)
                for b, s in zip(self._bufs, self._shapes, strict=True)
            ]  # fmt: skip
            self._free += list(range(self.num_slots, n))
            self.num_slots = n

    def copy(self, source: int, target: int, /) -> None:
        """Give ``target`` the state of ``source`` (a request forked after its prompt: ``n > 1``
        sequences from one prefill)."""
        self.scatter([target], *self.gather([source]))

    def rows(self, slots: Sequence[int], /) -> SlotRows:
        """The states of ``slots`` as one batch's recurrent cache (:class:`SlotRows`): a batch
        step's rows, row ``b`` in slot ``slots[b]``."""
        return SlotRows(self, [self._check("RecurrentSlots.rows", s) for s in slots])

    def gather(self, slots: Sequence[int], /) -> tuple[Any, ...]:
        """The states of ``slots``, each ``(len(slots), *shape)``: a batch step's ``state=``."""
        op = "RecurrentSlots.gather"
        ids = [self._check(op, s) for s in slots]
        xp = self._bk.xp
        idx = xp.asarray(ids, device=self._device)
        return tuple(xp.take(b, idx, axis=0) for b in self._bufs)

    def scatter(self, slots: Sequence[int], /, *states: Any) -> None:
        """Write a batch step's states (each ``(len(slots), *shape)``) back to ``slots``."""
        op = "RecurrentSlots.scatter"
        ids = [self._check(op, s) for s in slots]
        if len(states) != len(self._shapes):
            raise ValueError(f"{op}: expected {len(self._shapes)} state arrays, got {len(states)}")
        _, states = resolve(op, self._bk, *states)
        for i, (s, want) in enumerate(zip(states, self._shapes, strict=True)):
            if tuple(s.shape) != (len(ids), *want):
                raise ValueError(
                    f"{op}: state {i} must have shape {(len(ids), *want)}, got {tuple(s.shape)}"
                )
            s = self._bk.xp.astype(s, self._dtype)
            for row, slot in enumerate(ids):
                start = (slot, *(0,) * len(want))
                self._bufs[i] = self._bk.set_slice(self._bufs[i], start, s[row : row + 1, ...])


class SlotRows:
    """The recurrent cache of one batched step over :class:`RecurrentSlots`: what a model's
    recurrent layer reads and writes (:attr:`state`, :meth:`update`), row ``b`` in slot
    ``slots[b]``. It keeps no history (``max_rewind`` 0): a step's state replaces the rows'."""

    max_rewind = 0

    def __init__(self, store: RecurrentSlots, slots: list[int]) -> None:
        self.store, self.slots = store, slots

    @property
    def state(self) -> tuple[Any, ...]:
        """The rows' states, each ``(B, *shape)`` (a new request's: zeros)."""
        return self.store.gather(self.slots)

    def update(self, *states: Any, tokens: int = 1, all_states: bool = False) -> None:
        """Write the rows' states after a chunk (each ``(B, *shape)``) back to their slots."""
        if all_states:
            raise ValueError("SlotRows.update: slots keep one state per row, not all_states")
        self.store.scatter(self.slots, *states)
