"""paged_attention equals dense attention over each row's gathered keys, on every backend.

The pages of each row are scattered over the pool in a shuffled order, rows have unequal
lengths, and the other side is the float64 NumPy reference
(:func:`portable_llm.testing.reference.scaled_dot_product_attention`) of each row alone over its
keys in order, ``mask="causal"``: decode (``L = 1``) and chunked queries (``L > 1``), grouped
heads, sliding window, softcap. Invalid metadata is an error raised before any kernel runs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.attn.paged import paged_attention
from portable_llm.core.dispatch import dispatcher
from portable_llm.testing import assert_close, random_array, reference
from portable_llm.testing.strategies import SIDES, seeds

D = 8
LENS = (7, 13, 4)  # unequal rows: a partial last page, several pages, less than a page


class Scattered:
    """A pool holding ``lens[b]`` keys per row in shuffled pages, and the float64 copies."""

    def __init__(
        self,
        seed: int,
        lens: tuple[int, ...],
        *,
        page: int = 4,
        h_kv: int = 2,
        dtype: str = "float32",
        backend: str = "numpy",
        spare: int = 3,
    ) -> None:
        rng = np.random.default_rng(seed)
        need = [-(-n // page) for n in lens]
        total = sum(need) + spare  # spare pages: never read
        self.pool = pl.PagePool(total, page, h_kv, D, dtype, backend=backend)
        ids = self.pool.allocate(total)
        order = [ids[i] for i in rng.permutation(total)]
        width = max(need) + 1  # one padding column: entries past a row's pages are not read
        tables = np.zeros((len(lens), width), dtype=np.int32)
        self.k, self.v = [], []
        for b, n in enumerate(lens):
            pages, order = order[: need[b]], order[need[b] :]
            tables[b, : need[b]] = pages
            k, k64 = random_array(seed + 2 * b, (h_kv, n, D), dtype, backend=backend)
            v, v64 = random_array(seed + 2 * b + 1, (h_kv, n, D), dtype, backend=backend)
            self.pool.write(pages, 0, k, v)
            self.k.append(k64)
            self.v.append(v64)
        self.tables = pl.asarray(tables, backend=backend)
        self.lens = pl.asarray(np.asarray(lens, dtype=np.int32), backend=backend)

    def expected(self, q64: np.ndarray, **options: object) -> np.ndarray:
        """Each row's dense float64 attention over its own keys, bottom-right causal."""
        rows = [
            reference.scaled_dot_product_attention(
                q64[b : b + 1], self.k[b][None], self.v[b][None], mask="causal", **options
            )
            for b in range(q64.shape[0])
        ]
        return np.concatenate(rows, axis=0)


def _check(
    backend: str, dtype: str, L: int, H: int, h_kv: int, impl: str, **options: object
) -> None:
    s = Scattered(3, LENS, h_kv=h_kv, dtype=dtype, backend=backend)
    q, q64 = random_array(99, (len(LENS), H, L, D), dtype, backend=backend)
    out = paged_attention(q, s.pool, s.tables, s.lens, impl=impl, block_pages=2, **options)
    assert_close(
        out, s.expected(q64, **options), backend=backend, dtype=dtype, err_msg=f"{impl} {options}"
    )


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("impl", ["auto", "portable", "blocked", "pool"])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize(("H", "h_kv"), [(4, 2), (2, 2)])
@pytest.mark.parametrize(
    "options", [{}, {"window": 3}, {"softcap": 2.0}, {"window": 5, "softcap": 1.5, "scale": 0.3}]
)
def test_equals_dense(backend: str, impl: str, L: int, H: int, h_kv: int, options: dict) -> None:
    _check(backend, "float32", L, H, h_kv, impl, **options)


@pytest.mark.parametrize("L", [1, 4])
def test_equals_dense_grouped_window(backend: str, L: int) -> None:
    """The one case every backend runs in the default CI env (JAX included)."""
    _check(backend, "float32", L, 4, 2, "auto", window=3)


def test_dtype_kept(backend: str, dtype: str) -> None:
    """q's dtype comes back (bfloat16 and float16 included), within that dtype's tolerance."""
    _check(backend, dtype, 2, 4, 2, "auto")


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("impl", ["portable", "blocked", "pool"])
def test_dtype_kept_every_path(backend: str, dtype: str, impl: str) -> None:
    _check(backend, dtype, 2, 4, 2, impl, window=3)


def test_empty_queries(backend: str) -> None:
    """``B = 0`` or ``L = 0``: an empty result of q's shape and dtype."""
    s = Scattered(1, LENS, backend=backend)
    for shape in ((3, 4, 0, D), (0, 4, 1, D)):
        q, _ = random_array(2, shape, "float32", backend=backend)
        B = shape[0]
        tables = s.tables[:B, ...]
        lens = s.lens[:B] if shape[2] else s.lens * 0
        out = paged_attention(q, s.pool, tables, lens)
        assert_close(out, np.zeros(shape), backend=backend, dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("L", [1, 3])
def test_native_equals_portable(backend: str, dtype: str, L: int) -> None:
    bk = pl.get_backend(backend)
    nat = dispatcher(bk).native.get("paged_attention")
    if nat is None:
        pytest.skip(f"{backend} has no native paged_attention")
    if dtype not in bk.float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    s = Scattered(5, LENS, dtype=dtype, backend=backend)
    q, _ = random_array(7, (len(LENS), 4, L, D), dtype, backend=backend)
    if nat.applies is not None and not nat.applies(
        q, s.pool.k_pages, s.pool.v_pages, s.tables, s.lens, None, opts=_opts()
    ):
        pytest.skip(f"{backend}'s kernel does not apply to {dtype} here")
    for window in (None, 3):
        args = (q, s.pool, s.tables, s.lens)
        native = paged_attention(*args, window=window, impl="native")
        assert_close(native, paged_attention(*args, window=window, impl="portable"))


def _opts() -> object:
    from portable_llm.attn.paged_args import PagedOptions
    from portable_llm.attn.sdpa_args import SdpaOptions

    return PagedOptions(sdpa=SdpaOptions(scale=1.0))


def test_blocked_long_context_with_window(backend: str) -> None:
    """Many blocks of pages, the blocks left of every window skipped: blocked == portable."""
    s = Scattered(11, (70, 41), page=4, backend=backend, spare=0)
    q, q64 = random_array(12, (2, 4, 3, D), "float32", backend=backend)
    for window in (None, 9):
        out = paged_attention(q, s.pool, s.tables, s.lens, window=window, impl="blocked")
        assert_close(out, s.expected(q64, window=window), backend=backend, dtype="float32")


@given(
    seed=seeds(),
    lens=st.lists(st.sampled_from([1, 2, 5, 9, 16]), min_size=1, max_size=3),
    page=st.sampled_from([p for p in SIDES if p > 1]),
    L=st.sampled_from([1, 2]),
)
def test_property_pages_anywhere(seed: int, lens: list[int], page: int, L: int) -> None:
    """Where the pages lie does not matter, and keys past a row's length are never read:
    the result equals the dense reference whatever the shuffle, with garbage after each row."""
    lens = [max(n, L) for n in lens]
    s = Scattered(seed, tuple(lens), page=page)
    # Garbage in the unused slots of each row's last page (positions >= its length).
    tables = pl.to_numpy(s.tables)
    for b, n in enumerate(lens):
        if n % page:
            junk = np.full((2, page - n % page, D), 1e4, dtype=np.float32)
            s.pool.write_checked([int(tables[b, n // page])], n % page, junk, junk)
    q, q64 = random_array(seed % 1000, (len(lens), 2, L, D), "float32")
    out = paged_attention(q, s.pool, s.tables, s.lens)
    assert_close(out, s.expected(q64), dtype="float32")


# -- invalid metadata: a clear error, before any kernel runs ------------------------------------


@pytest.fixture
def spy() -> object:
    """A user kernel registered for NumPy that records each call (and must never be reached)."""
    calls: list[int] = []

    def kernel(xp: object, *arrays: object, **options: object) -> object:
        calls.append(1)
        raise AssertionError("the kernel ran")

    pl.register_kernel("numpy", "paged_attention", kernel, kernel="spy")
    yield calls
    pl.unregister_kernel("numpy", "paged_attention")


def _bad(s: Scattered, q: object, tables: object, lens: object, match: str, err: type) -> None:
    with pytest.raises(err, match=match):
        paged_attention(q, s.pool, tables, lens)


def test_invalid_metadata(spy: list[int]) -> None:
    s = Scattered(1, LENS)
    q, _ = random_array(2, (3, 4, 2, D), "float32")
    t = pl.to_numpy(s.tables)
    n = np.asarray(LENS, dtype=np.int32)
    _bad(
        s,
        q,
        t,
        np.asarray([7, -1, 4], dtype=np.int32),
        r"context_lens\[1\] = -1 is negative",
        ValueError,
    )
    _bad(
        s,
        q,
        t,
        np.asarray([7, 13, 1], dtype=np.int32),
        r"context_lens\[2\] = 1 is shorter than the query length L=2",
        ValueError,
    )
    past = t.copy()
    past[1, 2] = s.pool.num_pages
    _bad(
        s,
        q,
        past,
        n,
        rf"block_tables\[1, 2\] = {s.pool.num_pages} is not a page of the pool",
        ValueError,
    )
    _bad(
        s,
        q,
        t[:, :2],
        n,
        r"context_lens\[1\] = 13 needs 4 pages .* block_tables has shape \(3, 2\)",
        ValueError,
    )
    _bad(
        s,
        q,
        t[:2],
        n,
        r"block_tables \(2, 5\) and context_lens \(3,\) must have q's batch size B=3",
        ValueError,
    )
    _bad(s, q, t, n[:2], r"must have q's batch size B=3", ValueError)
    q3, _ = random_array(2, (3, 3, 2, D), "float32")
    _bad(s, q3, t, n, r"heads H=3 must be a multiple of the pool's H_kv=2", ValueError)
    q16, _ = random_array(2, (3, 4, 2, D), "float16")
    _bad(s, q16, t, n, r"q \(float16.*pool's pages \(float32.*must share one dtype", TypeError)
    _bad(s, q, t.astype(np.float32), n, r"block_tables must be an integer array", TypeError)
    qd, _ = random_array(2, (3, 4, 2, D + 1), "float32")
    _bad(s, qd, t, n, r"differ in D", ValueError)
    with pytest.raises(TypeError, match="pool must have k_pages and v_pages"):
        paged_attention(q, object(), t, n)
    assert spy == []


def test_pages_of_no_tokens_are_refused(spy: list[int]) -> None:
    """A pool whose pages hold 0 tokens (any object with k_pages and v_pages) is a ValueError
    naming page_size, not NumPy's division by zero and empty reduction."""

    class Pool:
        k_pages = np.zeros((4, 2, 0, D), dtype=np.float32)
        v_pages = np.zeros((4, 2, 0, D), dtype=np.float32)

    q, _ = random_array(2, (1, 4, 1, D), "float32")
    tables, lens = np.zeros((1, 2), dtype=np.int32), np.asarray([1], dtype=np.int32)
    for impl in ("auto", "portable", "blocked", "pool"):
        with pytest.raises(ValueError, match=r"page_size >= 1 tokens, got page_size=0"):
            paged_attention(q, Pool(), tables, lens, impl=impl)
    assert spy == []


def test_unused_entries_are_not_read() -> None:
    """Table entries past a row's pages may hold anything (here: ids past the pool, -1)."""
    s = Scattered(4, LENS)
    q, q64 = random_array(5, (3, 4, 1, D), "float32")
    t = pl.to_numpy(s.tables)
    t[0, 2:] = s.pool.num_pages + 7  # row 0 uses 2 pages
    t[2, 1:] = -1  # row 2 uses 1 page
    out = paged_attention(q, s.pool, t, s.lens)
    assert_close(out, s.expected(q64), dtype="float32")


# -- which path auto takes, and pages shared by rows ---------------------------------------------


def _impl_taken(q: object, s: Scattered) -> str:
    with pl.trace() as t:
        paged_attention(q, s.pool, s.tables, s.lens)
    return next(e.impl for e in t if e.op == "paged_attention")


def _auto_args(backend: str, q: object, s: Scattered, **options: object) -> tuple:
    """The arrays and options ``impl="auto"`` runs with; ``args[5]``, the page map, is not
    None where the pool-wide path is to run."""
    from portable_llm.attn.paged_args import OP, paged_args

    kw: dict[str, object] = {"scale": None, "window": None, "softcap": None, "block_pages": 16}
    kw.update(options)
    bk = pl.get_backend(backend)
    return paged_args(
        OP, bk, q, s.pool.k_pages, s.pool.v_pages, s.tables, s.lens, impl="auto", **kw
    )


def _pool_wide(backend: str, q: object, s: Scattered) -> str:
    """The impl ``auto`` runs the pool-wide path as: a native kernel that takes the page map
    (torch's, in place), else the portable ``"pool"``."""
    nat = dispatcher(pl.get_backend(backend)).native.get("paged_attention")
    args, opts = _auto_args(backend, q, s)
    return "native" if nat is not None and nat.auto(*args, **opts) else "pool"


def test_auto_takes_pool_for_decode_over_a_full_pool(backend: str) -> None:
    full = Scattered(6, LENS, spare=0, backend=backend)  # 7 of 7 pages used
    sparse = Scattered(6, LENS, spare=20, backend=backend)  # 7 of 27
    q1, _ = random_array(1, (3, 4, 1, D), "float32", backend=backend)  # G * L = 2 <= P = 4
    q3, _ = random_array(1, (3, 4, 3, D), "float32", backend=backend)  # G * L = 6 > P
    assert _auto_args(backend, q1, full)[0][5] is not None
    assert _auto_args(backend, q1, sparse)[0][5] is None
    assert _auto_args(backend, q3, full)[0][5] is None
    assert _impl_taken(q1, full) == _pool_wide(backend, q1, full)
    assert _impl_taken(q1, sparse) != "pool"
    assert _impl_taken(q3, full) != "pool"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("H, L", [(4, 1), (2, 2)])  # G * L = 2 <= P = 4: decode, 2 queries
def test_auto_over_a_full_pool_equals_reference(
    backend: str, dtype: str, window: object, H: int, L: int
) -> None:
    """Decode over a full pool: what auto runs there (the portable pool-wide path, or a
    native kernel's own form of it: torch's, in place) against the float64 reference and
    against impl="pool"."""
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    s = Scattered(8, LENS, spare=0, dtype=dtype, backend=backend)
    q, q64 = random_array(9, (3, H, L, D), dtype, backend=backend)
    assert _auto_args(backend, q, s, window=window)[0][5] is not None
    out = paged_attention(q, s.pool, s.tables, s.lens, window=window)
    want = s.expected(q64, window=window)
    assert_close(out, want, backend=backend, dtype=dtype, err_msg=f"auto, window {window}")
    pool = paged_attention(q, s.pool, s.tables, s.lens, window=window, impl="pool")
    assert_close(out, pool, backend=backend, dtype=dtype, err_msg=f"auto vs pool, {window}")


def test_rows_sharing_pages() -> None:
    """Two rows over one prompt's pages (a shared prefix) and a page each of their own: the
    gather paths attend them; impl="pool", which needs one owner per page, refuses."""
    pool = pl.PagePool(4, 4, 2, D, "float32")
    pages = pool.allocate(4)
    k, k64 = random_array(1, (2, 12, D), "float32")
    v, v64 = random_array(2, (2, 12, D), "float32")
    k1, k1_64 = random_array(3, (2, 4, D), "float32")
    v1, v1_64 = random_array(4, (2, 4, D), "float32")
    pool.write(pages[:3], 0, k, v)  # the prefix (8 tokens) and row 0's own page
    pool.write([pages[0], pages[1], pages[3]], 8, k1, v1)  # row 1's own page
    tables = np.asarray([pages[:3], [pages[0], pages[1], pages[3]]], dtype=np.int32)
    lens = np.asarray([10, 11], dtype=np.int32)
    q, q64 = random_array(5, (2, 4, 1, D), "float32")
    rows = [
        (k64[:, :10], v64[:, :10]),
        (
            np.concatenate([k64[:, :8], k1_64[:, :3]], 1),
            np.concatenate([v64[:, :8], v1_64[:, :3]], 1),
        ),
    ]
    want = np.concatenate(
        [
            reference.scaled_dot_product_attention(
                q64[b : b + 1], kb[None], vb[None], mask="causal"
            )
            for b, (kb, vb) in enumerate(rows)
        ]
    )
    assert_close(paged_attention(q, pool, tables, lens), want, dtype="float32")
    with pytest.raises(ValueError, match="impl='pool' needs each page in at most one row"):
        paged_attention(q, pool, tables, lens, impl="pool")


# -- any integer dtype of the metadata ------------------------------------------------------------


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize(
    "index_dtype", ["uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"]
)
@pytest.mark.parametrize("impl", ["auto", "portable", "blocked", "pool"])
def test_any_integer_dtype(
    backend: str, index_dtype: str, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables and lengths of every integer dtype give the float64 reference on every path.

    Chunked prefill (``L = 3``) with blocks past the first: the blocked path computes each
    block's ``context_lens - L - first``, which wrapped for unsigned lengths (wrong by 1.4-3.7),
    and torch has no arithmetic for uint16/uint32. ``auto`` is made to take the blocked path
    (where no native kernel applies) by lowering its threshold.
    """
    from portable_llm.attn import paged

    monkeypatch.setattr(paged, "BLOCKED_MIN_KEYS", 1)
    s = Scattered(3, LENS, backend=backend)
    q, q64 = random_array(99, (len(LENS), 4, 3, D), "float32", backend=backend)
    lens = pl.asarray(np.asarray(LENS, dtype=index_dtype), backend=backend)
    tables = pl.asarray(pl.to_numpy(s.tables).astype(index_dtype), backend=backend)
    out = paged_attention(q, s.pool, tables, lens, impl=impl, block_pages=1)
    assert_close(out, s.expected(q64), backend=backend, dtype="float32", err_msg=index_dtype)
