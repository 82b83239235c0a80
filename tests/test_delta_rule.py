"""gated_delta_rule: Qwen3-Next's Gated DeltaNet, chunked (WY/UT) and recurrent forms.

Values against the float64 step-by-step reference (``reference.gated_delta_rule``) on every
backend, dtype, form and chunk size; the properties: the chunked form equals the recurrent one
for every chunk size, one call over a sequence equals token-by-token calls passing the state,
``all_states`` are those states, a zero write (``beta = 0``, ``g = 0``) keeps the state, a full
write (``beta = 1``) of a unit key makes the state return ``v`` for that key, the backends
agree; bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.testing import assert_close, random_array, reference, tolerance
from portable_llm.testing.strategies import chunk_sizes, delta_rule_dims, seeds


def _inputs(seed: int, dims: tuple[int, ...], dtype: str, backend: str) -> tuple[list, list]:
    """q, k, v, g, beta, state: keys of norm <= 1 (stable without the L2 norm too), g in
    [-1, 0], beta in [0, 1]."""
    B, L, h_k, H, d_k, d_v = dims
    kw = {"backend": backend}
    pairs = [
        random_array(seed, (B, L, h_k, d_k), dtype, **kw, scale=1 / 3),
        random_array(seed + 1, (B, L, h_k, d_k), dtype, **kw, scale=1 / (3 * d_k**0.5)),
        random_array(seed + 2, (B, L, H, d_v), dtype, **kw),
        random_array(seed + 3, (B, L, H), dtype, **kw, low=-1.0, high=0.0),
        random_array(seed + 4, (B, L, H), dtype, **kw, low=0.0, high=1.0),
        random_array(seed + 5, (B, H, d_k, d_v), "float32", **kw),
    ]
    return [a for a, _ in pairs], [r for _, r in pairs]


def _state_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


@pytest.mark.slow_on("jax", dtypes=("float64",))  # JAX: float32 checks the adapter
@pytest.mark.parametrize("impl", ["auto", "portable", "recurrent"])
@given(dims=delta_rule_dims(), norm=st.booleans(), chunk=chunk_sizes(), seed=seeds())
def test_matches_reference(backend, dtype, impl, dims, norm, chunk, seed):
    arrays, refs = _inputs(seed, dims, dtype, backend)
    o, state = pl.gated_delta_rule(*arrays[:5], state=arrays[5], qk_l2_norm=norm,
                                   chunk_size=chunk, impl=impl)  # fmt: skip
    want_o, want_state = reference.gated_delta_rule(*refs, qk_l2_norm=norm)
    assert_close(o, want_o, backend=backend, dtype=dtype)
    # the state is float32 (float64): within the inputs' dtype of the exact state
    tol = tolerance(dtype, backend)
    assert_close(state, want_state, backend=backend, dtype=_state_dtype(dtype),
                 rtol=tol.rtol, atol=tol.atol)  # fmt: skip


@pytest.mark.slow_on("jax")  # a program per drawn shape; the reference tests run there
@given(dims=delta_rule_dims(), chunk=chunk_sizes(), seed=seeds())
def test_chunked_equals_recurrent_and_all_states(backend, dims, chunk, seed):
    arrays, _ = _inputs(seed, dims, "float32", backend)
    opts = {"state": arrays[5], "qk_l2_norm": True, "chunk_size": chunk}
    o_c, every_c = pl.gated_delta_rule(*arrays[:5], **opts, all_states=True, impl="portable")
    o_r, every_r = pl.gated_delta_rule(*arrays[:5], **opts, all_states=True, impl="recurrent")
    assert_close(o_c, pl.to_numpy(o_r), backend=backend)
    assert_close(every_c, pl.to_numpy(every_r), backend=backend)
    _, last = pl.gated_delta_rule(*arrays[:5], **opts, impl="portable")
    assert_close(every_c[:, -1, ...], pl.to_numpy(last), backend=backend)


@pytest.mark.slow_on("jax")  # a program per drawn shape; the reference tests run there
@given(dims=delta_rule_dims(), seed=seeds())
def test_steps_equal_the_sequence(backend, dims, seed):
    (q, k, v, g, beta, s), _ = _inputs(seed, dims, "float32", backend)
    whole, last = pl.gated_delta_rule(q, k, v, g, beta, state=s, chunk_size=2)
    outs, state = [], s
    for t in range(q.shape[1]):
        one = [a[:, t : t + 1, ...] for a in (q, k, v, g, beta)]
        o, state = pl.gated_delta_rule(*one, state=state)  # auto: the recurrent form
        outs.append(pl.to_numpy(o))
    assert_close(whole, np.concatenate(outs, axis=1), backend=backend)
    assert_close(last, pl.to_numpy(state), backend=backend)


def test_no_write_and_no_decay_keep_the_state(backend):
    (q, k, v, g, _, s), refs = _inputs(7, (2, 3, 1, 2, 4, 3), "float32", backend)
    zero = g * 0.0
    o, state = pl.gated_delta_rule(q, k, v, zero, zero, state=s)
    assert_close(state, refs[5], backend=backend, dtype="float32")
    # every token reads the held state: o_t = (q_t / sqrt(D_k))^T S, key head 0 for both heads
    want = np.einsum("btd,bhdv->bthv", refs[0][:, :, 0] / 2.0, refs[5])
    assert_close(o, want, backend=backend, dtype="float32")


def test_a_full_write_stores_v_for_its_key(backend):
    # beta = 1, g = 0, a unit key: k^T S_new = k^T S + (k.k)(v - k^T S) = v, read with q = k.
    (_, k, v, g, beta, s), refs = _inputs(8, (1, 1, 2, 4, 8, 3), "float32", backend)
    o, _ = pl.gated_delta_rule(k, k, v, g * 0.0, beta * 0.0 + 1.0, state=s, qk_l2_norm=True,
                               scale=1.0)  # fmt: skip
    assert_close(o, refs[2], backend=backend, dtype="float32")


def test_backends_agree(other_backend):
    arrays, refs = _inputs(4, (2, 5, 2, 4, 8, 3), "float32", other_backend)
    got, state = pl.gated_delta_rule(*arrays[:5], state=arrays[5], qk_l2_norm=True, chunk_size=2)
    want, want_state = pl.gated_delta_rule(*(np.float32(r) for r in refs[:5]),
                                           state=np.float32(refs[5]), qk_l2_norm=True,
                                           chunk_size=2)  # fmt: skip
    assert_close(got, want, backend=other_backend)
    assert_close(state, want_state, backend=other_backend)


def _bad(**change):
    B, L, h_k, H, d_k, d_v = 1, 2, 1, 2, 4, 3
    z = np.zeros
    args = {"q": z((B, L, h_k, d_k), np.float32), "k": z((B, L, h_k, d_k), np.float32),
            "v": z((B, L, H, d_v), np.float32), "g": z((B, L, H), np.float32),
            "beta": z((B, L, H), np.float32)}  # fmt: skip
    args.update(change)
    opts = {n: args.pop(n) for n in list(args) if n not in ("q", "k", "v", "g", "beta")}
    return lambda: pl.gated_delta_rule(*args.values(), **opts)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (_bad(k=np.zeros((1, 2, 2, 4), np.float32)), ValueError,
         r"gated_delta_rule: k must have shape \(B, L, H_k, D_k\) = \(1, 2, 1, 4\), got"),
        (_bad(v=np.zeros((1, 2, 3, 3), np.float32), q=np.zeros((1, 2, 2, 4), np.float32),
              k=np.zeros((1, 2, 2, 4), np.float32), g=np.zeros((1, 2, 3), np.float32),
              beta=np.zeros((1, 2, 3), np.float32)), ValueError, r"H_k dividing H"),
        (_bad(g=np.zeros((1, 2, 1), np.float32)), ValueError, r"gated_delta_rule: g must have"),
        (_bad(beta=np.zeros((1, 2), np.float32)), ValueError, r"gated_delta_rule: beta must"),
        (_bad(v=np.zeros((1, 2, 2, 3), np.float64)), TypeError, r"arrays must share one dtype"),
        (_bad(state=np.zeros((1, 2, 3, 4), np.float32)), ValueError,
         r"gated_delta_rule: state must have shape \(B, H, D_k, D_v\) = \(1, 2, 4, 3\)"),
        (_bad(chunk_size=0), ValueError, r"gated_delta_rule: chunk_size must be >= 1"),
        (_bad(qk_l2_norm=1), TypeError, r"gated_delta_rule: qk_l2_norm must be a bool"),
        (_bad(scale=float("nan")), ValueError, r"gated_delta_rule: scale must be finite"),
        (_bad(impl="native"), ValueError, r"gated_delta_rule: backend 'numpy' has no native"),
    ],
)  # fmt: skip
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_last_chunk_shorter_than_the_others(backend):
    # The chunked form slices its chunks (the last one shorter: 5 tokens in chunks of 4) rather
    # than zero-padding them, which XLA's CPU flag of the JAX env miscompiled in ssd_scan.
    dtype = "float64" if "float64" in pl.get_backend(backend).float_dtypes() else "float32"
    arrays, refs = _inputs(0, (1, 5, 1, 2, 4, 3), dtype, backend)
    arrays[5] = pl.asarray(refs[5], backend=backend, dtype=dtype)
    o, state = pl.gated_delta_rule(*arrays[:5], state=arrays[5], chunk_size=4, impl="portable")
    want_o, want_state = reference.gated_delta_rule(*refs)
    assert_close(o, want_o, backend=backend, dtype=dtype)
    assert_close(state, want_state, backend=backend, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["portable", "recurrent"])
def test_qwen3_next_sizes_stay_within_float32_tolerance(backend, impl):
    # Qwen3-Next's head sizes (D_k = D_v = 128, twice the value heads), chunks of 64, 150 tokens.
    arrays, refs = _inputs(1, (1, 150, 2, 4, 128, 128), "float32", backend)
    want, want_state = reference.gated_delta_rule(*refs, qk_l2_norm=True)
    o, state = pl.gated_delta_rule(*arrays[:5], state=arrays[5], qk_l2_norm=True, chunk_size=64,
                                   impl=impl)  # fmt: skip
    assert_close(o, want, backend=backend, dtype="float32")
    assert_close(state, want_state, backend=backend, dtype="float32")
