"""RoPE against independent implementations: HF transformers' rotary embedding classes with
``apply_rotary_pos_emb`` (every scaling type), ``mx.fast.rope`` and mlx-lm's scaled RoPEs.

HF computes its angles in float32 for every input dtype, so float64 inputs are compared at
float32's tolerance (ours are float64-accurate there).
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close, random_array, tolerance

pytestmark = pytest.mark.oracle

B, H, H_KV, L, D = 2, 4, 2, 6, 32
OFFSETS = np.array([0, 9])  # per-sequence starts: positions up to 14
THETA = 10000.0

LONGROPE = {
    "rope_type": "longrope",
    "short_factor": np.linspace(1.0, 1.5, D // 2).tolist(),
    "long_factor": np.linspace(1.0, 9.0, D // 2).tolist(),
}
# name -> (HF config class, rope_parameters, max_position_embeddings)
HF_CASES = {
    "default": ("Qwen2Config", {"rope_type": "default"}, 512),
    "linear": ("Qwen2Config", {"rope_type": "linear", "factor": 4.0}, 512),
    "dynamic": ("Qwen2Config", {"rope_type": "dynamic", "factor": 2.0}, 32),  # base unchanged
    "dynamic_grown": ("Qwen2Config", {"rope_type": "dynamic", "factor": 2.0}, 8),  # 15 > 8
    "llama3": (
        "LlamaConfig",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        512,
    ),
    "yarn": (
        "Qwen2Config",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        128,
    ),
    "yarn_deepseek": (
        "Qwen2Config",
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        2560,
    ),
    "yarn_explicit": (
        "Qwen2Config",
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "attention_factor": 1.25,
            "beta_fast": 8,
            "beta_slow": 2,
            "truncate": False,
        },
        128,
    ),
    # Phi-3's longrope: per-pair factors, short up to the original length (positions reach 14
    # here: 15 <= 16), long beyond it (15 > 8); attention factor sqrt(1 + ln(mpe/L0) / ln(L0))
    "longrope": ("Qwen2Config", {**LONGROPE, "original_max_position_embeddings": 16}, 64),
    "longrope_long": ("Qwen2Config", {**LONGROPE, "original_max_position_embeddings": 8}, 64),
    "longrope_explicit": (
        "Qwen2Config",
        {**LONGROPE, "original_max_position_embeddings": 8, "attention_factor": 1.5},
        64,
    ),
}
DTYPES = ["float32", "float64", "bfloat16"]


def _hf_rotary(config_cls: str, theta: float, dims: int, heads: int, kv_heads: int,
               params: dict, mpe: int):  # fmt: skip
    """HF's rotary embedding module for this config, and its ``apply_rotary_pos_emb``."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    transformers.logging.set_verbosity_error()
    config = getattr(transformers, config_cls)(
        hidden_size=heads * dims,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=dims,
        max_position_embeddings=mpe,
        rope_parameters={**params, "rope_theta": theta},
    )
    module = modeling_llama if config_cls == "LlamaConfig" else modeling_qwen2
    prefix = "Llama" if config_cls == "LlamaConfig" else "Qwen2"
    return getattr(module, f"{prefix}RotaryEmbedding")(config), module.apply_rotary_pos_emb


def _hf(name: str):
    torch = pytest.importorskip("torch")
    config_cls, params, mpe = HF_CASES[name]
    emb, apply = _hf_rotary(config_cls, THETA, D, H, H_KV, params, mpe)
    return torch, emb, apply, params, mpe


def _tol(dtype: str):
    return tolerance("float32" if dtype == "float64" else dtype)


@pytest.mark.parametrize("name", list(HF_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_hf_rotary_embedding(name, dtype):
    torch, emb, apply_rotary_pos_emb, params, mpe = _hf(name)
    q, _ = random_array(1, (B, H, L, D), dtype, backend="torch")
    k, _ = random_array(2, (B, H_KV, L, D), dtype, backend="torch")
    position_ids = torch.from_numpy(OFFSETS[:, None] + np.arange(L))  # (B, L)
    cos_hf, sin_hf = emb(q, position_ids)  # (B, L, D) in q's dtype
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    tol = _tol(dtype)
    opts = {"base": THETA, "scaling": params, "max_position_embeddings": mpe}
    cos, sin = pl.rope_cos_sin(position_ids, D, dtype=dtype, **opts)
    assert_close(cos, cos_hf, rtol=tol.rtol, atol=tol.atol, err_msg="cos")
    assert_close(sin, sin_hf, rtol=tol.rtol, atol=tol.atol, err_msg="sin")
    offsets = torch.from_numpy(OFFSETS)
    assert_close(pl.rope(q, offset=offsets, **opts), q_hf, rtol=tol.rtol, atol=tol.atol)
    assert_close(pl.rope(k, offset=offsets, **opts), k_hf, rtol=tol.rtol, atol=tol.atol)
    assert_close(pl.apply_rope(q, cos[:, None, ...], sin[:, None, ...]), q_hf, atol=tol.atol)


@pytest.mark.parametrize("name", list(HF_CASES))
def test_rope_table_matches_hf_inv_freq(name):
    # HF builds theta in float32 with torch; ours is built op for op with NumPy: equal but where
    # the two libraries' float32 pow round differently (a few ulps).
    _, emb, _, params, mpe = _hf(name)
    from portable_llm.rotary.scaling import inv_freq_table, rope_spec

    spec = rope_spec("rope", {**params, "rope_theta": THETA}, max_position_embeddings=mpe)
    seq_len = int(OFFSETS.max()) + L
    if name in ("dynamic_grown", "longrope_long", "longrope_explicit"):
        torch = pytest.importorskip("torch")
        emb(torch.zeros(1), torch.arange(seq_len)[None])  # HF changes its table on first use
    assert spec.attention_factor == emb.attention_scaling
    assert_close(inv_freq_table(spec, D, "float32", seq_len), emb.inv_freq.numpy())


def test_partial_rotary_matches_hf_phi():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi import modeling_phi

    config = transformers.PhiConfig(
        hidden_size=H * D,
        num_attention_heads=H,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.5},
    )
    emb = modeling_phi.PhiRotaryEmbedding(config)
    q, _ = random_array(3, (B, H, L, D), "float32", backend="torch")
    position_ids = torch.from_numpy(OFFSETS[:, None] + np.arange(L))
    cos, sin = emb(q, position_ids)  # (B, L, D / 2)
    rot, rest = q[..., : D // 2], q[..., D // 2 :]  # PhiAttention's split
    q_hf = torch.cat([modeling_phi.apply_rotary_pos_emb(rot, rot, cos, sin)[0], rest], dim=-1)
    offsets = torch.from_numpy(OFFSETS)
    assert_close(pl.rope(q, offset=offsets, scaling=config.rope_parameters), q_hf)
    assert_close(pl.rope(q, offset=offsets, dims=D // 2), q_hf)


# -- MLX ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_rope_matches_mx_fast_rope(traditional, dtype):
    mx = pytest.importorskip("mlx.core")
    x, _ = random_array(4, (B, H, L, D), dtype, backend="mlx")
    offsets = mx.array(OFFSETS)
    cases = [  # (mx.fast.rope keywords, ours)
        ({"base": THETA, "scale": 1.0, "offset": 7}, {"offset": 7}),
        ({"base": 1e6, "scale": 1.0, "offset": offsets}, {"offset": offsets, "base": 1e6}),
        (
            {"base": THETA, "scale": 0.25, "offset": 3},
            {"offset": 3, "scaling": {"rope_type": "linear", "factor": 4.0}},
        ),
    ]
    for dims in (D, D // 2):
        for theirs, ours in cases:
            want = mx.fast.rope(x, dims, traditional=traditional, **theirs)
            got = pl.rope(x, dims=dims, traditional=traditional, impl="portable", **ours)
            assert_close(got, want, err_msg=f"dims={dims}, {theirs}")


@pytest.mark.parametrize("name", ["llama3", "yarn", "yarn_deepseek", "longrope_long"])
def test_rope_matches_mlx_lm(name):
    # mlx-lm's longrope (SuScaledRoPE) always takes the long factors: compared beyond L0 = 8
    mx = pytest.importorskip("mlx.core")
    rope_utils = pytest.importorskip("mlx_lm.models.rope_utils")
    _, params, mpe = HF_CASES[name]
    layer = rope_utils.initialize_rope(D, THETA, False, dict(params), mpe)
    x, _ = random_array(5, (B, H, L, D), "float32", backend="mlx")
    want = layer(x, offset=5)
    got = pl.rope(x, offset=5, base=THETA, scaling=params, max_position_embeddings=mpe)
    assert_close(got, want)
    mx.eval(got)


# -- long positions: ours and HF against the float64 formula -------------------------------------

# (HF config class, rope_theta, D, rope_parameters, max_position_embeddings)
LONG_CASES = {
    "qwen2": ("Qwen2Config", 1e6, 64, {"rope_type": "default"}, 32768),
    "llama3.1": (
        "LlamaConfig",
        5e5,
        128,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
    ),
    "dynamic_grown": ("Qwen2Config", 1e6, 64, {"rope_type": "dynamic", "factor": 2.0}, 512),
    "default_d80": ("Qwen2Config", 1e4, 80, {"rope_type": "default"}, 32768),  # 2i/80 inexact
}
LONG_START, LONG_STOP = 800, 4001


@pytest.mark.parametrize("name", list(LONG_CASES))
def test_rope_at_long_positions_is_within_the_float32_angle_bound(name):
    """Float32 angles ``m * theta_i`` lose accuracy in proportion to the position ``m``.

    Our table follows HF's float32 formula op for op, with a correctly rounded ``pow``: relative
    error ``k_i * u`` (u = 2^-24) with ``k_i = ln(base) * e_i`` for the rounding of the float32
    exponent ``e_i = 2i / D`` (exact when D is a power of two), plus one u each for ``pow``, the
    reciprocal and the angle's float32 product ``m * theta^``, plus up to three for the scaling
    kinds' own float32 steps (llama3's divide and blend, dynamic's float32 base). Rotating a
    pair ``(a, b)`` by an angle off by ``k_i * u * m * theta_i`` moves it by at most
    ``hypot(a, b)`` times that. Everything else (cos, sin, two products and a sum in float32) is
    position-independent and covered by the float32 entry of TOLERANCES. Where HF's ``pow``
    rounds correctly too (the default and llama3 tables, measured) the result is HF's to the bit.
    """
    torch = pytest.importorskip("torch")
    from portable_llm.testing import reference

    config_cls, theta, dims, params, mpe = LONG_CASES[name]
    emb, apply = _hf_rotary(config_cls, theta, dims, 2, 2, params, mpe)
    positions = np.arange(LONG_START, LONG_STOP)
    x, x64 = random_array(6, (1, 2, len(positions), dims), "float32", backend="torch")
    cos, sin = emb(x, torch.from_numpy(positions)[None])
    theirs = apply(x, x, cos, sin)[0].numpy().astype(np.float64)
    opts = {"base": theta, "scaling": params, "max_position_embeddings": mpe}
    ours = pl.rope(x, offset=LONG_START, **opts).numpy().astype(np.float64)
    want = reference.rope(x64, positions, **opts)

    u = np.finfo(np.float32).eps / 2
    freqs, attention = reference.rope_frequencies(dims, theta, params, mpe, LONG_STOP)
    half = dims // 2
    e = np.arange(0, dims, 2) / dims
    k = 6 + np.log(theta) * e * (dims & (dims - 1) != 0)  # (D/2,): see the docstring
    radius = np.hypot(x64[..., :half], x64[..., half:]) * attention  # (1, 2, L, D/2)
    angle_err = k * u * positions[:, None] * freqs  # (L, D/2)
    drift = np.concatenate([radius * angle_err] * 2, axis=-1)  # both halves of each pair
    tol = tolerance("float32")
    bound = tol.atol + tol.rtol * np.abs(want) + drift
    err = np.abs(ours - want)
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"
    if params["rope_type"] in ("default", "llama3") and dims & (dims - 1) == 0:
        assert np.mean(ours == theirs) >= 0.99, np.mean(ours == theirs)
