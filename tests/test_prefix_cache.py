"""Prefix caching: reference-counted pages (PagePool.share/free/copy), PagedKVCache.share with
copy on write, PrefixCache match/insert/evict, and a BatchGenerator with the cache giving the
tokens it gives without (and those of ``generate`` alone)."""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.caches.paged import PagedKVCache
from portable_llm.caches.prefix import PrefixCache
from portable_llm.generation.batch import BatchGenerator, Request
from portable_llm.testing import random_array
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint

H_KV, D, P = 2, 4, 4


def _pool(backend: str, pages: int = 8) -> pl.PagePool:
    return pl.PagePool(pages, P, H_KV, D, "float32", backend=backend)


def _chunk(seed: int, L: int, backend: str) -> tuple[object, object]:
    k, _ = random_array(seed, (1, H_KV, L, D), "float32", backend=backend)
    v, _ = random_array(seed + 1, (1, H_KV, L, D), "float32", backend=backend)
    return k, v


def test_pool_reference_counts(backend: str) -> None:
    pool = _pool(backend, 4)
    a, b = pool.allocate(2)
    pool.share([a])
    assert pool.refcount(a) == 2 and pool.refcount(b) == 1
    pool.free([a, b])  # a keeps one holder, b is free again
    assert (pool.refcount(a), pool.refcount(b), pool.num_free) == (1, 0, 3)
    with pytest.raises(ValueError, match="not allocated"):
        pool.share([b])
    with pytest.raises(ValueError, match="repeat"):
        pool.share([a, a])
    assert pool.refcount(a) == 1  # the failed calls changed nothing
    pool.free([a])
    assert pool.num_free == 4


def test_pool_copy(backend: str) -> None:
    pool = _pool(backend, 4)
    cache = PagedKVCache(pool)
    k, v = _chunk(0, 6, backend)
    cache.append(k, v)
    src = cache.block_table[1]
    dst = pool.copy(src)
    kp, vp = pl.to_numpy(pool.k_pages), pl.to_numpy(pool.v_pages)
    np.testing.assert_array_equal(kp[dst], kp[src])
    np.testing.assert_array_equal(vp[dst], vp[src])
    assert pool.refcount(dst) == 1


def test_share_copies_a_partly_filled_page_on_write(backend: str) -> None:
    pool = _pool(backend, 8)
    owner = PagedKVCache(pool)
    k, v = _chunk(1, 6, backend)  # one full page and 2 tokens of the next
    owner.append(k, v)
    table = list(owner.block_table)
    for length in (4, 5, 6):  # a page boundary, then inside the partly filled page
        other = PagedKVCache(pool)
        other.share(table, length)
        assert other.offset == length and other.block_table[0] == table[0]
        assert pool.refcount(table[0]) == 2
        if length % P:
            assert other.block_table[1] != table[1]  # its own copy of the partial page
        k2, v2 = _chunk(10 + length, 1, backend)
        before = pl.to_numpy(pool.k_pages)[table[1]].copy()
        ka, _ = other.update_and_fetch(k2, v2)
        np.testing.assert_array_equal(pl.to_numpy(pool.k_pages)[table[1]], before)  # untouched
        got = pl.to_numpy(ka)[0]  # (H_kv, length + 1, D)
        np.testing.assert_array_equal(got[:, :length], pl.to_numpy(k)[0][:, :length])
        np.testing.assert_array_equal(got[:, length], pl.to_numpy(k2)[0][:, 0])
        other.release()
    assert pool.refcount(table[0]) == 1 and pool.num_free == 8 - 2


def test_prefix_cache_match_insert_evict(backend: str) -> None:
    pools = [_pool(backend, 8), _pool(backend, 8)]
    cache = PrefixCache(pools)
    seqs = [PagedKVCache(p) for p in pools]
    tokens = list(range(10, 20))  # 2 full pages and 2 tokens
    for c in seqs:
        c.reserve(10)
    assert cache.insert(tokens, [c.block_table for c in seqs]) == 3
    assert cache.num_blocks == 3 and pools[0].refcount(seqs[0].block_table[0]) == 2
    for c in seqs:
        c.release()
    assert cache.num_idle == 3 and pools[0].num_free == 5
    assert cache.match(tokens)[0] == 10
    assert cache.match(tokens, limit=9)[0] == 9  # ends inside the partial block
    assert cache.match([*tokens[:6], 99])[0] == 6  # ends inside the second full block
    assert cache.match([*tokens[:4], 99])[0] == 4
    assert cache.match([99, *tokens])[0] == 0
    length, pages = cache.match(tokens[:8])
    assert length == 8 and len(pages) == 2 and len(pages[0]) == 2
    # a sequence holding the first block keeps it through eviction
    holder = PagedKVCache(pools[0])
    holder.share(pages[0], 4)
    assert cache.evict(8) == 2  # the leaf blocks; the first is held
    assert cache.num_blocks == 1
    holder.release()
    assert cache.evict(1) == 1 and cache.num_blocks == 0
    assert all(p.num_free == 8 for p in pools)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = tmp_path_factory.mktemp("prefix")
    write_checkpoint(path, tiny_config("llama", max_position_embeddings=512), seed=7)
    return path


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [int(i) for i in rng.integers(3, 300, size=n)]


@pytest.mark.parametrize("pool_pages", [None, 24])
@pytest.mark.slow_on("jax")  # 30 s of the JAX env: every batch shape compiles (same code elsewhere)
def test_batch_generator_with_prefix_cache(backend: str, folder: object, pool_pages) -> None:
    """Prompts sharing a system prompt (page-aligned or not, whole, cut short): the tokens equal
    those of ``generate`` alone, the second round takes the prefixes from the cache, and a
    small fixed pool evicts cached prefixes to admit new requests."""
    dtype = "float64" if backend == "numpy" else "float32"
    model = pl.load(folder, backend=backend, dtype=dtype)
    rng = np.random.default_rng(0)
    system = _prompt(rng, 37)
    prompts = [system + _prompt(rng, k) for k in (5, 1, 11, 0)] + [system[:20], system[:16]]
    alone = [list(pl.generate(model, p, max_new_tokens=6, stop=())) for p in prompts]
    gen = BatchGenerator(
        model, max_batch=3, prefill_chunk=16, pool_pages=pool_pages, page_size=P,
        prefix_cache=True,
    )  # fmt: skip
    for round_ in range(2):
        out: dict[int, list[int]] = {}
        cached: dict[int, int] = {}
        ids = [gen.add(Request(p, 6, stop=())) for p in prompts]
        while gen.has_work:
            for rid, token, _ in gen.step():
                out.setdefault(rid, []).append(token)
            cached.update(gen.admitted)
        assert [out[i] for i in ids] == alone
        hits = [cached[i] for i in ids]
        if round_ == 1:  # every prompt but its last token (at most) came from the cache
            assert all(h >= len(p) - P for h, p in zip(hits, prompts, strict=True)), hits
        else:
            assert hits[0] == 0 and max(hits) > 0  # later prompts share the first's pages
    assert gen.prefix_cache is not None and gen.prefix_cache.num_blocks > 0
    gen.prefix_cache.clear()
    assert all(p.num_free == p.num_pages for p in gen.pools)


# Slow on JAX (tox -e slow; 5 CPU s of compiles there): the page bookkeeping it checks is the
# same Python on every backend; JAX keeps the prefix cache's other tests.
@pytest.mark.slow_on("jax")
def test_cancel_frees_pages(backend: str, folder: object) -> None:
    model = pl.load(folder, backend=backend, dtype="float32")
    gen = BatchGenerator(model, max_batch=2, pool_pages=40, page_size=P, prefix_cache=True)
    rng = np.random.default_rng(1)
    ids = [gen.add(Request(_prompt(rng, 9), 20, stop=())) for _ in range(3)]
    gen.step()
    gen.step()
    assert [gen.cancel(i) for i in ids] == [True, True, True]  # running, running, waiting
    assert not gen.has_work and gen.cancel(ids[0]) is False
    assert gen.prefix_cache is not None
    assert gen.pools[0].num_free + gen.prefix_cache.num_idle == 40
