"""Multi-head latent attention (DeepSeek V3, Kimi K2) and the attention with ``D_v != D`` it
rests on.

Values against the float64 reference (``reference.latent_attention``: head by head, the keys and
values expanded from the latent, its own softmax), on every backend, dtype, form and attention
path; properties: the shape rule and the dtype kept, causality (a later token changes no earlier
output), the absorbed form equals the expanded one, cached decode equals the full forward (the
cache holding the latent, ``R + d_r`` numbers per token), the backends agree with NumPy; the
yarn softmax scale; quantized projections; bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.attn.latent import FORMS, absorbs, latent_softmax_scale
from portable_llm.attn.latent_args import LatentWeights
from portable_llm.testing import (
    LATENT_DIMS,
    assert_close,
    random_array,
    random_latent_layer,
    random_weight,
    reference,
    tolerance,
)
from portable_llm.testing.strategies import LATENT_SIZES, latent_sizes, seeds

FORM = st.sampled_from(FORMS[1:])  # expanded, absorbed
# JAX compiles every eager op anew per shape and dtype (tens of seconds per test here): its
# default run keeps the float32 reference values and the fused-kernel choice; the rest run in
# tox -e slow there (the report's latent_attention+cache row decodes with JAX's static shapes).
SLOW_ON_JAX = pytest.mark.slow_on("jax")
IMPLS = st.sampled_from(["auto", "portable", "tiled"])


def _layer(sizes: dict, seed: int, dtype: str, backend: str) -> tuple:
    """``x`` and the layer's weights on the backend (with its dims), and their float64 copies."""
    x = random_array(seed, (sizes["B"], sizes["L"], sizes["hidden_size"]), dtype, backend=backend)
    arrays, refs = random_latent_layer(seed + 1, sizes, dtype, backend=backend)
    dims = {n: sizes[n] for n in LATENT_DIMS}
    return x[0], {**arrays, **dims}, x[1], {**refs, **dims}


@pytest.mark.slow_on("jax", dtypes=("float64",))
@given(sizes=latent_sizes(), form=FORM, impl=IMPLS, seed=seeds())
def test_latent_attention_matches_reference(backend, dtype, sizes, form, impl, seed):
    x, kw, xr, ref = _layer(sizes, seed, dtype, backend)
    out = pl.latent_attention(x, **kw, form=form, impl=impl, block_size=2)
    assert_close(out, reference.latent_attention(xr, **ref), backend=backend, dtype=dtype)


@SLOW_ON_JAX
@given(sizes=latent_sizes(), seed=seeds())
def test_the_absorbed_form_equals_the_expanded_form(backend, sizes, seed):
    # float64: the two orders of the same products agree to float64's tolerance, so a slip in
    # which rows of kv_b_proj are W_UK and which W_UV (or a transpose) cannot hide.
    x, kw, _, _ = _layer(sizes, seed, "float64", backend)
    expanded = pl.latent_attention(x, **kw, form="expanded")
    assert_close(pl.latent_attention(x, **kw, form="absorbed"), expanded)


@SLOW_ON_JAX
@given(sizes=latent_sizes(), seed=seeds())
def test_an_earlier_output_ignores_later_tokens(backend, sizes, seed):
    x, kw, xr, _ = _layer({**sizes, "L": 7}, seed, "float32", backend)
    t = seed % 6 + 1  # keep tokens 0 .. t - 1
    later = xr.copy()
    later[:, t:] = np.random.default_rng(seed).uniform(-3, 3, later[:, t:].shape)
    changed = pl.asarray(later.astype(np.float32), backend=backend)
    for form in ("expanded", "absorbed"):
        a = pl.to_numpy(pl.latent_attention(x, **kw, form=form))
        b = pl.to_numpy(pl.latent_attention(changed, **kw, form=form))
        np.testing.assert_array_equal(a[:, :t], b[:, :t])
        assert not np.allclose(a[:, t:], b[:, t:])  # the later rows do see the change


@SLOW_ON_JAX
@given(sizes=latent_sizes(), form=FORM, seed=seeds(), cut=st.sampled_from([1, 3]),
       static=st.booleans())  # fmt: skip
def test_cached_decode_equals_the_full_forward(backend, sizes, form, seed, cut, static):
    # A prefill of `cut` tokens, then one token at a time, through one KVCache: the outputs
    # equal the full forward's rows, and the cache holds the latent, not the heads. With
    # static_shapes (JAX's models), the views hold slots past the offset that only the cache's
    # mask hides.
    sizes = {**sizes, "L": 5}
    x, kw, _, _ = _layer(sizes, seed, "float32", backend)
    full = pl.to_numpy(pl.latent_attention(x, **kw, form=form))
    cache = pl.KVCache(step=4, static_shapes=static)
    got = [pl.latent_attention(x[:, :cut, :], **kw, cache=cache, form=form)]
    got += [pl.latent_attention(x[:, t : t + 1, :], **kw, cache=cache, form=form)
            for t in range(cut, 5)]  # fmt: skip
    assert_close(np.concatenate([pl.to_numpy(g) for g in got], axis=1), full)
    c_kv, k_pe = cache.state
    B, R, dr = sizes["B"], sizes["kv_lora_rank"], sizes["qk_rope_head_dim"]
    assert (tuple(c_kv.shape), tuple(k_pe.shape)) == ((B, 1, 8, R), (B, 1, 8, dr))


@SLOW_ON_JAX
def test_the_cache_holds_the_normalized_latent_and_the_rotated_key(backend):
    sizes = {**LATENT_SIZES[0], "B": 2, "L": 3}
    x, kw, xr, ref = _layer(sizes, 7, "float64", backend)
    cache = pl.KVCache()
    pl.latent_attention(x, **kw, cache=cache)
    c_kv, k_pe = (pl.to_numpy(a)[:, 0, :3] for a in cache.state)  # (B, L, R), (B, L, d_r)
    R = sizes["kv_lora_rank"]
    latent = reference.linear(xr, ref["wkv_a"])
    tol = tolerance("float64", backend)  # MLX's float64 exp, cos, sin: float32-accurate
    want = reference.rms_norm(latent[..., :R], ref["kv_a_norm"], 1e-6)
    assert_close(c_kv, want, rtol=tol.rtol, atol=tol.atol)
    want = reference.rope(latent[..., R:], np.arange(3), traditional=True)
    assert_close(k_pe, want, rtol=tol.rtol, atol=tol.atol)


@SLOW_ON_JAX
def test_the_latent_cache_is_smaller_than_the_full_cache(backend):
    # Bytes per token in the buffers: the latent cache R + d_r numbers, a cache of the expanded
    # keys and values H (d_n + d_r) + H d_v (measured on the buffers themselves).
    sizes = {**LATENT_SIZES[0], "B": 1, "L": 8}
    x, kw, _, _ = _layer(sizes, 3, "float32", backend)
    latent = pl.KVCache(step=8)
    pl.latent_attention(x[:, :7, :], **kw, cache=latent)
    H, R, dn, dr, dv = (sizes[n] for n in LATENT_DIMS)
    full = pl.KVCache(step=8)
    k = pl.asarray(np.zeros((1, H, 7, dn + dr), np.float32), backend=backend)
    full.update_and_fetch(k, pl.asarray(np.zeros((1, H, 7, dv), np.float32), backend=backend))

    def per_token(cache: pl.KVCache) -> int:
        return sum(pl.to_numpy(b).nbytes for b in cache.state) // cache.capacity

    assert per_token(latent) == 4 * (R + dr) == 80
    assert per_token(full) == 4 * H * (dn + dr + dv) == 288


@SLOW_ON_JAX
@given(sizes=latent_sizes(), seed=seeds())
def test_backends_agree_with_numpy(backend, sizes, seed):
    x, kw, _, _ = _layer(sizes, seed, "float32", backend)
    on_numpy = {n: pl.to_numpy(a) if not isinstance(a, int) else a for n, a in kw.items()}
    want = pl.latent_attention(pl.to_numpy(x), **on_numpy)
    assert_close(pl.latent_attention(x, **kw), pl.to_numpy(want), backend=backend)


@SLOW_ON_JAX
def test_the_yarn_scale(backend):
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    m = 0.1 * np.log(40.0) + 1.0
    assert latent_softmax_scale(192, yarn) == pytest.approx(192**-0.5 * m * m, rel=1e-15)
    assert latent_softmax_scale(192, {**yarn, "mscale_all_dim": 0}) == 192**-0.5
    assert latent_softmax_scale(192, {**yarn, "rope_type": "default"}) == 192**-0.5
    sizes = {**LATENT_SIZES[0], "B": 1, "L": 5}
    x, kw, xr, ref = _layer(sizes, 11, "float64", backend)
    rope = {"traditional": True, "scaling": yarn, "max_position_embeddings": 2560}
    out = pl.latent_attention(x, **kw, rope=rope, offset=3)
    want = reference.latent_attention(xr, **ref, rope_options=rope, offset=3)
    assert_close(out, want, backend=backend, dtype="float64")


def test_the_form_rule():
    w = LatentWeights(*([None] * 13), num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, norm_eps=1e-6)  # fmt: skip
    # DeepSeek V3: absorbed up to L = 170 (170 * 768 < 512 * 256 = 131072 <= 171 * 768)
    assert absorbs(1, w) and absorbs(170, w) and not absorbs(171, w)


@SLOW_ON_JAX
def test_quantized_projections_equal_their_dequantized_weights(backend):
    sizes = {**LATENT_SIZES[0], "B": 2, "L": 3}
    x, kw, _, _ = _layer(sizes, 5, "float32", backend)
    quantized = {
        n: pl.quantize(kw[n], bits=8, group_size=g) for n, g in (("wkv_a", 32), ("wkv_b", 16))
    }
    plain = {**kw, **{n: pl.dequantize(q) for n, q in quantized.items()}}
    for form in ("expanded", "absorbed"):
        got = pl.latent_attention(x, **{**kw, **quantized}, form=form)
        assert_close(got, pl.latent_attention(x, **plain, form=form))


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_the_fused_attention_takes_the_latent_head_dims(backend, form):
    # torch's and MLX's fused SDPA take D_v != D: auto runs them (JAX's takes one head dim, the
    # others have none), with the portable path's values.
    sizes = {**LATENT_SIZES[0], "B": 2, "L": 5}
    x, kw, _, _ = _layer(sizes, 9, "float32", backend)
    with pl.trace() as t:
        out = pl.latent_attention(x, **kw, form=form)
    ran = [e.impl for e in t if e.op == "scaled_dot_product_attention"]
    assert ran == ["native" if backend in ("torch", "mlx") else "portable"]
    assert_close(out, pl.latent_attention(x, **kw, form=form, impl="portable"))


# -- scaled_dot_product_attention with another head dim for the values -------------------------


@SLOW_ON_JAX
@given(impl=st.sampled_from(["auto", "portable", "tiled", "native"]), seed=seeds(),
       mask=st.sampled_from([None, "causal"]), L=st.sampled_from([1, 4]))  # fmt: skip
def test_sdpa_with_another_value_head_dim_matches_reference(backend, impl, seed, mask, L):
    # Latent attention's absorbed form: 4 query heads over one key head of D = 12, D_v = 8.
    # The native kernels that take D_v != D (torch's, MLX's) run; JAX's refuses (applies).
    q, qr = random_array(seed, (2, 4, L, 12), "float32", backend=backend)
    k, kr = random_array(seed + 1, (2, 1, 6, 12), "float32", backend=backend)
    v, vr = random_array(seed + 2, (2, 1, 6, 8), "float32", backend=backend)
    want = reference.scaled_dot_product_attention(qr, kr, vr, mask=mask)
    try:
        out = pl.scaled_dot_product_attention(q, k, v, mask=mask, impl=impl, block_size=4)
    except ValueError as e:
        assert impl == "native" and backend in ("numpy", "jax", "array_api_strict"), e
        return
    assert_close(out, want, backend=backend, dtype="float32")


@SLOW_ON_JAX
def test_a_kv_cache_keeps_another_value_head_dim(backend):
    cache = pl.KVCache(step=2)
    k = random_weight(0, (1, 1, 3, 6), "float32", backend=backend)[0]
    v = random_weight(1, (1, 1, 3, 2), "float32", backend=backend)[0]
    cache.update_and_fetch(k, v)
    k_all, v_all = cache.update_and_fetch(k[:, :, :1, :], v[:, :, :1, :])
    assert (tuple(k_all.shape), tuple(v_all.shape)) == ((1, 1, 4, 6), (1, 1, 4, 2))
    assert_close(v_all[:, :, 3:, :], pl.to_numpy(v)[:, :, :1], backend=backend)
    with pytest.raises(ValueError, match=r"head dim D_v \(the cache's: 2\); k \(1, 1, 1, 6\)"):
        cache.update_and_fetch(k[:, :, :1, :], k[:, :, :1, :])


# -- bad input ----------------------------------------------------------------------------------


def _bad(change: dict) -> dict:
    sizes = {**LATENT_SIZES[0], "B": 1, "L": 2}
    x, kw, _, _ = _layer(sizes, 0, "float32", "numpy")
    return {"x": x, **kw, **change}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"wq": np.zeros((48, 32), np.float32)}, ValueError,
         r"latent_attention: give wq \(q_proj\) or the query LoRA, not both; got wq and wq_a, "
         r"q_a_norm, wq_b"),
        ({"wq_b": None}, ValueError,
         r"without wq \(q_proj\), the query LoRA needs wq_a, q_a_norm and wq_b; missing wq_b"),
        ({"wq_b": np.zeros((40, 12), np.float32)}, ValueError,
         r"wq_b must have shape \(48, 12\) \(H \* \(d_n \+ d_r\) = 4 x 12, q_lora_rank\), "
         r"got \(40, 12\)"),
        ({"wkv_a": np.zeros((16, 32), np.float32)}, ValueError,
         r"wkv_a must have shape \(20, 32\) \(kv_lora_rank \+ d_r = 16 \+ 4, E\), got \(16, 32\)"),
        ({"kv_a_norm": np.ones(8, np.float32)}, ValueError,
         r"kv_a_norm must have shape \(16,\) \(kv_lora_rank\), got \(8,\)"),
        ({"wkv_b": np.zeros((64, 16), np.float32)}, ValueError,
         r"wkv_b must have shape \(56, 16\) \(H \* \(d_n \+ d_v\) = 4 x 14, R\), got \(64, 16\)"),
        ({"wo": np.zeros((24, 32), np.float32)}, ValueError,
         r"wo must have shape \(E_out, 24\) \(H \* d_v = 4 x 6\), got \(24, 32\)"),
        ({"bkv_a": np.zeros(16, np.float32)}, ValueError,
         r"bkv_a must have shape \(20,\) \(the rows of wkv_a\), got \(16,\)"),
        ({"wkv_b": np.zeros((56, 16), np.int32)}, TypeError,
         r"latent_attention: wkv_b must have a float dtype"),
        ({"qk_rope_head_dim": 3, "wkv_a": np.zeros((19, 32), np.float32)}, ValueError,
         r"qk_rope_head_dim must be even \(RoPE turns pairs\), got 3"),
        ({"num_heads": 0}, ValueError, r"num_heads must be an int >= 1, got 0"),
        ({"form": "naive"}, ValueError,
         r"form must be one of \('auto', 'expanded', 'absorbed'\), got 'naive'"),
        ({"x": np.zeros((2, 32), np.float32)}, ValueError,
         r"x must have shape \(B, L, E\), got \(2, 32\)"),
        ({"rope": {"theta": 1.0}}, ValueError, r"unknown rope option\(s\) 'theta'"),
        ({"cache": object()}, TypeError, r"cache must be a KVCache or RotatingKVCache"),
        ({"offset": -1}, ValueError, r"latent_attention: offset must be"),
    ],
)  # fmt: skip
def test_latent_attention_rejects_bad_input(change, error, match):
    kw = _bad(change)
    with pytest.raises(error, match=match):
        pl.latent_attention(kw.pop("x"), **kw)


def test_empty_batch_or_length_gives_an_empty_result(backend):
    sizes = {**LATENT_SIZES[0], "B": 2, "L": 3}
    x, kw, _, _ = _layer(sizes, 0, "float32", backend)
    empty = np.zeros((2, 0, 24), np.float32)
    assert_close(pl.latent_attention(x[:, :0, :], **kw), empty, backend=backend)
