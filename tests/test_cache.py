"""KVCache and RotatingKVCache: cached decoding equals the full forward, trim, left padding.

Every test runs on each backend (and the float dtypes it supports where numbers are compared).
The attention block's full causal forward (sliding-window for a rotating cache) is the property's
other side; a float64 NumPy composition of :mod:`portable_llm.testing.reference`
formulas checks both.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.attn.block import attention
from portable_llm.attn.padding import left_pad
from portable_llm.caches.kv import KVCache, RotatingKVCache
from portable_llm.testing import assert_close, random_array, random_weight, reference
from portable_llm.testing.strategies import seeds

E, H, H_KV, D = 16, 4, 2, 4
T = 7  # tokens per test sequence (few shapes: JAX compiles once per shape)


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
    "full": (lambda: KVCache(step=4, static_shapes=False), {}),
    # fixed-size views (JAX's default): capacity - 1 keys, the slots past the offset masked
    "full-static": (lambda: KVCache(step=4, static_shapes=True), {}),
    "rotating": (lambda: RotatingKVCache(4, step=2), {"window": 4}),
    "rotating-keep": (lambda: RotatingKVCache(5, keep=2, step=3), {"keep": 2, "ring": 3}),
}


def check_decode(backend: str, dtype: str, kind: str, chunks: list[int], seed: int) -> None:
    """Decoding in ``chunks`` equals the block's full forward and the float64 reference."""
    make, rule = CACHES[kind]
    kw, w = block(seed, dtype, backend)
    x, xr = random_array(seed + 20, (1, T, E), dtype, backend=backend)
    got = pl.asarray(decode(x, kw, make(), chunks), backend=backend)
    mask = allowed(T, **rule)
    if rule.get("keep"):
        full = attention(x, mask=pl.asarray(mask, backend=backend), **kw)
    else:
        full = attention(x, window=rule.get("window"), **kw)
    assert_close(got, full, err_msg=f"chunks {chunks}")
    want = reference_block(xr, w, np.arange(T)[None, :], mask)
    assert_close(got, want, backend=backend, dtype=dtype, err_msg=f"chunks {chunks}")


# Hypothesis draws the chunking in float32; every dtype runs one chunking with single tokens and
# a chunk larger than the rotating window (JAX compiles once per shape: few shapes, fast tests).
@pytest.mark.parametrize("kind", list(CACHES))
@given(chunks=chunkings(), seed=seeds())
def test_cached_decode_equals_full_forward(backend, kind, chunks, seed):
    check_decode(backend, "float32", kind, chunks, seed)


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("kind", list(CACHES))
def test_cached_decode_equals_full_forward_in_every_dtype(backend, dtype, kind):
    check_decode(backend, dtype, kind, [1, 5, 1], seed=7)


@pytest.mark.parametrize("kind", list(CACHES))
@given(prefix=st.integers(1, 4), wrong=st.integers(1, 3), chunk=st.integers(1, 3), seed=seeds())
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
    trimmable = kind.startswith("full") or prefix + wrong <= cache.max_size or wrong == 1
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


def check_batched(backend: str, dtype: str, kind: str, lengths: list[int], steps: int,
                  seed: int) -> None:  # fmt: skip
    """A left-padded batch, prefilled then decoded token by token, equals each row alone."""

    def make(pad=None):
        if kind == "rotating":
            return RotatingKVCache(4, left_padding=pad)
        return KVCache(left_padding=pad, step=3, static_shapes=kind == "full-static")

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
        x = np.concatenate([x, pl.to_numpy(new)[b : b + 1]], axis=1)
        alone = decode(pl.asarray(x, backend=backend), kw, make(), [len(prompt)] + [1] * steps)
        row = batched[b : b + 1, width - len(prompt) :]
        assert_close(pl.asarray(row, backend=backend), pl.asarray(alone, backend=backend),
                     err_msg=f"row {b} of lengths {lengths}")  # fmt: skip


@pytest.mark.parametrize("kind", ["full", "full-static", "rotating"])
@given(lengths=st.lists(st.integers(1, 4), min_size=2, max_size=2), steps=st.integers(1, 2),
       seed=seeds())  # fmt: skip
def test_batched_unequal_lengths_equal_each_sequence_alone(backend, kind, lengths, steps, seed):
    check_batched(backend, "float32", kind, lengths, steps, seed)


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("kind", ["full", "full-static", "rotating"])
def test_batched_decode_in_every_dtype(backend, dtype, kind):
    check_batched(backend, dtype, kind, [4, 1], steps=2, seed=11)


@pytest.mark.slow_on("jax")
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


@given(chunks=chunkings(total=12), step=st.sampled_from([3, 256]), seed=seeds())
def test_kv_cache_returns_every_chunk(backend, chunks, step, seed):
    check_chunks(backend, "float32", chunks, step, seed)


def test_kv_cache_returns_every_chunk_in_every_dtype(backend, dtype):
    check_chunks(backend, dtype, [1, 4, 1, 6], 3, seed=5)


def check_chunks(backend: str, dtype: str, chunks: list[int], step: int, seed: int) -> None:
    """update_and_fetch returns every key and value so far, bit for bit."""
    k, kr = random_array(seed, (2, 3, 12, 4), dtype, backend=backend)
    v, vr = random_array(seed + 1, (2, 3, 12, 4), dtype, backend=backend)
    cache, t, held = KVCache(step=step, static_shapes=False), 0, []
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
    step, n = 8, 48  # JAX compiles each new length once: few tokens keep the test fast
    k, _ = random_array(0, (1, 2, 1, 8), "float32", backend=backend)
    full, rot = KVCache(step=step), RotatingKVCache(20, keep=3, step=step)
    for _ in range(n):
        full.update_and_fetch(k, k)
        rot.update_and_fetch(k, k)
    assert full.offset == rot.offset == n
    assert full.reallocations == math.ceil((n + 1) / step)  # O(S / step), never once per token
    assert n < full.capacity <= n + step
    assert rot.reallocations == math.ceil(21 / step) and rot.capacity == 21


def test_set_slice_writes_the_block(backend):
    bk = pl.get_backend(backend)
    buf = pl.asarray(np.zeros((2, 3, 5, 4)), backend=backend, dtype="float32")
    val, val_r = random_array(0, (2, 3, 2, 4), "float32", backend=backend)
    out = bk.set_slice(buf, (0, 0, 2, 0), val)
    want = np.zeros((2, 3, 5, 4))
    want[:, :, 2:4] = val_r
    np.testing.assert_array_equal(pl.to_numpy(out).astype(np.float64), want)


def test_static_shapes_fetch_fixed_size_views(backend):
    """static_shapes: the fetched length changes only when the buffers grow (every step tokens),
    the first offset keys are the ones written, and the mask hides the slots past the offset."""
    k, kr = random_array(0, (1, 2, 10, 4), "float32", backend=backend)
    cache, lengths = KVCache(step=4, static_shapes=True), []
    for t in range(10):
        k_all, _ = cache.update_and_fetch(k[:, :, t : t + 1, :], k[:, :, t : t + 1, :])
        S = k_all.shape[2]
        assert S == cache.capacity - 1 >= cache.offset == t + 1
        np.testing.assert_array_equal(pl.to_numpy(k_all)[:, :, : t + 1].astype(np.float64),
                                      kr[:, :, : t + 1])  # fmt: skip
        mask, window = cache.make_mask()
        if t + 1 == S:  # the view ends at the offset: plain causal
            assert (mask, window) == ("causal", None)
        else:
            assert window is None
            np.testing.assert_array_equal(pl.to_numpy(mask)[0, 0, 0], np.arange(S) <= t)
        lengths.append(S)
    assert lengths == [3] * 3 + [7] * 4 + [11] * 3  # capacity 4, 8, 12: one key is kept free


def test_exact_keys_by_default_on_every_backend(backend):
    """One meaning everywhere: ``KVCache()`` returns exactly ``offset`` keys, JAX included;
    fixed-size views only when asked for (the model asks on backends that compile per shape)."""
    k, _ = random_array(0, (1, 2, 3, 4), "float32", backend=backend)
    cache = KVCache()
    assert cache.static_shapes is False
    for n in (3, 1):
        k_all, _ = cache.update_and_fetch(k[:, :, :n, :], k[:, :, :n, :])
        assert k_all.shape[2] == cache.offset < cache.capacity
        assert cache.make_mask() == ("causal", None)
    for bad in (None, "yes", 1):
        with pytest.raises(TypeError, match="KVCache: static_shapes must be a bool"):
            KVCache(static_shapes=bad)


@pytest.mark.parametrize("kind", ["full", "rotating"])
def test_make_mask_keeps_the_plain_causal_form(backend, kind):
    """Without padding or eviction the cache asks for ``mask="causal"`` (native kernels apply)."""
    cache = KVCache(static_shapes=False) if kind == "full" else RotatingKVCache(8)
    k, _ = random_array(0, (1, 2, 3, 4), "float32", backend=backend)
    cache.update_and_fetch(k, k)
    assert cache.make_mask(window=2) == ("causal", 2)
    cache.update_and_fetch(k[:, :, :1, :], k[:, :, :1, :])
    assert cache.make_mask() == ("causal", None)


# -- left_pad ----------------------------------------------------------------------------------


def test_left_pad_right_aligns_the_prompts(backend):
    ids, pad = left_pad([[5, 6, 7], [8], np.array([9, 10])], pad_id=-1, backend=backend)
    np.testing.assert_array_equal(pl.to_numpy(ids), [[5, 6, 7], [-1, -1, 8], [-1, 9, 10]])
    np.testing.assert_array_equal(pl.to_numpy(pad), [0, 2, 1])
    assert pl.get_backend(backend).dtype_name(ids.dtype) == "int64" or backend == "jax"


@pytest.mark.parametrize(
    "sequences, kwargs, match",
    [
        ([], {}, "non-empty sequence"),
        ([[1], []], {}, r"sequences\[1\] must be 1-d and non-empty"),
        ([[[1, 2]]], {}, r"sequences\[0\] must be 1-d"),
        ([[1.5, 2.0]], {}, "must hold integer ids"),
        ([[1]], {"pad_id": 0.5}, "pad_id must be an int"),
    ],
)
def test_left_pad_rejects_bad_input(sequences, kwargs, match):
    with pytest.raises(ValueError, match=match):
        left_pad(sequences, **kwargs)


# -- bad input ---------------------------------------------------------------------------------


def _kv(backend: str, shape: tuple[int, ...], dtype: str = "float32"):
    return random_array(0, shape, dtype, backend=backend)[0]


@pytest.mark.parametrize(
    "shape, match",
    [
        ((3, 2, 1, 4), r"k of shape \(3, 2, 1, 4\) does not match .* = \(2, 2, 4\)"),
        ((2, 1, 1, 4), r"k of shape \(2, 1, 1, 4\) does not match .* = \(2, 2, 4\)"),
        ((2, 2, 1, 8), r"k of shape \(2, 2, 1, 8\) does not match .* = \(2, 2, 4\)"),
        ((2, 2, 4), r"k must have shape \(B, H_kv, L, D\), L >= 1, got \(2, 2, 4\)"),
    ],
    ids=["batch", "heads", "head_dim", "ndim"],
)
@pytest.mark.parametrize("make", [KVCache, lambda: RotatingKVCache(4)], ids=["full", "rotating"])
def test_a_chunk_must_match_the_cache(backend, make, shape, match):
    cache = make()
    first = _kv(backend, (2, 2, 3, 4))
    cache.update_and_fetch(first, first)
    bad = _kv(backend, shape)
    with pytest.raises(ValueError, match=match):
        cache.update_and_fetch(bad, bad)
    assert cache.offset == 3  # a refused chunk changes nothing


def test_chunk_checks(backend):
    cache = KVCache()
    k = _kv(backend, (1, 2, 3, 4))
    with pytest.raises(
        ValueError,
        match=r"v must have k's dtype and shape \(B, H_kv, L, D_v\) "
        r"but for its head dim D_v \(the cache's: 4\); k \(1, 2, 3, 4\)",
    ):
        cache.update_and_fetch(k, _kv(backend, (1, 2, 2, 4)))
    with pytest.raises(ValueError, match=r"L >= 1, got \(1, 2, 0, 4\)"):
        cache.update_and_fetch(k[:, :, :0, :], k[:, :, :0, :])
    cache.update_and_fetch(k, k)
    k64 = _kv(backend, (1, 2, 1, 4), "float64")
    with pytest.raises(TypeError, match="the cache holds float32, got k of dtype float64"):
        cache.update_and_fetch(k64, k64)
    other = "numpy" if backend != "numpy" else "array_api_strict"
    pytest.importorskip(other)
    k_other = _kv(other, (1, 2, 1, 4))
    with pytest.raises(TypeError, match=f"the cache holds {backend} arrays, got {other}"):
        cache.update_and_fetch(k_other, k_other)


@pytest.mark.parametrize("bound", [False, True], ids=["fresh", "bound"])
@pytest.mark.parametrize("make", [KVCache, lambda: RotatingKVCache(4)], ids=["full", "rotating"])
def test_caches_are_eager_only(backend, make, bound):
    if backend != "jax":
        pytest.skip("tracing (jax.jit) is JAX's")
    import jax

    cache = make()
    k = _kv("jax", (1, 2, 1, 4))
    if bound:
        cache.update_and_fetch(k, k)
    name = type(cache).__name__
    with pytest.raises(
        ValueError, match=rf"{name}.update_and_fetch: k and v are traced .* eager-only"
    ):
        jax.jit(cache.update_and_fetch)(k, k)
    assert cache.offset == int(bound)  # a refused chunk changes nothing
    cache.update_and_fetch(k, k)  # still usable eagerly
    assert cache.offset == int(bound) + 1


@pytest.mark.parametrize("make", [KVCache, lambda: RotatingKVCache(8)], ids=["full", "rotating"])
def test_trim_checks(backend, make):
    cache = make()
    k = _kv(backend, (1, 1, 3, 2))
    cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match=r"trim: n=4 exceeds the tokens in the cache \(offset 3\)"):
        cache.trim(4)
    with pytest.raises(ValueError, match=r"trim: n must be (an int )?>= 0, got -1"):
        cache.trim(-1)
    assert cache.trim(0) == 0 and cache.offset == 3
    assert cache.trim(3) == 3 and cache.offset == 0
    with pytest.raises(
        ValueError, match="make_mask: no update since the cache was made or trimmed"
    ):
        cache.make_mask()


def test_rotating_trim_past_the_evicted_window(backend):
    cache = RotatingKVCache(3)
    k = _kv(backend, (1, 1, 1, 2))
    for _ in range(5):
        cache.update_and_fetch(k, k)
    assert cache.trim(1) == 1  # the window of column 4 (columns 2, 3) is still held
    evicted = r"n=1 rewinds to column 3, whose window starts at column 1, but columns before 2"
    with pytest.raises(ValueError, match=evicted):
        cache.trim(1)
    with pytest.raises(ValueError, match="window=4 exceeds the 3 most recent keys"):
        cache.update_and_fetch(k, k)
        cache.make_mask(window=4)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0,), {}, r"max_size must be (an int )?>= 1, got 0"),
        ((4, -1), {}, r"keep must be (an int )?>= 0, got -1"),
        ((4, 4), {}, "keep must be < max_size, got keep=4, max_size=4"),
        ((4,), {"step": 0}, r"step must be (an int )?>= 1, got 0"),
        ((4, 1), {"left_padding": [0, 1]}, "keep=1 > 0 with left_padding is not supported"),
        ((4,), {"left_padding": [0, -1]}, "left_padding must be a 1-d array of ints >= 0"),
        ((4,), {"left_padding": [[0]]}, r"left_padding must .* got int64 with shape \(1, 1\)"),
    ],
)
def test_rotating_cache_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=f"RotatingKVCache: {match}"):
        RotatingKVCache(*args, **kwargs)


def test_left_padding_must_match_the_batch(backend):
    cache = KVCache(left_padding=[0, 1, 2])
    k = _kv(backend, (2, 1, 3, 2))
    with pytest.raises(ValueError, match=r"left_padding has shape \(3,\) but k has batch B=2"):
        cache.update_and_fetch(k, k)


def test_attention_cache_arguments(backend):
    kw, _ = block(0, "float32", backend)
    x, _ = random_array(0, (1, 2, E), "float32", backend=backend)
    with pytest.raises(TypeError, match="cache must be a KVCache or RotatingKVCache, got dict"):
        attention(x, cache={}, **kw)
    with pytest.raises(ValueError, match=r"positions start at cache.offset \(0\); leave offset"):
        attention(x, cache=KVCache(), offset=3, **kw)
    with pytest.raises(ValueError, match="give left_padding to the cache"):
        attention(x, cache=KVCache(), left_padding=[0], **kw)
    with pytest.raises(ValueError, match="mask must be 'causal' or an array, got None"):
        attention(x, cache=KVCache(), mask=None, **kw)
    pad = pl.asarray(np.array([0, 1]), backend=backend)
    with pytest.raises(
        ValueError, match=r"left_padding must have shape \(B,\) = \(1,\), got \(2,\)"
    ):
        attention(x, left_padding=pad, **kw)


# -- the documented pattern: update_and_fetch, then scaled_dot_product_attention --------------

PATTERN = [5, 1, 1, 4, 1, 1]  # a prompt, tokens, a chunk, tokens


def _pattern_inputs(backend: str, seed: int) -> tuple[list, list]:
    """q ``(2, 4, 13, 8)``, k and v ``(2, 2, 13, 8)`` (GQA): ours (float32) and float64."""
    n = sum(PATTERN)
    shapes = [(2, 4, n, 8), (2, 2, n, 8), (2, 2, n, 8)]
    pairs = [random_array(seed + i, s, "float32", backend=backend) for i, s in enumerate(shapes)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def test_documented_pattern_equals_float64_causal_attention(backend):
    """The docs' pattern, ``KVCache()`` then ``mask="causal"``, fed in chunks, equals one full
    causal attention in float64 on every backend (on JAX the default used to return 255 slots,
    zeros past the offset, which plain causal let every query see: max error 2.85)."""
    (q, k, v), (qr, kr, vr) = _pattern_inputs(backend, 40)
    want = reference.scaled_dot_product_attention(qr, kr, vr, mask="causal")  # (2, 4, 13, 8)
    cache, t = pl.KVCache(), 0
    for n in PATTERN:
        k_all, v_all = cache.update_and_fetch(k[:, :, t : t + n, :], v[:, :, t : t + n, :])
        out = pl.scaled_dot_product_attention(q[:, :, t : t + n, :], k_all, v_all, mask="causal")
        assert_close(out, want[:, :, t : t + n, :], backend=backend, dtype="float32",
                     err_msg=f"chunk of {n} at {t}")  # fmt: skip
        t += n


ROTATING = {  # the cache, and its rule as a full (T, T) boolean mask
    "window": (lambda: pl.RotatingKVCache(4, step=2), {"window": 4}),
    "sinks": (lambda: pl.RotatingKVCache(5, keep=2, step=3), {"keep": 2, "ring": 3}),
}


@pytest.mark.parametrize("kind", list(ROTATING))
def test_rotating_pattern_with_its_mask_equals_float64(backend, kind):
    """The same chunks through a ``RotatingKVCache``, attended with the cache's own mask (the
    only right one: its keys wrap and a chunk past the window brings the previous window)."""
    make, rule = ROTATING[kind]
    (q, k, v), (qr, kr, vr) = _pattern_inputs(backend, 50)
    full = allowed(sum(PATTERN), **rule)
    want = reference.scaled_dot_product_attention(qr, kr, vr, mask=full)
    cache, t = make(), 0
    for n in PATTERN:
        k_all, v_all = cache.update_and_fetch(k[:, :, t : t + n, :], v[:, :, t : t + n, :])
        mask, window = cache.make_mask()
        out = pl.scaled_dot_product_attention(q[:, :, t : t + n, :], k_all, v_all, mask=mask,
                                              window=window)  # fmt: skip
        assert_close(out, want[:, :, t : t + n, :], backend=backend, dtype="float32",
                     err_msg=f"chunk of {n} at {t}")  # fmt: skip
        t += n


def test_rotating_cache_refuses_to_be_attended_without_its_mask(backend):
    """A chunk past the window returns the previous window too: plain ``mask="causal"`` there
    attends outside the window (checked against float64), so the next update refuses to run
    until ``make_mask`` was called; single tokens need no call (plain causal is right)."""
    (q, k, v), (qr, kr, vr) = _pattern_inputs(backend, 60)
    want = reference.scaled_dot_product_attention(qr, kr, vr, mask=allowed(13, window=4))
    cache = pl.RotatingKVCache(4)
    for t in range(3):  # single tokens: plain causal, no make_mask needed
        k_all, v_all = cache.update_and_fetch(k[:, :, t : t + 1, :], v[:, :, t : t + 1, :])
        out = pl.scaled_dot_product_attention(q[:, :, t : t + 1, :], k_all, v_all, mask="causal")
        assert_close(out, want[:, :, t : t + 1, :], backend=backend, dtype="float32")
    k_all, v_all = cache.update_and_fetch(k[:, :, 3:7, :], v[:, :, 3:7, :])  # past the window
    assert k_all.shape[2] == 3 + 4  # the previous window and the chunk
    plain = pl.scaled_dot_product_attention(q[:, :, 3:7, :], k_all, v_all, mask="causal")
    err = np.abs(pl.to_numpy(plain).astype(np.float64) - want[:, :, 3:7, :]).max()
    assert err > 0.01, "plain causal must be wrong here, or the refusal below is needless"
    step = k[:, :, 7:8, :]
    with pytest.raises(RuntimeError, match=r"RotatingKVCache.update_and_fetch: .* make_mask"):
        cache.update_and_fetch(step, step)
    assert cache.offset == 7  # the refused chunk changed nothing
    mask, window = cache.make_mask()
    out = pl.scaled_dot_product_attention(q[:, :, 3:7, :], k_all, v_all, mask=mask, window=window)
    assert_close(out, want[:, :, 3:7, :], backend=backend, dtype="float32")
    cache.update_and_fetch(step, step)  # now accepted
    assert cache.offset == 8


@pytest.mark.parametrize("kind", ["static", "padded"])
def test_a_kv_cache_whose_keys_need_its_mask_refuses_to_skip_it(backend, kind):
    """Fixed-size views and left padding are not plain causal either: same refusal; a trim
    forgets the chunk (and the refusal)."""
    k = _kv(backend, (2, 2, 3, 4))
    static = kind == "static"
    cache = KVCache(step=8, static_shapes=True) if static else KVCache(left_padding=[0, 2])
    cache.update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match=r"KVCache.update_and_fetch: .* make_mask\(\)"):
        cache.update_and_fetch(k, k)
    cache.make_mask()
    cache.update_and_fetch(k, k)
    assert cache.trim(3) == 3
    cache.update_and_fetch(k, k)
    assert cache.offset == 6


# -- one thread per cache ----------------------------------------------------------------------


def _in_thread(fn):
    """Run ``fn()`` in a new thread; the exception it raised (or None)."""
    import threading

    caught: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            caught[0] = exc

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return caught[0]


@pytest.mark.parametrize("make", [KVCache, lambda: RotatingKVCache(4)], ids=["full", "rotating"])
def test_a_cache_belongs_to_the_thread_of_its_first_update(backend, make):
    """Two threads sharing one cache crashed MLX: a call from another thread is refused, before
    it touches anything, and the owner keeps using the cache."""
    k = _kv(backend, (1, 2, 2, 4))
    cache = make()
    exc = _in_thread(cache.make_mask)  # no owner before the first update: the usual error
    assert isinstance(exc, ValueError) and "no update since" in str(exc)
    cache.update_and_fetch(k, k)  # this thread owns it now
    calls = {
        "update_and_fetch": lambda: cache.update_and_fetch(k, k),
        "make_mask": cache.make_mask,
        "trim": lambda: cache.trim(1),
    }
    for name, call in calls.items():
        exc = _in_thread(call)
        assert isinstance(exc, RuntimeError), f"{name}: {exc!r}"
        assert f"{type(cache).__name__}.{name}: this cache belongs to the thread" in str(exc)
    assert cache.offset == 2
    cache.make_mask()
    cache.update_and_fetch(k, k)
    assert cache.offset == 4
    fresh = make()  # a cache made here and first updated elsewhere belongs to that thread
    assert _in_thread(lambda: fresh.update_and_fetch(k, k)) is None
    with pytest.raises(RuntimeError, match="belongs to the thread that first updated it"):
        fresh.update_and_fetch(k, k)


# -- integer arguments: one policy (NumPy integers accepted, bools refused) --------------------


def test_integer_arguments_accept_numpy_integers(backend):
    k = _kv(backend, (1, 2, 3, 4))
    rot = RotatingKVCache(np.int64(4), np.int32(1), step=np.int64(2))
    assert (rot.max_size, rot.keep, rot.step) == (4, 1, 2)
    assert all(type(n) is int for n in (rot.max_size, rot.keep, rot.step))
    cache = KVCache(step=np.int16(3))
    cache.update_and_fetch(k, k)
    assert cache.make_mask(window=np.int64(2)) == ("causal", 2)
    assert cache.trim(np.int64(1)) == 1 and cache.offset == 2


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: KVCache(step=True), "KVCache: step must be an int"),
        (lambda: KVCache(step=2.0), "KVCache: step must be an int"),
        (lambda: RotatingKVCache(4.0), "RotatingKVCache: max_size must be an int"),
        (lambda: RotatingKVCache(4, keep=False), "RotatingKVCache: keep must be an int"),
        (lambda: KVCache().trim(True), "KVCache.trim: n must be an int"),
        (lambda: KVCache().make_mask(window=1.5), "KVCache.make_mask: window must be an int"),
    ],
    ids=["step-bool", "step-float", "max_size-float", "keep-bool", "trim-bool", "window-float"],
)
def test_integer_arguments_refuse_bools_and_floats(call, match):
    with pytest.raises(TypeError, match=match):
        call()
