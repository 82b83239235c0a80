"""mamba2_mixer (the Mamba-2 mixer of Falcon-H1) and gated_rms_norm.

Values against the float64 references (``reference.mamba2_mixer``, composed of the recurrent
ops' step-by-step references; ``reference.gated_rms_norm``, one group at a time) on every
backend and dtype, with every option (the gated norm before or after the gate, or the plain
gate; groups; biases; Falcon-H1's in-multiplier and mup vector; a start state); the properties:
one call over a sequence equals a prefix then token-by-token calls passing the state, and
``all_states`` holds those states; the gated norm with a gate of zeros is zero, and (gate after
the norm) it is invariant to the scale of ``x`` in each group; bad input. transformers'
``FalconH1Mixer`` itself: tests/test_oracle_recurrent.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.testing import MODEL_TOLERANCES, assert_close, random_array, reference
from portable_llm.testing.strategies import chunk_sizes, mamba2_dims, seeds


def _weights(seed: int, dims: tuple[int, ...], dtype: str, backend: str, *, norm: str,
             chunk: int = 4) -> tuple[pl.Mamba2Weights, pl.Mamba2Weights]:  # fmt: skip
    """The mixer's weights on ``backend`` and their float64 NumPy copy. ``norm``: "before"
    or "after" (the gated norm before or after the gate) or "none" (the plain gate)."""
    _, _, G, H, P, N, K, E = dims
    Di = H * P
    C, width = Di + 2 * G * N, 2 * Di + 2 * G * N + H  # convolved, projected
    kw = {"backend": backend}
    shapes = {
        "in_proj": ((width, E), 1 / math.sqrt(E)), "in_bias": ((width,), 0.1),
        "conv": ((C, K), 0.3),
        "conv_bias": ((C,), 0.1), "D": ((H,), 1 / 3), "dt_bias": ((H,), 1 / 3),
        "out_proj": ((E, Di), 1 / math.sqrt(Di)), "out_bias": ((E,), 0.1),
        "norm": ((Di,), 1 / 3), "mup": ((width,), 1 / 3),
    }  # fmt: skip
    got, ref = {}, {}
    for i, (name, (shape, scale)) in enumerate(shapes.items()):
        got[name], ref[name] = random_array(seed + i, shape, dtype, **kw, scale=scale)
    got["A"], ref["A"] = random_array(seed + 20, (H,), "float32", **kw, low=-2.0, high=-0.5)
    if norm == "none":
        got["norm"] = ref["norm"] = None
    opts = {"n_groups": G, "head_dim": P, "norm_before_gate": norm == "before", "eps": 1e-5,
            "in_multiplier": 0.75, "chunk_size": chunk}  # fmt: skip
    return pl.Mamba2Weights(**got, **opts), pl.Mamba2Weights(**ref, **opts)


def _state(seed: int, dims: tuple[int, ...], dtype: str, backend: str) -> tuple[list, list]:
    b, _, G, H, P, N, K, _ = dims
    conv = random_array(seed, (b, K - 1, H * P + 2 * G * N), dtype, backend=backend)
    ssm = random_array(seed + 1, (b, H, P, N), "float32", backend=backend, scale=1 / 3)
    return [conv[0], ssm[0]], [conv[1], ssm[1]]


def _tol(dtype: str) -> dict:
    """A mixer is a composite (about 6 roundings in half precision): the model table there."""
    t = MODEL_TOLERANCES.get(dtype)
    return {} if t is None else {"rtol": t.rtol, "atol": t.atol}


# JAX: float32 checks the adapter (each drawn shape compiles the scan: ~10 s a dtype)
@pytest.mark.slow_on("jax", dtypes=("float64", "float16", "bfloat16"))
@given(dims=mamba2_dims(), norm=st.sampled_from(["before", "after", "none"]),
       start=st.booleans(), seed=seeds())  # fmt: skip
def test_matches_reference(backend, dtype, dims, norm, start, seed):
    w, w_ref = _weights(seed, dims, dtype, backend, norm=norm)
    b, L, *_, E = dims
    x, x_ref = random_array(seed + 30, (b, L, E), dtype, backend=backend)
    state, state_ref = _state(seed + 40, dims, dtype, backend) if start else (None, None)
    y, (conv, ssm) = pl.mamba2_mixer(x, w, state=None if state is None else tuple(state))
    want_y, (want_conv, want_ssm) = reference.mamba2_mixer(x_ref, w_ref, state_ref)
    assert_close(y, want_y, backend=backend, dtype=dtype, **_tol(dtype))
    assert_close(conv, want_conv, backend=backend, dtype=dtype, **_tol(dtype))
    ssm_dtype = "float64" if dtype == "float64" else "float32"
    assert_close(ssm, want_ssm, backend=backend, dtype=ssm_dtype,
                 **(_tol(dtype) or {"rtol": 1e-5, "atol": 1e-5}))  # fmt: skip


@pytest.mark.slow_on("jax")  # a program per drawn shape; the reference tests run there
@given(dims=mamba2_dims(), chunk=chunk_sizes(), seed=seeds())
def test_steps_equal_the_sequence_and_all_states(backend, dims, chunk, seed):
    """A prefix then one token at a time (the decode of a cache) equals one call; the states
    after each token (``all_states``) are those of the calls that stop there."""
    w, _ = _weights(seed, dims, "float32", backend, norm="after", chunk=chunk)
    b, L, *_, E = dims
    x, _ = random_array(seed + 30, (b, L, E), "float32", backend=backend)
    y, (conv, ssm) = pl.mamba2_mixer(x, w)
    _, (every_conv, every_ssm) = pl.mamba2_mixer(x, w, all_states=True)
    first = max(L - 2, 1)
    parts, state = [], None
    for start, end in [(0, first), *((t, t + 1) for t in range(first, L))]:
        part, state = pl.mamba2_mixer(x[:, start:end, :], w, state=state)
        parts.append(pl.to_numpy(part))
        assert_close(every_conv[:, end - 1, ...], pl.to_numpy(state[0]), backend=backend)
        assert_close(every_ssm[:, end - 1, ...], pl.to_numpy(state[1]), backend=backend)
    assert_close(y, np.concatenate(parts, axis=1), backend=backend)
    assert_close(conv, pl.to_numpy(state[0]), backend=backend)
    assert_close(ssm, pl.to_numpy(state[1]), backend=backend)


@pytest.mark.slow_on("jax")  # compiles the scan per length; the reference test runs there
def test_padding_leaves_the_state_zero(backend):
    """Left padding masked out (``mask``): the padded row's outputs after the pads and its
    states equal those of the row without them, ``in_proj``'s bias included (HF lets it into
    the convolution's window from the pads)."""
    dims = (1, 5, 2, 4, 2, 3, 4, 6)
    w, _ = _weights(0, dims, "float32", backend, norm="none")
    x, _ = random_array(30, (1, 5, 6), "float32", backend=backend)
    pads = random_array(31, (1, 2, 6), "float32", backend=backend)[0]
    padded = pl.asarray(np.concatenate([pl.to_numpy(pads), pl.to_numpy(x)], axis=1),
                        backend=backend)  # fmt: skip
    mask = pl.asarray(np.array([[0, 0, 1, 1, 1, 1, 1]], np.float32), backend=backend)
    y, (conv, ssm) = pl.mamba2_mixer(x, w)
    y_pad, (conv_pad, ssm_pad) = pl.mamba2_mixer(padded, w, mask=mask)
    assert_close(y_pad[:, 2:, :], pl.to_numpy(y), backend=backend)
    assert_close(conv_pad, pl.to_numpy(conv), backend=backend)
    assert_close(ssm_pad, pl.to_numpy(ssm), backend=backend)


@pytest.mark.slow_on("jax")  # compiles the scan again; the GGUF family test runs there
def test_quantized_projections_equal_their_dequantized_weights(backend):
    """``in_proj`` and ``out_proj`` as QuantizedWeight: the mixer equals the one over their
    dequantized float weights (quantized_linear's product)."""
    dims = (2, 5, 2, 4, 16, 8, 4, 64)  # E and I = 64: whole groups of 32
    w, _ = _weights(0, dims, "float32", backend, norm="after")
    q = {n: pl.quantize(getattr(w, n), bits=8, group_size=32) for n in ("in_proj", "out_proj")}
    plain = type(w)(**{**w.__dict__, **{n: pl.dequantize(v) for n, v in q.items()}})
    x, _ = random_array(30, (2, 5, 64), "float32", backend=backend)
    y, (conv, ssm) = pl.mamba2_mixer(x, type(w)(**{**w.__dict__, **q}))
    want, (want_conv, want_ssm) = pl.mamba2_mixer(x, plain)
    assert_close(y, pl.to_numpy(want), backend=backend)
    assert_close(conv, pl.to_numpy(want_conv), backend=backend)
    assert_close(ssm, pl.to_numpy(want_ssm), backend=backend)


@given(shape=st.sampled_from([(3, 8), (2, 3, 12), (5, 6)]), groups=st.sampled_from([1, 2]),
       before=st.booleans(), seed=seeds())  # fmt: skip
def test_gated_rms_norm_matches_reference(backend, dtype, shape, groups, before, seed):
    x, x_ref = random_array(seed, shape, dtype, backend=backend)
    g, g_ref = random_array(seed + 1, shape, dtype, backend=backend)
    w, w_ref = random_array(seed + 2, shape[-1:], dtype, backend=backend)
    got = pl.gated_rms_norm(x, g, w, eps=1e-5, n_groups=groups, norm_before_gate=before)
    want = reference.gated_rms_norm(x_ref, g_ref, w_ref, 1e-5, groups, before)
    assert_close(got, want, backend=backend, dtype=dtype)


def test_gated_rms_norm_properties(backend):
    """A zero gate gives zeros; with the gate after the norm each group is scale invariant."""
    x, _ = random_array(0, (3, 8), "float32", backend=backend)
    g, _ = random_array(1, (3, 8), "float32", backend=backend)
    w, _ = random_array(2, (8,), "float32", backend=backend)
    zero = pl.asarray(np.zeros((3, 8), np.float32), backend=backend)
    assert_close(pl.gated_rms_norm(x, zero, w), np.zeros((3, 8), np.float32), backend=backend)
    scale = pl.asarray(np.repeat(np.array([[3.0, 0.25]], np.float32), 4, axis=1), backend=backend)
    base = pl.gated_rms_norm(x, g, w, eps=0.0, n_groups=2)
    assert_close(pl.gated_rms_norm(x * scale, g, w, eps=0.0, n_groups=2), pl.to_numpy(base),
                 backend=backend)  # fmt: skip


def _bad(**change):
    dims = (1, 2, 1, 2, 2, 3, 4, 6)
    w, _ = _weights(0, dims, "float32", "numpy", norm="after")
    x = np.zeros((1, 2, 6), np.float32)
    opts = {k: change.pop(k) for k in ("state", "mask") if k in change}
    x = change.pop("x", x)
    w = type(w)(**{**w.__dict__, **change})
    return lambda: pl.mamba2_mixer(x, w, **opts)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (_bad(x=np.zeros((2, 6), np.float32)), ValueError,
         r"mamba2_mixer: x must have shape \(B, L, E\)"),
        (_bad(in_proj=np.zeros((16, 5), np.float32)), ValueError,
         r"mamba2_mixer: in_proj must have shape \(16, 6\)"),
        (_bad(D=np.zeros((3,), np.float32)), ValueError, r"mamba2_mixer: D must have shape \(2,\)"),
        (_bad(conv=np.zeros((11, 4), np.float32)), ValueError,
         r"mamba2_mixer: conv must have C = H \* P \+ 2 n_groups N"),
        (_bad(n_groups=3), ValueError, r"n_groups dividing H"),
        (_bad(norm=np.zeros((5,), np.float32)), ValueError,
         r"mamba2_mixer: norm must have shape \(4,\)"),
        (_bad(mask=np.ones((1, 3), np.float32)), ValueError,
         r"mamba2_mixer: mask must have shape \(B, L\) = \(1, 2\)"),
        (_bad(state=(np.zeros((1, 2, 10), np.float32), None)), ValueError,
         r"mamba2_mixer: state\[0\] must have shape \(B, K - 1, C\) = \(1, 3, 10\)"),
        (_bad(state=(None, np.zeros((1, 2, 2, 4), np.float32))), ValueError,
         r"mamba2_mixer: state\[1\] must have shape \(B, H, P, N\) = \(1, 2, 2, 3\)"),
        (_bad(state=np.zeros((1, 3, 10), np.float32)), TypeError,
         r"mamba2_mixer: state must be a pair \(conv, ssm\)"),
        (_bad(in_proj=np.zeros((16, 6), np.int32)), TypeError, r"mamba2_mixer: in_proj"),
        (_bad(out_proj=pl.quantize(np.ones((6, 32), np.float32), bits=8, group_size=32)),
         ValueError, r"mamba2_mixer: out_proj must have shape \(6, 4\), got a QuantizedWeight"),
        (_bad(chunk_size=0), ValueError, r"mamba2_mixer: chunk_size must be >= 1"),
        (_bad(head_dim=2.0), TypeError, r"mamba2_mixer: head_dim must be an int"),
        (_bad(dt_limit=(0.5, 0.1)), ValueError, r"mamba2_mixer: dt_limit\[1\] must be"),
        (_bad(eps=-1.0), ValueError, r"mamba2_mixer: eps must be"),
        (_bad(norm_before_gate=1), TypeError, r"mamba2_mixer: norm_before_gate must be a bool"),
        (lambda: pl.mamba2_mixer(np.zeros((1, 2, 6), np.float32), {}), TypeError,
         r"mamba2_mixer: weights must be a Mamba2Weights"),
        (lambda: pl.gated_rms_norm(np.zeros((2, 6), np.float32), np.zeros((2, 6), np.float32),
                                   np.ones(6, np.float32), n_groups=4), ValueError,
         r"gated_rms_norm: n_groups=4 must divide x's last dimension 6"),
        (lambda: pl.gated_rms_norm(np.zeros((2, 6), np.float32), np.zeros((2, 5), np.float32),
                                   np.ones(6, np.float32)), ValueError,
         r"gated_rms_norm: gate must have x's shape and dtype"),
        (lambda: pl.gated_rms_norm(np.zeros((2, 6), np.float32), np.zeros((2, 6), np.float32),
                                   np.ones(5, np.float32)), ValueError,
         r"gated_rms_norm: weight must have shape \(6,\)"),
    ],
)  # fmt: skip
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
