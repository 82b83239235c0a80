"""A forward whose layer refuses the update leaves every layer's cache as it was.

The caches of one forward are checked before the first layer writes
(:func:`portable_llm.caches.check.check_caches`): a second layer's cache that refuses the chunk
(another batch size, dtype, thread; a pool out of pages) used to raise once the first layer had
taken it (offsets ``[0, 2] -> [2, 2]``). Each case then runs on and is compared with a run that
never failed: the logits are those of fresh caches, so nothing half-written is left behind.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.models import load
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint

PROMPT = [[5, 17, 42]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, tiny_config("llama"), seed=4)
    return path


def _chunk(model: pl.Model, B: int, L: int, dtype: str = "float32") -> object:
    c, bk = model.config, model.backend
    k = np.zeros((B, c.num_key_value_heads, L, c.head_dim), dtype=np.float32)
    return bk.astype(pl.asarray(k, backend=bk.name, device=model.device), bk.dtype(dtype))


def _offsets(caches: list) -> list[int]:
    return [c.offset for c in caches]


def _fresh_logits(model: pl.Model) -> np.ndarray:
    return pl.to_numpy(model(PROMPT, cache=model.make_cache()))


def test_a_refused_batch_size_leaves_every_cache(folder: object, backend: str) -> None:
    model = load(folder, backend=backend, dtype="float32")
    cache = model.make_cache()
    k = _chunk(model, 2, 2)
    cache[1].update_and_fetch(k, k)  # layer 1 holds a batch of 2
    cache[1].make_mask()
    cache[1].trim(2)  # offsets [0, 0], layer 1 bound to B=2
    with pytest.raises(ValueError, match=r"model: cache\[1\]: k of shape \(1, 2, 3, 8\)"):
        model(PROMPT, cache=cache)
    assert _offsets(cache) == [0, 0]
    # The first cache took nothing: with a fresh layer 1, the logits are a fresh run's.
    cache[1] = model.make_cache()[1]
    assert_close(model(PROMPT, cache=cache), _fresh_logits(model), backend=backend)


def test_a_refused_dtype_leaves_every_cache(folder: object, backend: str) -> None:
    model = load(folder, backend=backend, dtype="float32")
    cache = model.make_cache()
    model(PROMPT, cache=cache)
    other = next(d for d in pl.get_backend(backend).float_dtypes() if d != "float32")
    wrong = model.make_cache()
    k = _chunk(model, 1, 3, other)
    wrong[1].update_and_fetch(k, k)
    wrong[1].make_mask()
    cache[1] = wrong[1]  # layer 1 holds another dtype, at the same offset 3
    with pytest.raises(TypeError, match=rf"model: cache\[1\]: the cache holds {other}"):
        model.decode_step(pl.asarray([[7]], backend=backend, device=model.device), cache=cache)
    assert _offsets(cache) == [3, 3]


def test_unequal_offsets_are_refused(folder: object, backend: str) -> None:
    """The forward's positions start at one offset: caches holding [0, 2] are refused."""
    model = load(folder, backend=backend, dtype="float32")
    cache = model.make_cache()
    k = _chunk(model, 1, 2)
    cache[1].update_and_fetch(k, k)
    with pytest.raises(ValueError, match=r"one offset .* cache offsets \[0, 2\]"):
        model(PROMPT, cache=cache)
    assert _offsets(cache) == [0, 2]


def test_a_cache_of_another_thread_leaves_every_cache(folder: object) -> None:
    model = load(folder, backend="numpy", dtype="float32")
    cache = model.make_cache()
    other = model.make_cache()

    def elsewhere() -> None:
        model([[1]], cache=other)
        other[1].trim(1)  # offset 0, owned by this other thread

    done = threading.Thread(target=elsewhere)
    done.start()
    done.join()
    cache[1] = other[1]
    with pytest.raises(RuntimeError, match=r"model: cache\[1\]: this cache belongs to"):
        model(PROMPT, cache=cache)
    assert _offsets(cache) == [0, 0]


def test_an_exhausted_pool_leaves_every_paged_cache(folder: object, backend: str) -> None:
    """Layer 1's pool has no page left: layer 0's pool allocates nothing either."""
    model = load(folder, backend=backend, dtype="float32")
    pools = model.make_page_pools(4, 2)
    pools[1].allocate(3)  # 1 page free in layer 1: the 3 tokens need 2
    caches = [pl.PagedKVCache(pool) for pool in pools]
    with pytest.raises(pl.PagePoolExhausted, match=r"model: cache\[1\]: 3 more tokens need 2"):
        model(PROMPT, cache=caches)
    assert _offsets(caches) == [0, 0]
    assert [p.num_free for p in pools] == [4, 1]
    pools[1].free([1, 2])
    assert_close(model(PROMPT, cache=caches), _fresh_logits(model), backend=backend)


def test_two_rows_over_one_pool_allocate_all_or_nothing(folder: object, backend: str) -> None:
    """forward_paged: each row alone fits the pool, the two rows do not."""
    model = load(folder, backend=backend, dtype="float32")
    pools = model.make_page_pools(3, 2)  # 3 pages; each row's 3 tokens need 2
    rows = [[pl.PagedKVCache(pool) for pool in pools] for _ in range(2)]
    with pytest.raises(pl.PagePoolExhausted, match=r"2 sequence\(s\) of caches need 4 free"):
        model.forward_paged(PROMPT * 2, caches=rows)
    assert [_offsets(seq) for seq in rows] == [[0, 0], [0, 0]]
    assert [p.num_free for p in pools] == [3, 3]
    want = _fresh_logits(model)[:, -1, :]  # (1, V)
    got = model.forward_paged(PROMPT, caches=rows[:1])
    assert_close(got, want, backend=backend)
