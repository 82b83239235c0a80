"""What both KV caches share: the buffers, the checks of a chunk, ``trim``, ``make_mask``.

Keys and values live in preallocated buffers ``(B, H_kv, capacity, D)`` (the values'
``(B, H_kv, capacity, D_v)``: their head dim may differ, as multi-head latent attention's cache
of ``c_kv`` and ``k_pe`` does) that grow in steps of ``step`` slots, and each update writes only
the new tokens through the backend's :meth:`~portable_llm.backends.Backend.set_slice`: a slice
assignment on NumPy, torch, MLX and array-api-strict, a donated ``lax.dynamic_update_slice`` on
JAX (immutable arrays). One slot is always left free, so what ``update_and_fetch`` returns is a
slice of the buffer, never the buffer itself. Positions here are *columns* of the (left-padded)
batch; see :mod:`portable_llm.attn.padding`.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from portable_llm.attn.visibility import visible
from portable_llm.backends import Backend, backend_of, resolve
from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import check_float, check_int, check_optional_int

__all__ = ["BufferCache", "check_padding"]


def check_padding(left_padding: Any, name: str = "RecurrentCache") -> Any:
    """``left_padding`` checked as the caches take it: a 1-d array of ints ``>= 0`` (one per
    row), of any backend or a sequence (then a NumPy array); else a ``ValueError``."""
    pad = left_padding if backend_of(left_padding) is not None else np.asarray(left_padding)
    host = to_numpy(pad)
    if host.ndim != 1 or host.dtype.kind not in "iu" or (host < 0).any():
        raise ValueError(
            f"{name}: left_padding must be a 1-d array of ints >= 0 (one per row), got "
            f"{host.dtype} with shape {host.shape}"
        )
    return pad


class BufferCache:
    """Buffers, checks, trim and masks shared by both caches; subclasses place the tokens.

    Two guards keep a misuse from giving wrong numbers or crashing silently:

    - *one thread*: the thread of the first update owns the cache; ``update_and_fetch``,
      ``make_mask`` and ``trim`` from any other thread raise ``RuntimeError`` (the buffers are
      written in place, and MLX crashes when two threads share them);
    - *the cache's own mask*: when the keys an update returned need a mask other than plain
      bottom-right ``mask="causal"`` (a wrapped ring, a chunk past the window, fixed-size views,
      left padding), the next update raises ``RuntimeError`` unless :meth:`make_mask` was called
      for it.
    """

    def __init__(self, step: int, left_padding: Any, static_shapes: bool = False) -> None:
        name = type(self).__name__
        self.step = check_int(name, "step", step, low=1)
        if not isinstance(static_shapes, bool):
            raise TypeError(f"{name}: static_shapes must be a bool, got {static_shapes!r}")
        self._static = static_shapes
        self._owner: int | None = None  # threading.get_ident() of the first update
        self._unmasked = False  # the last update's keys need make_mask, not yet called
        self._pad: Any = None
        if left_padding is not None:
            self._pad = check_padding(left_padding, name)
        self._bk: Backend | None = None
        self._k: Any = None
        self._v: Any = None
        self._dims: tuple[int, int, int] | None = None  # (B, H_kv, D)
        self._dv: int | None = None  # D_v: the values' head dim
        self._dtype: Any = None
        self._device: Any = None
        self._buffer_device: Any = None
        self._offset = 0
        self._last: tuple[int, np.ndarray | None] | None = None  # (L, host key columns)
        #: How many times the buffers were (re)allocated: O(S / step) for S tokens.
        self.reallocations = 0

    @property
    def offset(self) -> int:
        """Tokens (columns) seen so far: the position of the next one."""
        return self._offset

    @property
    def capacity(self) -> int:
        """Slots allocated per row and head (``0`` before the first update)."""
        return 0 if self._k is None else int(self._k.shape[2])

    @property
    def static_shapes(self) -> bool:
        """Whether :meth:`update_and_fetch` returns fixed-size views (``KVCache(static_shapes=
        True)``; ``False`` by default)."""
        return self._static

    @property
    def left_padding(self) -> Any:
        """The ``(B,)`` pad counts given at construction (on the cache's backend once bound)."""
        return self._pad

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offset={self._offset}, capacity={self.capacity})"

    def _check_thread(self, op: str) -> None:
        if self._owner is not None and self._owner != threading.get_ident():
            raise RuntimeError(
                f"{op}: this cache belongs to the thread that first updated it "
                f"({self._owner}), called from thread {threading.get_ident()}; a cache is "
                "written in place and must not be shared between threads (make one per thread)"
            )

    def check_update(
        self, backend: Backend, shape: tuple[int, ...], dtype: Any, /, *, op: str | None = None
    ) -> None:
        """Raise what :meth:`update_and_fetch` of a chunk ``k, v`` of this ``shape``
        ``(B, H_kv, L, D)``, ``dtype`` and ``backend`` would raise, changing nothing.

        A forward checks every layer's cache with it before the first layer runs
        (:func:`~portable_llm.caches.check.check_caches`), so that an update one cache
        refuses leaves every cache as it was. ``op`` names the caller in the errors.
        """
        op = op or f"{type(self).__name__}.update_and_fetch"
        self._check_thread(op)
        if self._unmasked:
            raise RuntimeError(
                f"{op}: the keys the previous update returned need the cache's mask (plain "
                'mask="causal" attends to the wrong keys there: a wrapped ring, a chunk past '
                "the window, fixed-size views or left padding), and make_mask() was not called; "
                "attend with mask, window = cache.make_mask() after each update"
            )
        dims = (shape[0], shape[1], shape[3])
        if self._bk is None:
            if self._pad is not None and self._pad.shape[0] != dims[0]:
                raise ValueError(
                    f"{op}: left_padding has shape {tuple(self._pad.shape)} but k has batch "
                    f"B={dims[0]} (k {tuple(shape)})"
                )
        elif backend is not self._bk:
            raise TypeError(
                f"{op}: the cache holds {self._bk.name} arrays, got {backend.name} arrays"
            )
        elif dims != self._dims:
            raise ValueError(
                f"{op}: k of shape {tuple(shape)} does not match the cache's "
                f"(B, H_kv, D) = {self._dims} (batch, heads and head dim must stay the same)"
            )
        elif dtype != self._dtype:
            raise TypeError(
                f"{op}: the cache holds {backend.dtype_name(self._dtype)}, got k of dtype "
                f"{backend.dtype_name(dtype)}"
            )

    def _bind(self, k: Any, v: Any) -> tuple[Backend, Any, Any]:
        op = f"{type(self).__name__}.update_and_fetch"
        bk, (k, v) = resolve(op, None, k, v)
        if bk.is_traced(k) or bk.is_traced(v):
            raise ValueError(
                f"{op}: k and v are traced (jax.jit or another transform); the caches are "
                "eager-only (they keep Python state and grow their buffers on the host's "
                "schedule), so call update_and_fetch outside the traced function"
            )
        for name, a in (("k", k), ("v", v)):
            check_float(op, name, a, bk)
        if k.ndim != 4 or k.shape[2] < 1:
            raise ValueError(
                f"{op}: k must have shape (B, H_kv, L, D), L >= 1, got {tuple(k.shape)}"
            )
        self.check_update(bk, tuple(k.shape), k.dtype, op=op)
        dv = self._dv if self._dv is not None else v.shape[-1]
        if tuple(v.shape) != (*k.shape[:3], dv) or v.dtype != k.dtype:
            raise ValueError(
                f"{op}: v must have k's dtype and shape (B, H_kv, L, D_v) but for its head dim "
                f"D_v (the cache's: {dv}); k {tuple(k.shape)} {bk.dtype_name(k.dtype)}, "
                f"v {tuple(v.shape)} {bk.dtype_name(v.dtype)}"
            )
        if self._bk is None:
            if self._pad is not None:
                _, (self._pad,) = resolve(op, bk, self._pad)
            self._bk, self._dims, self._dtype = bk, (k.shape[0], k.shape[1], k.shape[3]), k.dtype
            self._dv = v.shape[3]
            self._device = bk.device_of(k)
            # The buffers' own placement: k's (a JAX array split over heads on a mesh keeps
            # its split, so each device holds only its heads); masks go to self._device.
            self._buffer_device = getattr(k, "device", None)
            self._owner = threading.get_ident()
        return bk, k, v

    def _reserve(self, need: int, limit: int | None = None) -> None:
        """Make the buffers hold at least ``need`` slots (grown in steps, at most ``limit``)."""
        cap = self.capacity
        if cap >= need:
            return
        assert self._bk is not None and self._dims is not None
        bk, xp = self._bk, self._bk.xp
        new = -(-need // self.step) * self.step
        new = new if limit is None else min(new, limit)
        B, H, D = self._dims
        bufs = []
        for old, d in ((self._k, D), (self._v, self._dv)):
            buf = xp.zeros((B, H, new, d), dtype=self._dtype, device=self._buffer_device)
            bufs.append(buf if old is None else bk.set_slice(buf, (0, 0, 0, 0), old))
        self._k, self._v = bufs
        self.reallocations += 1

    def _write(self, slot: int, k: Any, v: Any) -> None:
        assert self._bk is not None
        self._k = self._bk.set_slice(self._k, (0, 0, slot, 0), k)
        self._v = self._bk.set_slice(self._v, (0, 0, slot, 0), v)

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (speculative decoding's rewind); return ``n``.

        The next update writes over them. ``ValueError`` when ``n`` exceeds :attr:`offset`.
        """
        name = f"{type(self).__name__}.trim"
        self._check_thread(name)
        n = check_int(name, "n", n, low=0)
        if n > self._offset:
            raise ValueError(
                f"{name}: n={n} exceeds the tokens in the cache (offset {self._offset})"
            )
        self._check_trim(n)
        self._offset -= n
        self._last = None
        self._unmasked = False  # the rewound chunk's keys are gone
        return n

    def _check_trim(self, n: int) -> None:
        pass

    def reuse_mask(self) -> None:
        """Say that the last update's queries attend with a mask built for another cache that
        saw the same updates (a model builds one mask per kind of layer and shares it): the
        guard of :meth:`make_mask` is satisfied, as if it had been called."""
        self._unmasked = False

    def make_mask(
        self, *, window: int | None = None, chunk: int | None = None
    ) -> tuple[Any, int | None]:
        """The attention mask of the last update's queries over the keys it returned.

        Parameters
        ----------
        window : int, optional
            The layer's sliding window (query at column ``p`` sees columns ``> p - window``).
        chunk : int, optional
            Llama 4's chunked attention (``attention_chunk_size``): a query sees the keys of its
            own chunk of positions (:func:`~portable_llm.attn.visibility.visible`'s rule; a
            left-padded row's chunks start at its first real token). Always an array mask.

        Returns
        -------
        (mask, window) : the ``mask=`` and ``window=`` of
            :func:`~portable_llm.scaled_dot_product_attention`: ``("causal", window)`` when the
            keys are consecutive columns ending at the last query (bottom-right causal), ``(None,
            None)`` when every query sees every key, else a boolean array ``(1 | B, 1, L, S)``
            (``True``: may attend; ``B`` rows with left padding) and ``None``.
        """
        name = f"{type(self).__name__}.make_mask"
        self._check_thread(name)
        window = check_optional_int(name, "window", window, low=1)
        chunk = check_optional_int(name, "chunk", chunk, low=1)
        if self._last is None:
            raise ValueError(f"{name}: no update since the cache was made or trimmed")
        out = self._mask(*self._last, window, chunk)
        self._unmasked = False
        return out

    def _record(self, L: int, cols: np.ndarray | None) -> None:
        """Remember the update's queries and key columns (for :meth:`make_mask`)."""
        self._last = (L, cols)
        self._unmasked = not self._plain(L, cols)

    def _plain(self, L: int, cols: np.ndarray | None) -> bool:
        """Whether plain bottom-right ``mask="causal"`` (no window) is this update's mask."""
        return self._pad is None and cols is None

    def _mask(
        self, L: int, cols: np.ndarray | None, window: int | None, chunk: int | None = None
    ) -> tuple[Any, int | None]:
        """``cols``: the host columns of the returned keys; ``None``: ``0 .. offset - 1``.

        Here (a :class:`KVCache`) the columns are always ``0 .. S - 1``; ``S > offset`` in a
        fixed-size view, whose slots past the offset the causal rule hides.
        """
        if self._pad is None and cols is None and chunk is None:
            return "causal", window
        assert self._bk is not None
        xp, dev = self._bk.xp, self._device
        S = self._offset if cols is None else cols.shape[0]
        q0 = self._offset - L  # column of the first query; keys at columns 0 .. S - 1
        mask = visible(
            xp, L, S, q_start=q0, window=window, chunk=chunk, pad=self._pad, device=dev
        )  # fmt: skip
        return (mask if self._pad is not None else xp.reshape(mask, (1, 1, L, S))), None
