"""Llama 4's ops beyond the attention pieces of test_llama4_attention.py, on every backend:
the sigmoid router and its MoE (the scores scale the experts' inputs, a shared expert added),
the attention block's chunk / q-k L2 norm / temperature options, and chunked attention through
the KV caches (decode equals the full forward, left padding) and paged attention; against the
float64 reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.attn.paged import paged_attention
from portable_llm.attn.visibility import visible
from portable_llm.testing import assert_close, random_array, random_weight, reference, tolerance
from portable_llm.testing.strategies import seeds

X, INTER, E = 4, 12, 8  # experts, their I, the hidden size


def _moe_inputs(seed: int, dtype: str, backend: str, top_k: int) -> tuple[list, list]:
    """x, router, experts (gate, up, down) and a shared expert; no near-tie of the router
    logits at the top-k boundary (the choice is then the same in float64 and in dtype)."""
    for s in range(seed, seed + 10_000, 10):
        x, x_r = random_array(s, (2, 3, E), dtype, backend=backend)
        w, w_r = random_weight(s + 1, (X, E), dtype, backend=backend)
        logits = -np.sort(-reference.linear(x_r, w_r), axis=-1)
        gap = logits[..., top_k - 1] - logits[..., top_k] if top_k < X else np.inf
        if np.all(gap > 4 * tolerance(dtype).rtol * np.abs(logits).max()):
            break
    arrays, refs = [x, w], [x_r, w_r]
    shapes = [(X, INTER, E), (X, INTER, E), (X, E, INTER), (6, E), (6, E), (E, 6)]
    for j, shape in enumerate(shapes):
        a, r = random_weight(s + 2 + j, shape, dtype, backend=backend)
        arrays.append(a)
        refs.append(r)
    return arrays, refs


@pytest.mark.slow_on("jax")  # a compilation per shape and dtype: minutes
@given(seed=seeds(), top_k=st.sampled_from([1, 2, X]))
def test_sigmoid_route_matches_reference(backend, dtype, seed, top_k):
    (x, w, *_), (x_r, w_r, *_) = _moe_inputs(seed, dtype, backend, top_k)
    scores, ids = pl.route(x, w, top_k=top_k, router="sigmoid")
    want_scores, want_ids = reference.route(x_r, w_r, top_k=top_k, router="sigmoid")
    got_ids = pl.to_numpy(ids)
    # The same experts; two of near-equal logits may swap places in half precision.
    np.testing.assert_array_equal(np.sort(got_ids, axis=-1), np.sort(want_ids, axis=-1))
    by_id, want_by_id = np.argsort(got_ids, axis=-1), np.argsort(want_ids, axis=-1)
    out = "float64" if dtype == "float64" else "float32"
    assert pl.get_backend(backend).dtype_name(scores.dtype) == out
    tol = tolerance(dtype, backend)  # the logits round to x's dtype, as HF's router
    assert_close(
        np.take_along_axis(pl.to_numpy(scores), by_id, axis=-1),
        np.take_along_axis(want_scores, want_by_id, axis=-1),
        rtol=tol.rtol, atol=tol.atol, dtype=out,
    )  # fmt: skip


@pytest.mark.slow_on("jax")  # a compilation per shape and dtype: minutes
@pytest.mark.parametrize("impl", ["auto", "portable", "dense"])
@given(seed=seeds(), top_k=st.sampled_from([1, 2, X]), shared=st.booleans())
def test_sigmoid_moe_matches_reference(backend, dtype, impl, seed, top_k, shared):
    """Llama4TextMoe: sum over the k chosen experts of mlp_e(x * sigmoid(logit_e)) (+ shared)."""
    (x, w, g, u, d, *s), (x_r, w_r, g_r, u_r, d_r, *s_r) = _moe_inputs(seed, dtype, backend, top_k)
    extra, extra_r = ({"shared": tuple(s)}, {"shared": tuple(s_r)}) if shared else ({}, {})
    got = pl.moe(x, w, g, u, d, top_k=top_k, router="sigmoid", impl=impl, **extra)
    want = reference.moe(x_r, w_r, g_r, u_r, d_r, top_k=top_k, router="sigmoid", **extra_r)
    assert_close(got, want, backend=backend, dtype=dtype)


def test_one_expert_is_the_mlp_of_the_scaled_input(backend):
    """One expert, top-1: ``mlp(x * sigmoid(x @ w.T))``, the dense MLP of the scaled input."""
    (x, w, g, u, d, *_), _ = _moe_inputs(0, "float32", backend, 1)
    w, g, u, d = w[:1, ...], g[0:1, ...], u[0:1, ...], d[0:1, ...]
    xp = pl.get_backend(backend).xp
    score = 1.0 / (1.0 + xp.exp(-pl.linear(x, w)))  # (2, 3, 1)
    want = pl.mlp(x * score, g[0, ...], u[0, ...], d[0, ...])
    got = pl.moe(x, w, g, u, d, top_k=1, router="sigmoid")
    assert_close(got, pl.to_numpy(want), backend=backend, dtype="float32")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"router": "softplus"}, r"router must be one of \('softmax', 'sigmoid', 'grouped'\)"),
        ({"router": "sigmoid", "norm_topk_prob": True}, "router=.sigmoid. scores are not renorm"),
    ],
)
def test_router_bad_arguments(options: dict[str, Any], match: str) -> None:
    (x, w, g, u, d, *_), _ = _moe_inputs(0, "float32", "numpy", 2)
    with pytest.raises(ValueError, match="route: " + match):
        pl.route(x, w, top_k=2, **options)
    with pytest.raises(ValueError, match="moe: " + match):
        pl.moe(x, w, g, u, d, top_k=2, **options)


# -- the attention block ------------------------------------------------------------------------

H, H_KV, D, L = 4, 2, 8, 9
ROPE = {"base": 500000.0, "traditional": True}


def _attn_weights(dtype: str, backend: str) -> tuple[dict[str, Any], dict[str, Any]]:
    shapes = {"wq": (H * D, 16), "wk": (H_KV * D, 16), "wv": (H_KV * D, 16), "wo": (16, H * D)}
    arrays, refs = {}, {}
    for j, (name, shape) in enumerate(shapes.items()):
        arrays[name], refs[name] = random_weight(10 + j, shape, dtype, backend=backend)
    return arrays, refs


@pytest.mark.slow_on("jax")  # a compilation per shape and dtype: minutes
@pytest.mark.parametrize(
    "options",
    [
        {"chunk": 4, "qk_l2_norm": True, "rope": ROPE},  # a RoPE layer of Llama 4
        {"temperature": (2.0, 0.5), "rope": None},  # a no-RoPE layer, tuned from position 1
        {"chunk": 3, "temperature": (4.0, 0.1), "qk_l2_norm": True, "rope": ROPE},
    ],
)
def test_attention_llama4_options_match_reference(backend, dtype, options):
    w, w_r = _attn_weights(dtype, backend)
    x, x_r = random_array(1, (2, L, 16), dtype, backend=backend)
    got = pl.attention(x, **w, num_heads=H, num_kv_heads=H_KV, head_dim=D, norm_eps=1e-5,
                       **options)  # fmt: skip
    ref_opts = {k: v for k, v in options.items() if k != "rope"}
    want = reference.attention(x_r, *w_r.values(), H, H_KV, D, norm_eps=1e-5,
                               rope_options=options["rope"], **ref_opts)  # fmt: skip
    assert_close(got, want, backend=backend, dtype=dtype)


@pytest.mark.slow_on("jax")  # a compilation per shape and dtype: minutes
@pytest.mark.parametrize("pad", [None, [0, 3]])
def test_chunked_cache_decode_equals_full(backend, pad):
    """A prompt of 5 then one token at a time through a KVCache (the chunk rule in its mask)
    equals the full forward; left padding: each row's chunks start at its first real token."""
    w, _ = _attn_weights("float32", backend)
    x, _ = random_array(2, (2, L, 16), "float32", backend=backend)
    opts = {**w, "num_heads": H, "num_kv_heads": H_KV, "head_dim": D, "chunk": 4,
            "qk_l2_norm": True, "rope": ROPE}  # fmt: skip
    left = None if pad is None else pl.asarray(np.asarray(pad), backend=backend)
    full = pl.attention(x, **opts, left_padding=left)
    cache = pl.KVCache(left_padding=left)
    parts = [pl.attention(x[:, :5, :], **opts, cache=cache)]
    parts += [pl.attention(x[:, j : j + 1, :], **opts, cache=cache) for j in range(5, L)]
    got = np.concatenate([pl.to_numpy(p) for p in parts], axis=1)
    if pad is not None:  # the padded row's real tokens equal that row alone
        alone = pl.attention(x[1:, 3:, :], **opts)
        assert_close(pl.to_numpy(full)[1:, 3:], pl.to_numpy(alone), dtype="float32")
    assert_close(got, pl.to_numpy(full), dtype="float32")


def test_chunk_with_padding_shifts_per_row(backend):
    """visible(chunk=, pad=): row b's chunks start at column pad[b] (HF's chunked mask)."""
    xp = pl.get_backend(backend).xp
    pad = pl.asarray(np.array([0, 2]), backend=backend)
    got = pl.to_numpy(visible(xp, 7, 7, chunk=3, pad=pad))  # (2, 1, 7, 7)
    for b, p in enumerate((0, 2)):
        want = np.zeros((7, 7), dtype=bool)
        want[p:, p:] = reference.causal_mask(7 - p, 7 - p, None, 3)
        np.testing.assert_array_equal(got[b, 0], want)


@pytest.mark.parametrize("impl", ["auto", "portable", "blocked", "pool"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_attention_chunk_equals_dense(backend, impl, q_len):
    """Rows of 7, 13 and 4 keys in shuffled pages of 4: each row's queries see their own chunk
    of 5 positions (chunks crossing page boundaries), as the dense reference with the mask."""
    lens, page, chunk = (7, 13, 4), 4, 5
    rng = np.random.default_rng(0)
    need = [-(-n // page) for n in lens]
    pool = pl.PagePool(sum(need), page, H_KV, D, "float32", backend=backend)
    ids = [pool.allocate(1)[0] for _ in range(sum(need))]
    ids = [ids[i] for i in rng.permutation(len(ids))]
    tables = np.zeros((len(lens), max(need)), dtype=np.int32)
    want = []
    q, q64 = random_array(5, (len(lens), H, q_len, D), "float32", backend=backend)
    for b, n in enumerate(lens):
        pages, ids = ids[: need[b]], ids[need[b] :]
        tables[b, : need[b]] = pages
        k, k64 = random_array(20 + b, (H_KV, n, D), "float32", backend=backend)
        v, v64 = random_array(40 + b, (H_KV, n, D), "float32", backend=backend)
        pool.write(pages, 0, k, v)
        mask = reference.causal_mask(q_len, n, None, chunk)
        want.append(reference.scaled_dot_product_attention(q64[b : b + 1], k64[None],
                                                           v64[None], mask=mask))  # fmt: skip
    t = pl.asarray(tables, backend=backend)
    n_arr = pl.asarray(np.asarray(lens, dtype=np.int32), backend=backend)
    got = paged_attention(q, pool, t, n_arr, chunk=chunk, impl=impl, block_pages=2)
    assert_close(got, np.concatenate(want, axis=0), backend=backend, dtype="float32")
