"""PagePool and PagedKVCache: pages allocated, freed and reused; writes that fail mutate
nothing; a paged cache gives a model the logits of a KVCache.

The keys a paged cache returns are compared with those a :class:`~portable_llm.KVCache` returns
for the same chunks (exactly: both are copies of the same values), and a tiny random model's
logits over paged caches with those over its own caches.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.caches.paged import block_tables
from portable_llm.testing import assert_close, random_array
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from portable_llm.testing.strategies import seeds

H_KV, D, P = 2, 4, 4


def _pool(backend: str, pages: int = 8, dtype: str = "float32") -> pl.PagePool:
    return pl.PagePool(pages, P, H_KV, D, dtype, backend=backend)


def _chunk(seed: int, L: int, backend: str, dtype: str = "float32") -> tuple[object, object]:
    k, _ = random_array(seed, (1, H_KV, L, D), dtype, backend=backend)
    v, _ = random_array(seed + 1, (1, H_KV, L, D), dtype, backend=backend)
    return k, v


def _state(cache: pl.PagedKVCache) -> tuple:
    pool = cache.pool
    return (
        pl.to_numpy(pool.k_pages).copy(),
        pl.to_numpy(pool.v_pages).copy(),
        list(cache.block_table),
        cache.offset,
        pool.num_free,
    )


def _same_state(before: tuple, after: tuple) -> None:
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    assert before[2:] == after[2:]


# -- the pool -----------------------------------------------------------------------------------


def test_pool_arguments(backend: str) -> None:
    bk = pl.get_backend(backend)
    # The backend from the dtype object, except JAX's, which are NumPy's dtype objects.
    given = {"backend": "jax"} if backend == "jax" else {}
    pool = pl.PagePool(2, 4, 1, 2, bk.dtypes["float32"], **given)
    assert pool.backend is bk and pool.dtype == bk.dtypes["float32"]
    assert tuple(pool.k_pages.shape) == tuple(pool.v_pages.shape) == (2, 1, 4, 2)
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        pl.PagePool(0, 4, 1, 2, "float32", backend=backend)
    with pytest.raises(TypeError, match="dtype must be a float dtype"):
        pl.PagePool(2, 4, 1, 2, "int32", backend=backend)
    with pytest.raises(TypeError, match="pool must be a PagePool"):
        pl.PagedKVCache(object())


def test_allocate_free_reuse() -> None:
    pool = _pool("numpy", pages=6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    with pytest.raises(pl.PagePoolExhausted, match="2 pages asked for, 1 free of 6"):
        pool.allocate(2)
    assert pool.num_free == 1  # nothing allocated by the failed call
    pool.free([3, 1])
    assert pool.num_free == 3
    assert pool.allocate(3) == [1, 3, 5]  # freed pages come back, lowest first
    with pytest.raises(ValueError, match="page 9 is not in the pool"):
        pool.free([0, 9])
    pool.free([0])
    with pytest.raises(ValueError, match="page 0 is not allocated"):
        pool.free([2, 0])
    assert pool.num_free == 1  # page 2 was not freed by the failed call
    with pytest.raises(ValueError, match="repeat"):
        pool.free([2, 2])
    assert issubclass(pl.PagePoolExhausted, RuntimeError)


def test_grow_keeps_contents_and_ids(backend: str) -> None:
    pool = _pool(backend, pages=2)
    cache = pl.PagedKVCache(pool)
    k, v = _chunk(1, 7, backend)
    cache.append(k, v)
    assert pool.num_free == 0
    pool.grow()
    assert (pool.num_pages, pool.num_free) == (4, 2)
    assert tuple(pool.k_pages.shape) == (4, H_KV, P, D)
    k_all, v_all = pool.gather(cache.block_table, 7)
    assert_close(k_all, k[0, ...], rtol=0, atol=0)
    assert_close(v_all, v[0, ...], rtol=0, atol=0)
    pool.grow(7)
    assert (pool.num_pages, pool.num_free) == (7, 5)
    with pytest.raises(ValueError, match="num_pages must be >= 7"):
        pool.grow(3)


def test_write_gather_across_pages(backend: str) -> None:
    """A chunk that starts mid-page and spans three pages, in a scattered order."""
    pool = _pool(backend)
    pages = [pool.allocate(1)[0] for _ in range(4)][::-1]  # [3, 2, 1, 0]
    k, k64 = random_array(3, (H_KV, 9, D), "float32", backend=backend)
    v, v64 = random_array(4, (H_KV, 9, D), "float32", backend=backend)
    head_k, head_v = _chunk(5, 2, backend)
    pool.write(pages, 0, head_k[0, ...], head_v[0, ...])
    pool.write(pages, 2, k, v)
    got_k, got_v = pool.gather(pages, 11)
    want_k = np.concatenate([pl.to_numpy(head_k)[0], k64], axis=1)
    want_v = np.concatenate([pl.to_numpy(head_v)[0], v64], axis=1)
    assert_close(got_k, want_k, backend=backend, dtype="float32", rtol=0, atol=0)
    assert_close(got_v, want_v, backend=backend, dtype="float32", rtol=0, atol=0)
    np.testing.assert_array_equal(pl.to_numpy(pool.k_pages)[3, :, :2], pl.to_numpy(head_k)[0])


def test_failed_pool_write_mutates_nothing(backend: str) -> None:
    pool = _pool(backend)
    pages = pool.allocate(2)
    k, v = _chunk(1, 3, backend)
    pool.write(pages, 0, k[0, ...], v[0, ...])
    before = (pl.to_numpy(pool.k_pages).copy(), pl.to_numpy(pool.v_pages).copy())
    k6, v6 = _chunk(2, 6, backend)
    with pytest.raises(ValueError, match="positions up to 8 need 3 pages of 4, got 2 pages"):
        pool.write(pages, 3, k6[0, ...], v6[0, ...])
    with pytest.raises(ValueError, match="page 5 is not an allocated page"):
        pool.write([pages[0], 5], 3, k[0, ...], v[0, ...])
    with pytest.raises(ValueError, match=r"k must have shape \(H_kv=2, L >= 1, D=4\)"):
        pool.write(pages, 0, k, v)
    np.testing.assert_array_equal(pl.to_numpy(pool.k_pages), before[0])
    np.testing.assert_array_equal(pl.to_numpy(pool.v_pages), before[1])


# -- the cache ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_and_fetch_equals_kvcache(backend: str, dtype: str) -> None:
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    pool = _pool(backend, pages=6, dtype=dtype)
    pool.allocate(1)  # another sequence's page: the cache's pages do not start at 0
    paged, dense = pl.PagedKVCache(pool), pl.KVCache(step=4)
    for i, L in enumerate((5, 1, 1, 6, 2)):
        k, v = _chunk(10 * i, L, backend, dtype)
        got, want = paged.update_and_fetch(k, v), dense.update_and_fetch(k, v)
        assert_close(got[0], want[0], rtol=0, atol=0)
        assert_close(got[1], want[1], rtol=0, atol=0)
        assert paged.make_mask() == ("causal", None) == dense.make_mask()
        assert paged.make_mask(window=3) == ("causal", 3)
    assert paged.offset == 15
    assert paged.block_table == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", ["dtype", "shape", "batch", "exhausted"])
def test_failed_update_mutates_nothing(backend: str, bad: str) -> None:
    pool = _pool(backend, pages=3)
    cache = pl.PagedKVCache(pool)
    cache.update_and_fetch(*_chunk(1, 5, backend))
    before = _state(cache)
    if bad == "dtype":
        k, v = _chunk(2, 2, backend, "float64")
        match, err = "the pool holds float32", TypeError
    elif bad == "shape":
        k, _ = random_array(2, (1, H_KV, 2, D + 1), "float32", backend=backend)
        v = k
        match, err = r"k must have shape \(1, H_kv=2, L >= 1, D=4\)", ValueError
    elif bad == "batch":
        k, _ = random_array(2, (2, H_KV, 2, D), "float32", backend=backend)
        v = k
        match, err = r"got \(2, 2, 2, 4\)", ValueError
    else:
        k, v = _chunk(2, 8, backend)  # 13 tokens need 4 pages; the pool has 3
        match, err = "2 pages asked for, 1 free of 3", pl.PagePoolExhausted
    for method in (cache.update_and_fetch, cache.append):
        with pytest.raises(err, match=match):
            method(k, v)
        _same_state(before, _state(cache))


def test_trim_release_reserve(backend: str) -> None:
    pool = _pool(backend, pages=5)
    cache = pl.PagedKVCache(pool)
    k, v = _chunk(1, 10, backend)
    cache.append(k, v)
    assert cache.block_table == [0, 1, 2]
    assert cache.trim(5) == 5
    assert (cache.offset, cache.block_table, pool.num_free) == (5, [0, 1], 3)  # page 2 released
    with pytest.raises(ValueError, match="make_mask: no update since"):
        cache.make_mask()
    with pytest.raises(ValueError, match="n=6 exceeds the tokens in the cache"):
        cache.trim(6)
    k2, v2 = _chunk(3, 4, backend)
    got_k, _ = cache.update_and_fetch(k2, v2)  # overwrites positions 5 ..
    want = np.concatenate([pl.to_numpy(k)[:, :, :5], pl.to_numpy(k2)], axis=2)
    assert_close(got_k, want, backend=backend, dtype="float32", rtol=0, atol=0)
    cache.reserve(7)  # 9 + 7 = 16 tokens: 4 pages
    assert (cache.block_table, cache.offset, pool.num_free) == ([0, 1, 2, 3], 9, 1)
    with pytest.raises(pl.PagePoolExhausted):
        cache.reserve(20)
    assert (cache.block_table, pool.num_free) == ([0, 1, 2, 3], 1)
    cache.release()
    assert (cache.block_table, cache.offset, pool.num_free) == ([], 0, 5)


def test_pool_wastes_less_than_a_page_per_sequence(backend: str) -> None:
    lens = [1, 4, 5, 17, 30, 64]
    pool = _pool(backend, pages=64)
    caches = [pl.PagedKVCache(pool) for _ in lens]
    for i, (c, n) in enumerate(zip(caches, lens, strict=True)):
        c.append(*_chunk(i, n, backend))
    for c, n in zip(caches, lens, strict=True):
        assert 0 <= c.capacity - n < P
    used = pool.num_pages - pool.num_free
    assert used * P - sum(lens) < P * len(lens)
    tables, ctx = block_tables(caches)
    assert pl.to_numpy(ctx).tolist() == lens
    t = pl.to_numpy(tables)
    assert t.dtype == np.int32 and t.shape == (len(lens), 16)
    for b, c in enumerate(caches):
        assert t[b, : len(c.block_table)].tolist() == c.block_table
        assert not t[b, len(c.block_table) :].any()


def test_block_tables_errors() -> None:
    a, b = _pool("numpy"), _pool("numpy")
    with pytest.raises(ValueError, match="another pool"):
        block_tables([pl.PagedKVCache(a), pl.PagedKVCache(b)])
    with pytest.raises(ValueError, match="caches is empty"):
        block_tables([])
    with pytest.raises(TypeError, match=r"caches\[0\] must be a PagedKVCache"):
        block_tables([pl.KVCache()])


@given(seed=seeds(), sizes=st.lists(st.sampled_from([1, 2, 3, 5, 8]), min_size=1, max_size=5))
def test_property_chunks_then_trim(seed: int, sizes: list[int]) -> None:
    """Any sequence of chunks (and a trim back to any point) gathers to the concatenation."""
    pool = _pool("numpy", pages=1)
    cache = pl.PagedKVCache(pool)
    ks = []
    for i, L in enumerate(sizes):
        k, v = _chunk(seed % 10_000 + 2 * i, L, "numpy")
        while pool.num_free * P < cache.offset + L - cache.capacity:
            pool.grow()
        cache.append(k, v)
        ks.append(pl.to_numpy(k))
    full = np.concatenate(ks, axis=2)
    n = seed % (cache.offset + 1)
    cache.trim(n)
    got, _ = pool.gather(cache.block_table, cache.offset)
    np.testing.assert_array_equal(pl.to_numpy(got), full[0, :, : cache.offset])
    assert len(cache.block_table) == -(-cache.offset // P)


# -- a model over paged caches ------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for family in ("llama", "mistral"):
        folder = tmp_path_factory.mktemp(f"paged_{family}")
        write_checkpoint(folder, tiny_config(family), seed=7)
        out[family] = folder
    return out


def _paged_caches(model: pl.Model, pages: int = 16) -> list[pl.PagedKVCache]:
    c = model.config
    return [
        pl.PagedKVCache(
            pl.PagePool(
                pages, 4, c.num_key_value_heads, c.head_dim, model.dtype, backend=model.backend.name
            )
        )
        for _ in range(c.num_hidden_layers)
    ]


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_model_logits_equal_kvcache(backend: str, folders: dict, family: str) -> None:
    model = pl.load(folders[family], backend=backend, dtype="float32")
    op_by_op = copy.copy(model)  # the public ops, each checking the cache it is given
    op_by_op.prepared = op_by_op.compiled = None
    ids = np.random.default_rng(0).integers(3, 300, size=(1, 14))
    for m in (model, op_by_op):
        ours, theirs = _paged_caches(m), m.make_cache()
        for chunk in (ids[:, :9], ids[:, 9:10], ids[:, 10:13], ids[:, 13:]):
            assert_close(m(chunk, cache=ours), m(chunk, cache=theirs))
        assert ours[0].offset == 14 and len(ours[0].block_table) == 4


@pytest.mark.slow_on("jax")
def test_model_trim_then_decode_equals_fresh(backend: str, folders: dict) -> None:
    model = pl.load(folders["llama"], backend=backend, dtype="float32")
    ids = np.random.default_rng(1).integers(3, 300, size=(1, 11))
    caches = _paged_caches(model)
    model(ids[:, :8], cache=caches)
    model(np.asarray([[5, 6, 7]]), cache=caches)  # a rejected draft
    free = caches[0].pool.num_free
    for c in caches:
        c.trim(3)
    assert caches[0].pool.num_free == free + 1  # position 8 .. 10 were page 2's
    got = model(ids[:, 8:], cache=caches)
    fresh = model(ids, cache=_paged_caches(model))[:, 8:, :]
    assert_close(got, fresh)
