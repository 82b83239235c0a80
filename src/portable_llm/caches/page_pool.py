"""The page pool of a paged KV cache: fixed-size pages of one layer, shared by many sequences.

A :class:`PagePool` holds the keys and values of one layer for many sequences in two arrays
``(num_pages, H_kv, page_size, D)`` (vLLM's layout: page, head, slot, dim). A sequence owns a
list of page ids, its *block table*: token ``t`` lives in page ``block_table[t // page_size]``,
slot ``t % page_size``. Pages are handed out lowest-free-first and come back when a sequence
ends or is rewound, so the memory a sequence holds is its length rounded up to one page.

Pages are reference counted: :meth:`PagePool.share` lets a second holder (another sequence, a
prefix cache) keep a page that is already allocated, and :meth:`PagePool.free` gives one
reference back; a page returns to the free list when its last holder frees it. A holder that
must write into a page others also hold copies it first (:meth:`PagePool.copy`).

:class:`~portable_llm.caches.paged.PagedKVCache` is one sequence of one layer, with the
:class:`~portable_llm.KVCache` interface the model uses, and
:func:`~portable_llm.caches.paged.block_tables` packs the tables of a batch for
:func:`~portable_llm.paged_attention`.
Writes go through the backend's :meth:`~portable_llm.backends.Backend.set_slice` (a slice
assignment; a donated ``dynamic_update_slice`` on JAX), one per page touched. Every write checks
its arguments first and mutates nothing when they are wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_llm.backends import TOP_MODULES, Backend, get_backend, resolve
from portable_llm.core.checks import check_float, check_int, check_optional_int

__all__ = ["PagePool", "PagePoolExhausted"]


class PagePoolExhausted(RuntimeError):
    """A :class:`PagePool` has fewer free pages than asked for (nothing was allocated)."""


def _backend(dtype: Any, backend: Any) -> Backend:
    """``backend`` if given, else the library of a dtype object (by its type's module, never
    by comparing dtypes of two libraries), else NumPy."""
    if backend is not None:
        return get_backend(backend)
    name = TOP_MODULES.get(type(dtype).__module__.split(".")[0])
    return get_backend(name if name is not None else "numpy")


class PagePool:
    """The key and value pages of one layer, shared by the sequences of a batch.

    Parameters
    ----------
    num_pages : int, >= 1
        Pages allocated up front (:meth:`grow` adds more).
    page_size : int, >= 1
        Tokens per page.
    num_kv_heads, head_dim : int, >= 1
        ``H_kv`` and ``D``.
    dtype : str or dtype
        A float dtype name (``"float32"``, ``"bfloat16"``, ...) or the backend's dtype object.
    backend : str, optional
        Default: the library of a ``dtype`` object (torch, MLX, array-api-strict), else NumPy
        (JAX's dtype objects are NumPy's: give ``backend="jax"``).
    device : optional
        The backend's device (``"cpu"``, ``"cuda:0"``, ...); default: the backend's default.
        On JAX a replicated ``NamedSharding`` of a 1-axis mesh (a tensor-parallel model's
        device) splits the pages along ``H_kv`` over the mesh where its size divides ``H_kv``
        (:meth:`~portable_llm.backends.Backend.split_heads`): each device holds its heads.

    Attributes
    ----------
    k_pages, v_pages : arrays, shape ``(num_pages, H_kv, page_size, D)``
        The pages (replaced, not mutated, on JAX: read them again after a write).
    num_free : int
        Pages not allocated.

    Notes
    -----
    Not thread-safe: one thread allocates, shares and frees (as a batch generator does).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        *,
        backend: str | None = None,
        device: Any = None,
    ) -> None:
        name = "PagePool"
        n = check_int(name, "num_pages", num_pages, low=1)
        self.page_size = check_int(name, "page_size", page_size, low=1)
        self.num_kv_heads = check_int(name, "num_kv_heads", num_kv_heads, low=1)
        self.head_dim = check_int(name, "head_dim", head_dim, low=1)
        bk = _backend(dtype, backend)
        self.backend = bk
        self.device = bk.device(device)
        self.dtype = bk.dtype(dtype, self.device)
        if self.dtype not in bk.float_set:
            raise TypeError(f"{name}: dtype must be a float dtype, got {bk.dtype_name(self.dtype)}")
        self.k_pages = self._zeros(n)
        self.v_pages = self._zeros(n)
        self._free: list[int] = list(range(n))  # kept sorted: lowest id first
        self._refs = np.zeros(n, dtype=np.int64)  # holders of each page; 0: free

    def _zeros(self, n: int) -> Any:
        shape = (n, self.num_kv_heads, self.page_size, self.head_dim)
        # On a JAX mesh (a tensor-parallel model's replicated device): split by heads.
        where = self.backend.split_heads(self.device, shape, 1)
        # computed now: a pool made in one thread is written in another (the server's engine
        # thread), and MLX evaluates a lazy array on a stream of the thread that made it
        return self.backend.synchronize(
            self.backend.xp.zeros(shape, dtype=self.dtype, device=where)
        )

    @property
    def num_pages(self) -> int:
        """Pages in the pool, free or not."""
        return int(self._refs.shape[0])

    @property
    def num_free(self) -> int:
        """Pages not allocated."""
        return len(self._free)

    def __repr__(self) -> str:
        return (
            f"PagePool(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"H_kv={self.num_kv_heads}, D={self.head_dim}, "
            f"dtype={self.backend.dtype_name(self.dtype)}, backend={self.backend.name!r}, "
            f"free={self.num_free})"
        )

    # -- pages ----------------------------------------------------------------------------------
    def allocate(self, n: int, /) -> list[int]:
        """``n`` free page ids, lowest first; :class:`PagePoolExhausted` (nothing allocated)
        when fewer than ``n`` are free."""
        n = check_int("PagePool.allocate", "n", n, low=0)
        if n > len(self._free):
            raise PagePoolExhausted(
                f"PagePool.allocate: {n} pages asked for, {len(self._free)} free of "
                f"{self.num_pages} (grow() the pool or release finished sequences)"
            )
        got, self._free = self._free[:n], self._free[n:]
        self._refs[got] = 1
        return got

    def _allocated(self, op: str, pages: Sequence[int]) -> list[int]:
        """``pages`` as ints, checked: allocated ids of the pool, none repeated."""
        ids = [check_int(op, "pages[i]", p) for p in pages]
        for p in ids:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"{op}: page {p} is not in the pool (0 .. {self.num_pages - 1})")
            if self._refs[p] == 0:
                raise ValueError(f"{op}: page {p} is not allocated (double free?)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{op}: pages {ids} repeat an id")
        return ids

    def free(self, pages: Sequence[int], /) -> None:
        """Give one reference to each of ``pages`` back; a page whose last reference goes is
        free again. ``ValueError`` (nothing freed) for an unknown, repeated or free id."""
        ids = self._allocated("PagePool.free", pages)
        self._refs[ids] -= 1
        back = [p for p in ids if self._refs[p] == 0]
        if back:
            self._free = sorted(self._free + back)

    def share(self, pages: Sequence[int], /) -> None:
        """Add a holder to each of ``pages`` (allocated ids): each is then freed once more
        before it returns to the free list. ``ValueError`` (nothing changed) for an unknown,
        repeated or free id."""
        ids = self._allocated("PagePool.share", pages)
        self._refs[ids] += 1

    def refcount(self, page: int, /) -> int:
        """The holders of ``page`` (0: free)."""
        page = check_int("PagePool.refcount", "page", page, low=0, high=self.num_pages - 1)
        return int(self._refs[page])

    def copy(self, page: int, /) -> int:
        """A new page (one holder) with the keys and values of ``page`` (copy on write: the
        caller then writes into its own copy); :class:`PagePoolExhausted` when none is free."""
        (src,) = self._allocated("PagePool.copy", [page])
        (dst,) = self.allocate(1)
        bk = self.backend
        for name in ("k_pages", "v_pages"):
            pages = getattr(self, name)
            setattr(self, name, bk.set_slice(pages, (dst, 0, 0, 0), pages[src : src + 1, ...]))
        return dst

    def grow(self, num_pages: int | None = None, /) -> None:
        """Enlarge the pool to ``num_pages`` pages (default: double); contents and ids are kept."""
        old = self.num_pages
        new = check_optional_int("PagePool.grow", "num_pages", num_pages, low=old)
        new = 2 * old if new is None else new
        bk = self.backend
        self.k_pages = bk.set_slice(self._zeros(new), (0, 0, 0, 0), self.k_pages)
        self.v_pages = bk.set_slice(self._zeros(new), (0, 0, 0, 0), self.v_pages)
        self._refs = np.concatenate([self._refs, np.zeros(new - old, dtype=np.int64)])
        self._free = self._free + list(range(old, new))

    # -- tokens ---------------------------------------------------------------------------------
    def check_chunk(self, op: str, k: Any, v: Any, heads_axis: int = 0) -> tuple[Any, Any]:
        """``k, v`` on the pool's backend, checked: float, the pool's dtype, ``(.., H_kv, L, D)``
        with ``L >= 1`` from ``heads_axis`` on, v shaped as k."""
        bk, (k, v) = resolve(op, None, k, v)
        for name, a in (("k", k), ("v", v)):
            check_float(op, name, a, bk)
            self.check_layout(op, bk, tuple(a.shape), a.dtype, heads_axis, name=name)
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"{op}: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        return k, v

    def check_layout(
        self, op: str, backend: Any, shape: tuple[int, ...], dtype: Any, heads_axis: int = 0,
        *, name: str = "k",
    ) -> None:  # fmt: skip
        """Raise what :meth:`check_chunk` raises for a chunk of this ``backend``, ``shape``
        and ``dtype``: the pool's library and dtype, ``(.., H_kv, L >= 1, D)`` from
        ``heads_axis`` on (ones before it)."""
        if backend is not self.backend:
            raise TypeError(
                f"{op}: the pool holds {self.backend.name} arrays, got {backend.name} arrays"
            )
        if dtype != self.dtype:
            raise TypeError(
                f"{op}: the pool holds {backend.dtype_name(self.dtype)}, got {name} of dtype "
                f"{backend.dtype_name(dtype)} with shape {shape}"
            )
        H, D = self.num_kv_heads, self.head_dim
        if (
            len(shape) != heads_axis + 3
            or shape[:heads_axis] != (1,) * heads_axis
            or shape[heads_axis] != H
            or shape[-1] != D
            or shape[-2] < 1
        ):
            lead = "1, " * heads_axis
            raise ValueError(
                f"{op}: {name} must have shape ({lead}H_kv={H}, L >= 1, D={D}), got {shape}"
            )

    def check_pages(self, op: str, pages: Sequence[int], end: int, /) -> list[int]:
        """``pages`` as ints, checked to cover positions ``0 .. end - 1`` with allocated pages
        of this pool (a ``ValueError`` naming ``op`` otherwise): what :meth:`write_checked`
        takes."""
        ids = [int(p) for p in pages]
        need = -(-end // self.page_size)
        if need > len(ids):
            raise ValueError(
                f"{op}: positions up to {end - 1} need {need} pages of {self.page_size}, "
                f"got {len(ids)} pages"
            )
        for p in ids[:need]:
            if not 0 <= p < self.num_pages or self._refs[p] == 0:
                raise ValueError(f"{op}: page {p} is not an allocated page of the pool")
        return ids

    def write(self, pages: Sequence[int], start: int, k: Any, v: Any, /) -> None:
        """Write ``k, v`` ``(H_kv, L, D)`` at token positions ``start .. start + L - 1`` of the
        sequence whose pages, in order, are ``pages``.

        Everything is checked first (dtype, shape, positions covered by allocated pages):
        on error nothing is written.
        """
        op = "PagePool.write"
        start = check_int(op, "start", start, low=0)
        k, v = self.check_chunk(op, k, v)
        L = int(k.shape[1])
        self.write_checked(self.check_pages(op, pages, start + L), start, k, v)

    def write_checked(self, ids: list[int], start: int, k: Any, v: Any, /) -> None:
        """Write ``k, v`` ``(H_kv, L, D)`` (checked by :meth:`check_chunk`) at positions
        ``start ..`` of the pages ``ids`` (checked by :meth:`check_pages`): one ``set_slice``
        per page touched. The unchecked half of :meth:`write`, for a cache that checked once."""
        bk, P, L = self.backend, self.page_size, int(k.shape[1])
        t = start
        while t < start + L:
            page, slot = ids[t // P], t % P
            n = min(P - slot, start + L - t)
            i = t - start
            kc = k[None, :, i : i + n, :]  # (1, H_kv, n, D)
            vc = v[None, :, i : i + n, :]
            self.k_pages = bk.set_slice(self.k_pages, (page, 0, slot, 0), kc)
            self.v_pages = bk.set_slice(self.v_pages, (page, 0, slot, 0), vc)
            t += n

    def gather(self, pages: Sequence[int], length: int, /) -> tuple[Any, Any]:
        """The first ``length`` tokens of a sequence's pages, contiguous: ``(k, v)``, each
        ``(H_kv, length, D)``."""
        op = "PagePool.gather"
        length = check_int(op, "length", length, low=0)
        ids = self.check_pages(op, pages, length)
        need = -(-length // self.page_size)
        bk, xp = self.backend, self.backend.xp
        H, D = self.num_kv_heads, self.head_dim
        if need == 0:
            empty = xp.zeros((H, 0, D), dtype=self.dtype, device=self.device)
            return empty, empty
        idx = bk.from_numpy(np.asarray(ids[:need], dtype=np.int64), self.device)
        out = []
        for pages_arr in (self.k_pages, self.v_pages):
            g = xp.take(pages_arr, idx, axis=0)  # (n, H_kv, P, D)
            g = xp.reshape(xp.permute_dims(g, (1, 0, 2, 3)), (H, need * self.page_size, D))
            out.append(g[:, :length, :])  # (H_kv, length, D)
        return out[0], out[1]
