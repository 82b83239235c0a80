"""KVCache and RotatingKVCache: cached decoding equals the full forward, trim, left padding.

Every test runs on each backend (and the float dtypes it supports where numbers are compared).
The attention block's full causal forward (sliding-window for a rotating cache) is the property's
other side; a float64 NumPy composition of :mod:`portable_llm.reference` formulas checks both.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm import reference
from portable_llm.attention import attention
from portable_llm.cache import KVCache, RotatingKVCache
from portable_llm.padding import left_pad
from portable_llm.testing import assert_close, random_array, random_weight
from portable_llm.testing.strategies import seeds

E, H, H_KV, D = 16, 4, 2, 4
T = 9  # tokens per test sequence


def block(seed: int, dtype: str, backend: str) -> tuple[dict, dict]:
    """Weights of a small Qwen2-style attention block (biases on q, k, v): ours and float64."""
    shapes = {"wq": (H * D, E), "wk": (H_KV * D, E), "wv": (H_KV * D, E), "wo": (E, H * D)}
    ours, ref = {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        ours[name], ref[name] = random_weight(seed + i, shape, dtype, backend=backend)
    for i, name in enumerate(("bq", "bk", "bv")):
        n = shapes["w" + name[1]][0]
        ours[name], ref[name] = random_array(seed + 10 + i, (n,), dtype, backend=backend)
    return {"num_heads": H, "num_kv_heads": H_KV, **ours}, ref


def reference_block(x: np.ndarray, w: dict, positions: np.ndarray, allowed: np.ndarray):
    """float64: projections, RoPE at ``positions`` ``(B, L)``, attention where ``allowed``."""
    B, L, _ = x.shape

    def heads(y: np.ndarray, n: int) -> np.ndarray:
        return y.reshape(B, L, n, D).transpose(0, 2, 1, 3)  # (B, n, L, D)

    q = reference.rope(heads(reference.linear(x, w["wq"], w["bq"]), H), positions)
    k = reference.rope(heads(reference.linear(x, w["wk"], w["bk"]), H_KV), positions)
    v = heads(reference.linear(x, w["wv"], w["bv"]), H_KV)
    o = reference.scaled_dot_product_attention(q, k, v, mask=allowed)  # (B, H, L, D)
    return reference.linear(o.transpose(0, 2, 1, 3).reshape(B, L, H * D), w["wo"])


def allowed(n: int, *, window: int | None = None, keep: int = 0, ring: int | None = None):
    """Boolean ``(n, n)``: query i sees key j (the rules of the caches, one loop per entry)."""
    out = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for j in range(i + 1):
            in_window = window is None or j > i - window
            in_ring = ring is None or j < keep or j > i - ring
            out[i, j] = in_window and in_ring
    return out


def decode(x, kw: dict, cache, chunks: list[int]):
    """Run x ``(B, T, E)`` through the block in chunks of the given sizes; the outputs, joined."""
    outs, t = [], 0
    for n in chunks:
        outs.append(pl.to_numpy(attention(x[:, t : t + n, :], cache=cache, **kw)))
        t += n
    return np.concatenate(outs, axis=1)


@st.composite
def chunkings(draw: st.DrawFn, total: int = T, largest: int = 6) -> list[int]:
    """Sizes of consecutive chunks that cover ``total`` tokens (single tokens and larger)."""
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(draw(st.integers(1, min(largest, total - sum(sizes)))))
    return sizes


CACHES = {
    "full": (lambda: KVCache(step=4), {}),
    "rotating": (lambda: RotatingKVCache(4, step=2), {"window": 4}),
    "rotating-keep": (lambda: RotatingKVCache(5, keep=2, step=3), {"keep": 2, "ring": 3}),
}


@pytest.mark.parametrize("kind", list(CACHES))
@given(chunks=chunkings(), seed=seeds())
def test_cached_decode_equals_full_forward(backend, dtype, kind, chunks, seed):
    make, rule = CACHES[kind]
    kw, w = block(seed, dtype, backend)
    x, xr = random_array(seed + 20, (2, T, E), dtype, backend=backend)
    got = decode(x, kw, make(), chunks)
    mask = allowed(T, **rule)
    if rule.get("keep"):
        full = attention(x, mask=pl.asarray(mask, backend=backend), **kw)
    else:
        full = attention(x, window=rule.get("window"), **kw)
    assert_close(pl.asarray(got, backend=backend), full, err_msg=f"chunks {chunks}")
    positions = np.broadcast_to(np.arange(T), (2, T))
    want = reference_block(xr, w, positions, mask)
    assert_close(pl.asarray(got, backend=backend), want, backend=backend, dtype=dtype)


@pytest.mark.parametrize("kind", list(CACHES))
@given(prefix=st.integers(1, 5), wrong=st.integers(1, 3), chunk=st.integers(1, 3), seed=seeds())
def test_trim_then_redecode_equals_never_decoded(backend, kind, prefix, wrong, chunk, seed):
    make, _ = CACHES[kind]
    kw, _ = block(seed, "float32", backend)
    x, _ = random_array(seed + 20, (1, T, E), "float32", backend=backend)
    bad, _ = random_array(seed + 21, (1, wrong, E), "float32", backend=backend)
    rest = [chunk] * ((T - prefix) // chunk) + (
        [(T - prefix) % chunk] if (T - prefix) % chunk else []
    )
    clean = make()
    want = decode(x, kw, clean, [prefix, *rest])
    cache = make()
    head = decode(x, kw, cache, [prefix])
    # A rotating cache can rewind past one token only while nothing was evicted.
    trimmable = kind == "full" or prefix + wrong <= cache.max_size or wrong == 1
    for i in range(wrong):  # draft tokens one by one, as speculative decoding does
        attention(bad[:, i : i + 1, :], cache=cache, **kw)
    if not trimmable:
        with pytest.raises(ValueError, match=r"RotatingKVCache.trim: n=.* were evicted"):
            cache.trim(wrong)
        return
    assert cache.trim(wrong) == wrong
    assert cache.offset == prefix
    tail = decode(x[:, prefix:, :], kw, cache, rest)
    assert_close(pl.asarray(np.concatenate([head, tail], axis=1), backend=backend),
                 pl.asarray(want, backend=backend))  # fmt: skip


@pytest.mark.parametrize("kind", ["full", "rotating"])
@given(lengths=st.lists(st.integers(1, 6), min_size=2, max_size=3), steps=st.integers(1, 4),
       seed=seeds())  # fmt: skip
def test_batched_unequal_lengths_equal_each_sequence_alone(backend, dtype, kind, lengths, steps,
                                                           seed):  # fmt: skip
    def make(pad=None):
        return KVCache(left_padding=pad) if kind == "full" else RotatingKVCache(4, left_padding=pad)

    kw, _ = block(seed, dtype, backend)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 50, size=n).tolist() for n in lengths]
    table, _ = random_array(seed + 30, (50, E), dtype, backend=backend)
    new, _ = random_array(seed + 31, (len(lengths), steps, E), dtype, backend=backend)
    ids, pad = left_pad(prompts, backend=backend)
    cache = make(pad)
    batched = decode(pl.embedding(ids, table), kw, cache, [ids.shape[1]])
    batched = np.concatenate([batched, decode(new, kw, cache, [1] * steps)], axis=1)
    width = max(lengths)
    for b, prompt in enumerate(prompts):
        alone_ids = pl.asarray(np.array([prompt]), backend=backend)
        x = pl.to_numpy(pl.embedding(alone_ids, table))
        x = pl.asarray(np.concatenate([x, pl.to_numpy(new)[b : b + 1]], axis=1), backend=backend)
        alone = decode(x, kw, make(), [len(prompt)] + [1] * steps)
        row = batched[b : b + 1, width - len(prompt) :]
        assert_close(pl.asarray(row, backend=backend), pl.asarray(alone, backend=backend),
                     err_msg=f"row {b} of lengths {lengths}")  # fmt: skip


def test_left_padding_without_a_cache_equals_each_sequence_alone(backend, dtype):
    kw, _ = block(3, dtype, backend)
    table, _ = random_array(4, (20, E), dtype, backend=backend)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    ids, pad = left_pad(prompts, backend=backend)
    out = pl.to_numpy(attention(pl.embedding(ids, table), left_padding=pad, window=3, **kw))
    for b, prompt in enumerate(prompts):
        h = pl.embedding(pl.asarray(np.array([prompt]), backend=backend), table)
        alone = attention(h, window=3, **kw)
        assert_close(pl.asarray(out[b : b + 1, 5 - len(prompt) :], backend=backend), alone)


# -- the cache itself ------------------------------------------------------------------------


@given(chunks=chunkings(total=12), step=st.sampled_from([1, 3, 256]), seed=seeds())
def test_kv_cache_returns_every_chunk(backend, dtype, chunks, step, seed):
    k, kr = random_array(seed, (2, 3, 12, 4), dtype, backend=backend)
    v, vr = random_array(seed + 1, (2, 3, 12, 4), dtype, backend=backend)
    cache, t, held = KVCache(step=step), 0, []
    for n in chunks:
        k_all, v_all = cache.update_and_fetch(k[:, :, t : t + n, :], v[:, :, t : t + n, :])
        t += n
        assert cache.offset == t and cache.capacity > t
        np.testing.assert_array_equal(pl.to_numpy(k_all).astype(np.float64), kr[:, :, :t])
        np.testing.assert_array_equal(pl.to_numpy(v_all).astype(np.float64), vr[:, :, :t])
        held.append((t, k_all))
    for n, k_all in held:  # what earlier updates returned is still intact
        np.testing.assert_array_equal(pl.to_numpy(k_all).astype(np.float64), kr[:, :, :n])


def _visible_columns(k_all, mask, window, n: int) -> list[list[float]]:
    """For each of the n queries, the sorted values of the keys it may attend."""
    cols = pl.to_numpy(k_all)[0, 0, :, 0].astype(np.float64)
    S = cols.shape[0]
    if isinstance(mask, str):
        vis = pl.causal_mask(n, S, window=window)
    elif mask is None:
        vis = np.ones((n, S), dtype=bool)
    else:
        vis = np.broadcast_to(pl.to_numpy(mask), (1, 1, n, S))[0, 0]
    return [sorted(cols[vis[i]].tolist()) for i in range(n)]


@given(max_size=st.integers(1, 6), keep_frac=st.floats(0, 0.99), window_frac=st.floats(0, 1),
       ops=st.lists(st.sampled_from([1, 1, 2, 3, 7, -1, -2]), min_size=1, max_size=10),
       step=st.sampled_from([1, 2, 256]))  # fmt: skip
def test_rotating_cache_shows_each_query_its_window(backend, max_size, keep_frac, window_frac,
                                                     ops, step):  # fmt: skip
    """Keys carry their column (plus 100 x the write's number): every query must see exactly the
    latest keys of columns ``j <= p`` with ``j < keep`` or ``j > p - (max_size - keep)``, and
    ``j > p - window``. Negative ops are trims (refused once the keys they need are evicted)."""
    keep = int(keep_frac * max_size)
    ring = max_size - keep
    window = None if window_frac > 0.7 else 1 + int(window_frac * (ring - 1))
    cache = RotatingKVCache(max_size, keep, step=step)
    t, high, latest = 0, 0, {}
    for w, op in enumerate(ops):
        if op < 0:
            n = min(-op, t)
            ok = n == 0 or max(keep, t - n - ring + 1) >= max(keep, high - ring)
            if not ok:
                with pytest.raises(ValueError, match="were evicted"):
                    cache.trim(n)
                continue
            t -= cache.trim(n)
            continue
        vals = np.arange(t, t + op) + 100.0 * (w + 1)
        k = pl.asarray(np.broadcast_to(vals[None, None, :, None], (1, 2, op, 3)),
                       backend=backend, dtype="float32")  # fmt: skip
        k_all, _ = cache.update_and_fetch(k, k)
        latest.update({t + i: vals[i] for i in range(op)})
        mask, win = cache.make_mask(window=window)
        got = _visible_columns(k_all, mask, win, op)
        for i in range(op):
            p = t + i
            want = [
                latest[j]
                for j in range(p + 1)
                if (j < keep or j > p - ring) and (window is None or j > p - window)
            ]
            assert got[i] == sorted(want), f"query {p}"  # fmt: skip
        t = high = t + op
        assert cache.offset == t and cache.capacity <= max_size + 1


def test_preallocation_grows_in_steps(backend):
    step, n = 16, 200
    k, _ = random_array(0, (1, 2, 1, 8), "float32", backend=backend)
    full, rot = KVCache(step=step), RotatingKVCache(40, keep=3, step=step)
    for _ in range(n):
        full.update_and_fetch(k, k)
        rot.update_and_fetch(k, k)
    assert full.offset == rot.offset == n
    assert full.reallocations == math.ceil((n + 1) / step)  # O(S / step), never once per token
    assert n < full.capacity <= n + step
    assert rot.reallocations == math.ceil(41 / step) and rot.capacity == 41


def test_set_slice_writes_the_block(backend):
    bk = pl.get_backend(backend)
    buf = pl.asarray(np.zeros((2, 3, 5, 4)), backend=backend, dtype="float32")
    val, val_r = random_array(0, (2, 3, 2, 4), "float32", backend=backend)
    out = bk.set_slice(buf, (0, 0, 2, 0), val)
    want = np.zeros((2, 3, 5, 4))
    want[:, :, 2:4] = val_r
    np.testing.assert_array_equal(pl.to_numpy(out).astype(np.float64), want)


@pytest.mark.parametrize("kind", ["full", "rotating"])
def test_make_mask_keeps_the_plain_causal_form(backend, kind):
    """Without padding or eviction the cache asks for ``mask="causal"`` (native kernels apply)."""
    cache = KVCache() if kind == "full" else RotatingKVCache(8)
    k, _ = random_array(0, (1, 2, 3, 4), "float32", backend=backend)
    cache.update_and_fetch(k, k)
    assert cache.make_mask(window=2) == ("causal", 2)
    cache.update_and_fetch(k[:, :, :1, :], k[:, :, :1, :])
    assert cache.make_mask() == ("causal", None)
