"""KV caches for decoding: :class:`KVCache` keeps every key, :class:`RotatingKVCache` a window.

Both preallocate ``(B, H_kv, capacity, D)`` buffers grown ``step`` slots at a time and write only
the new tokens (:mod:`portable_llm.caches.base`), so a decode step costs ``O(1)`` copying on NumPy,
torch, MLX and array-api-strict, and one donated ``dynamic_update_slice`` on JAX.

:class:`RotatingKVCache`'s slot layout: the first ``keep`` columns stay in slots
``0 .. keep - 1``; a later column ``p`` lives in the ring slot ``keep + (p - ring0) % R``,
``R = max_size - keep``, overwriting the column ``R`` before it. One token at a time is written
in place. A chunk of ``L > 1`` tokens that would overwrite keys its own first queries still need
is answered with the previous window plus the whole chunk (``S = min(offset, max_size) + L``
keys), and the buffers then keep the last window in column order (``ring0`` moves to its first
ring column).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.attn.visibility import visible
from portable_llm.caches.base import BufferCache
from portable_llm.core.checks import check_int

__all__ = ["KVCache", "RotatingKVCache"]


class KVCache(BufferCache):
    """Every key and value seen, in preallocated buffers grown ``step`` slots at a time.

    Parameters
    ----------
    step : int
        Slots added per growth: ``S`` tokens cost ``O(S / step)`` reallocations
        (:attr:`reallocations`), and each update writes only its new tokens.
    left_padding : integer array of shape ``(B,)``, optional
        Pad tokens at the start of each row (see :func:`~portable_llm.left_pad`): their keys
        are masked out, and the attention block gives row ``b`` RoPE positions from
        ``column - left_padding[b]``.
    static_shapes : bool
        ``False`` (default, every backend): :meth:`update_and_fetch` returns exactly
        :attr:`offset` keys, which plain ``mask="causal"`` attends correctly. ``True``:
        fixed-size views of ``capacity - 1`` keys (the same shape for ``step`` tokens in a
        row), whose slots past :attr:`offset` only :meth:`make_mask` hides; for libraries that
        compile per shape (JAX), where a new key length per decode step would compile every
        attention op again. :meth:`~portable_llm.Model.make_cache` asks for them where the
        backend's :attr:`~portable_llm.backends.Backend.static_shapes` says so.

    Notes
    -----
    One thread: the thread of the first update owns the cache, and a call from another thread
    raises ``RuntimeError``. When an update's keys need the cache's mask (``static_shapes``
    views, ``left_padding``), the next update raises ``RuntimeError`` unless :meth:`make_mask`
    was called for it.
    """

    def __init__(
        self, *, step: int = 256, left_padding: Any = None, static_shapes: bool = False
    ) -> None:
        super().__init__(step, left_padding, static_shapes)

    def update_and_fetch(self, k: Any, v: Any, /) -> tuple[Any, Any]:
        """Append a chunk; return every key and value so far.

        Parameters
        ----------
        k, v : array, shape ``(B, H_kv, L, D)`` and ``(B, H_kv, L, D_v)``, float dtype
            The chunk's keys (after RoPE) and values; ``B``, ``H_kv``, ``D``, ``D_v`` (usually
            ``D``), the dtype and the library must match earlier chunks.

        Returns
        -------
        (k_all, v_all) : arrays, shape ``(B, H_kv, S, D)``
            Slices of the cache's buffers: use them before the next update (copy to keep them).
            ``S = offset``: attend with ``mask="causal"`` (bottom-right), or with
            :meth:`make_mask` when the cache has ``left_padding``. With ``static_shapes``,
            ``S = capacity - 1 >= offset``: the slots past the offset hold zeros or stale keys,
            and only :meth:`make_mask` hides them.
        """
        _, k, v = self._bind(k, v)
        start, L = self._offset, k.shape[2]
        self._reserve(start + L + 1)  # + 1: a slot stays free, so the slice is never the buffer
        self._write(start, k, v)
        self._offset = start + L
        S = self.capacity - 1 if self._static else self._offset
        self._record(L, None if self._offset == S else np.arange(S))
        return self._k[:, :, :S, :], self._v[:, :, :S, :]

    @property
    def state(self) -> tuple[Any, Any]:
        """The key and value buffers ``(B, H_kv, capacity, D)`` (``(None, None)`` before the
        first update): slots ``0 .. offset - 1`` hold the tokens seen (mlx-lm's
        ``KVCache.state``)."""
        return self._k, self._v

    def reserve(self, tokens: int, /, *, op: str = "KVCache.reserve") -> tuple[Any, Any]:
        """Grow the buffers (in steps of :attr:`step`) so that ``tokens`` more tokens fit with
        a slot left free, as :meth:`update_and_fetch` would; return :attr:`state`. For a
        compiled step that writes the buffers functionally, then hands them back with
        :meth:`adopt`. ``op`` names the caller in the error of a call from another thread."""
        self._check_thread(op)
        if self._k is None:
            raise ValueError(f"{op}: the cache holds no buffers yet (no update since it was made)")
        self._reserve(self._offset + tokens + 1)
        return self._k, self._v

    def adopt(self, keys: Any, values: Any, offset: int, /) -> None:
        """Take back buffers that a step updated functionally: ``keys`` and ``values`` (the
        shape of :attr:`state`) now hold ``offset`` tokens, the last ``offset -`` :attr:`offset`
        of them written by that step, whose queries attended with the cache's mask (as
        :meth:`make_mask` gives it). The cache is then as :meth:`update_and_fetch` and
        :meth:`make_mask` would have left it."""
        if self._k is None or tuple(keys.shape) != tuple(self._k.shape):
            have = None if self._k is None else tuple(self._k.shape)
            raise ValueError(
                f"KVCache.adopt: keys must have the buffers' shape {have}, got {tuple(keys.shape)}"
            )
        L = offset - self._offset
        if L < 1:
            raise ValueError(
                f"KVCache.adopt: offset must exceed the cache's ({self._offset}), got {offset}"
            )
        self._k, self._v, self._offset = keys, values, offset
        S = self.capacity - 1 if self._static else offset
        self._record(L, None if offset == S else np.arange(S))
        self._unmasked = False  # the step attended with the cache's mask


class RotatingKVCache(BufferCache):
    """The first ``keep`` tokens and the last ``max_size - keep``: a bounded-memory cache.

    Query at column ``p`` sees key ``j`` iff ``j <= p`` and (``j < keep`` or
    ``j > p - (max_size - keep)``): with ``keep=0``, the sliding window ``W = max_size``
    (:func:`~portable_llm.causal_mask`'s ``window``).

    Parameters
    ----------
    max_size : int, >= 1
        Keys kept per row and head.
    keep : int, 0 <= keep < max_size
        Leading tokens never evicted (attention sinks). Not with ``left_padding`` (a padded row's
        first columns are padding).
    step, left_padding
        As in :class:`~portable_llm.KVCache`; buffers grow up to ``max_size + 1`` slots.

    Notes
    -----
    Attend over the keys :meth:`update_and_fetch` returns with the cache's own mask,
    ``mask, window = cache.make_mask()``, and nothing else: once the ring wraps the keys are
    not in position order, and a chunk of ``L > 1`` tokens past ``max_size`` returns the
    previous window as well, which plain ``mask="causal"`` (no ``window=``) would let every
    query of the chunk see. An update whose keys need that mask makes the next update raise
    ``RuntimeError`` unless :meth:`make_mask` was called for it (single tokens and chunks that
    fit, without padding, are plain causal and need no call). One thread, as for
    :class:`KVCache`.
    """

    def __init__(
        self, max_size: int, keep: int = 0, *, step: int = 256, left_padding: Any = None
    ) -> None:
        name = "RotatingKVCache"
        self.max_size = check_int(name, "max_size", max_size, low=1)
        self.keep = check_int(name, "keep", keep, low=0)
        if self.keep >= self.max_size:
            raise ValueError(
                f"{name}: keep must be < max_size, got keep={keep}, max_size={max_size}"
            )
        if self.keep and left_padding is not None:
            raise ValueError(f"{name}: keep={keep} > 0 with left_padding is not supported")
        super().__init__(step, left_padding)
        self._ring = self.max_size - self.keep  # R
        self._ring0 = self.keep  # the column in ring slot 0
        self._high = 0  # 1 + the last column written (> offset after a trim)

    def _slot(self, col: int) -> int:
        return col if col < self.keep else self.keep + (col - self._ring0) % self._ring

    def update_and_fetch(self, k: Any, v: Any, /) -> tuple[Any, Any]:
        """Add a chunk; return the keys and values its queries need.

        Parameters
        ----------
        k, v : array, shape ``(B, H_kv, L, D)``
            As in :meth:`KVCache.update_and_fetch`.

        Returns
        -------
        (k_all, v_all) : arrays, shape ``(B, H_kv, S, D)``
            ``S = min(offset, max_size)`` keys (not in column order once the ring wraps), or,
            for a chunk of ``L > 1`` tokens past ``max_size``, the previous window and the chunk.
            Use them before the next update, with :meth:`make_mask` (the only mask that is
            right for them once the ring wraps; see the class notes).
        """
        _, k, v = self._bind(k, v)
        t, L, M = self._offset, k.shape[2], self.max_size
        T = t + L
        if L == 1 or T <= M:  # in place: no query of the chunk loses a key it needs
            self._reserve(min(T, M) + 1, M + 1)
            self._write(self._slot(t), k, v)
            cols = self._columns(T)
        else:
            k, v, cols = self._extend(k, v)
        self._offset = self._high = T
        still = cols.shape[0] == T and self._ring0 == self.keep  # still columns 0 .. T - 1
        self._record(L, None if still else cols)
        return (k, v) if L > 1 and T > M else self._fetch(min(T, M))

    def _fetch(self, n: int) -> tuple[Any, Any]:
        return self._k[:, :, :n, :], self._v[:, :, :n, :]

    def _columns(self, end: int) -> np.ndarray:
        """Host columns of slots ``0 .. min(end, max_size) - 1`` once column ``end - 1`` is in."""
        if end <= self.max_size:
            return np.arange(end)
        r = np.arange(self._ring)
        ring = (end - 1) - ((end - 1 - self._ring0 - r) % self._ring)
        return np.concatenate([np.arange(self.keep), ring])

    def _extend(self, k: Any, v: Any) -> tuple[Any, Any, np.ndarray]:
        """Previous window + chunk in column order; then store the new window in column order."""
        assert self._bk is not None
        xp, keep, R = self._bk.xp, self.keep, self._ring
        t, T = self._offset, self._offset + k.shape[2]
        sinks = min(keep, t)
        lo = min(t, max(keep, self._high - R))  # oldest ring column still held
        parts = [(0, sinks)]
        a, c = self._slot(lo), t - lo
        first = min(c, keep + R - a)  # the ring wraps at most once
        parts += [(a, a + first), (keep, keep + c - first)]
        segs = [(s, e) for s, e in parts if e > s]
        k_all = xp.concat([self._k[:, :, s:e, :] for s, e in segs] + [k], axis=2)  # (B, H_kv, S, D)
        v_all = xp.concat([self._v[:, :, s:e, :] for s, e in segs] + [v], axis=2)
        cols = np.concatenate([np.arange(sinks), np.arange(lo, t), np.arange(t, T)])
        S = cols.shape[0]
        self._reserve(self.max_size + 1, self.max_size + 1)
        if keep:
            self._write(0, k_all[:, :, :keep, :], v_all[:, :, :keep, :])
        self._write(keep, k_all[:, :, S - R :, :], v_all[:, :, S - R :, :])
        self._ring0 = T - R
        return k_all, v_all, cols

    def _check_trim(self, n: int) -> None:
        t, R = self._offset - n, self._ring
        need, held = max(self.keep, t - R + 1), max(self.keep, self._high - R)
        if n and need < held:
            raise ValueError(
                f"RotatingKVCache.trim: n={n} rewinds to column {t}, whose window starts at "
                f"column {need}, but columns before {held} were evicted (offset "
                f"{self._offset}, max_size {self.max_size}, keep {self.keep})"
            )

    def _plain(self, L: int, cols: np.ndarray | None) -> bool:
        # One query sees every key held (its window is what the cache keeps).
        return self._pad is None and (cols is None or L == 1)

    def _mask(
        self, L: int, cols: np.ndarray | None, window: int | None, chunk: int | None = None
    ) -> tuple[Any, int | None]:
        R, keep, start = self._ring, self.keep, self._offset - L
        if window is not None and window > R:
            raise ValueError(
                f"RotatingKVCache.make_mask: window={window} exceeds the {R} most recent keys the "
                f"cache keeps (max_size {self.max_size} - keep {keep})"
            )
        if cols is None:  # columns 0 .. offset - 1: nothing evicted yet
            return super()._mask(L, None, window, chunk)
        if self._pad is None and chunk is None:
            if keep == 0 and cols[0] == self._offset - cols.shape[0] and _consecutive(cols):
                return "causal", R if window is None else window
            if L == 1 and (window is None or int(cols.min()) > start - window):
                return None, None  # one query; every key held is in its window
        assert self._bk is not None
        k_pos = self._bk.from_numpy(cols, self._device)
        xp, dev = self._bk.xp, self._device
        S = cols.shape[0]
        mask = visible(
            xp, L, S, q_start=start, k_pos=k_pos, window=window, chunk=chunk, ring=R, keep=keep,
            pad=self._pad, device=dev,
        )  # fmt: skip
        return (mask if self._pad is not None else xp.reshape(mask, (1, 1, L, S))), None


def _consecutive(cols: np.ndarray) -> bool:
    return bool(cols.shape[0] < 2 or (np.diff(cols) == 1).all())
