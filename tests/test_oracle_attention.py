"""Attention against independent implementations: HF transformers, torch, MLX, mlx-lm.

HF's eager attention (``repeat_kv``, float32 softmax), its mask builders (``sdpa_mask`` with the
causal and sliding-window mask functions), ``Qwen2Attention``/``Qwen3Attention`` with copied
weights, ``torch.nn.functional.scaled_dot_product_attention``, ``mx.fast.
scaled_dot_product_attention`` and mlx-lm's ``create_causal_mask``, each called directly.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close, random_array, random_weight

pytestmark = pytest.mark.oracle


def _torch():
    return pytest.importorskip("torch")


def _qkv(dtype: str, b=2, h=4, h_kv=2, L=5, S=7, d=8):
    return tuple(
        random_array(s, shape, dtype)
        for s, shape in ((0, (b, h, L, d)), (1, (b, h_kv, S, d)), (2, (b, h_kv, S, d)))
    )


# -- masks -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("L", "S"), [(1, 1), (4, 4), (2, 5), (1, 9), (6, 9)])
@pytest.mark.parametrize("window", [None, 1, 3, 20])
def test_causal_mask_equals_hf_sdpa_mask(L, S, window):
    torch = _torch()
    mu = pytest.importorskip("transformers.masking_utils")
    fn = (
        mu.causal_mask_function
        if window is None
        else mu.sliding_window_causal_mask_function(window)
    )
    hf = mu.sdpa_mask(
        batch_size=1, q_length=L, kv_length=S, q_offset=S - L, mask_function=fn,
        allow_is_causal_skip=False,
    )  # fmt: skip
    assert hf.dtype == torch.bool
    assert np.array_equal(pl.causal_mask(L, S, window=window), hf[0, 0].numpy())


@pytest.mark.parametrize(("L", "S"), [(4, 4), (2, 5), (1, 9)])
def test_additive_causal_mask_masks_where_hf_eager_mask_does(L, S):
    torch = _torch()
    mu = pytest.importorskip("transformers.masking_utils")
    hf = mu.eager_mask(batch_size=1, q_length=L, kv_length=S, q_offset=S - L, dtype=torch.float32)
    ours = pl.causal_mask(L, S, dtype="float32")
    # HF uses the float32 minimum where we use -inf; the allowed entries are 0 in both.
    hf_allowed = hf[0, 0].numpy() == 0.0
    assert np.array_equal(ours == 0.0, hf_allowed)
    assert np.all(np.isneginf(ours[~hf_allowed]))


@pytest.mark.parametrize(("L", "S"), [(4, 4), (2, 5), (1, 9)])
@pytest.mark.parametrize("window", [None, 2])
def test_causal_mask_equals_mlx_lm(L, S, window):
    pytest.importorskip("mlx.core")
    base = pytest.importorskip("mlx_lm.models.base")
    theirs = base.create_causal_mask(L, offset=S - L, window_size=window)
    assert np.array_equal(pl.causal_mask(L, S, window=window), np.array(theirs))


# -- scaled dot-product attention ------------------------------------------------------------


class _Module:
    """What HF's eager_attention_forward reads from the attention module."""

    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups
        self.training = False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_equals_hf_eager_attention_forward(dtype, window):
    torch = _torch()
    qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    mu = pytest.importorskip("transformers.masking_utils")
    (q, _), (k, _), (v, _) = _qkv(dtype)
    L, S = q.shape[-2], k.shape[-2]
    fn = (
        mu.causal_mask_function
        if window is None
        else mu.sliding_window_causal_mask_function(window)
    )
    hf_mask = mu.eager_mask(
        batch_size=2, q_length=L, kv_length=S, q_offset=S - L, mask_function=fn,
        dtype=torch.float32,
    )  # fmt: skip
    tq, tk, tv = (pl.asarray(a, backend="torch") for a in (q, k, v))
    hf, _ = qwen2.eager_attention_forward(
        _Module(2), tq, tk, tv, hf_mask.to(tq.dtype), scaling=q.shape[-1] ** -0.5
    )
    hf = hf.transpose(1, 2)  # HF returns (B, L, H, D)
    kw = {"window": window} if window else {"mask": "causal"}
    for backend in ("numpy", "torch"):
        ours = pl.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        assert_close(pl.to_numpy(ours), pl.to_numpy(hf), err_msg=backend)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["none", "causal", "bool", "additive"])
def test_sdpa_equals_torch_functional(dtype, case):
    torch = _torch()
    F = torch.nn.functional
    L = S = 6
    (q, _), (k, _), (v, _) = _qkv(dtype, L=L, S=S)
    tq, tk, tv = (torch.from_numpy(np.asarray(a)) for a in (q, k, v))
    rng = np.random.default_rng(3)
    allowed = rng.random((2, 1, L, S)) < 0.6
    allowed[..., 0] = True  # torch's own contract for empty rows is not what is compared here
    additive = np.where(allowed, rng.uniform(-1, 1, allowed.shape), -np.inf).astype(dtype)
    ours_kw, theirs_kw = {}, {}
    if case == "causal":
        ours_kw["mask"], theirs_kw["is_causal"] = "causal", True
    elif case == "bool":
        ours_kw["mask"], theirs_kw["attn_mask"] = allowed, torch.from_numpy(allowed)
    elif case == "additive":
        ours_kw["mask"], theirs_kw["attn_mask"] = additive, torch.from_numpy(additive)
    theirs = F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True, **theirs_kw)
    for impl in ("portable", "tiled"):
        ours = pl.scaled_dot_product_attention(q, k, v, impl=impl, block_size=4, **ours_kw)
        assert_close(ours, theirs.numpy(), err_msg=impl)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", ["none", "causal", "bool"])
def test_sdpa_equals_mx_fast(dtype, case):
    mx = pytest.importorskip("mlx.core")
    (q, _), (k, _), (v, _) = _qkv(dtype, L=3, S=7)
    mq, mk, mv = (pl.asarray(a, backend="mlx") for a in (q, k, v))
    allowed = np.random.default_rng(4).random((2, 4, 3, 7)) < 0.6
    allowed[..., -1] = True
    ours_kw, theirs_mask = {}, None
    if case == "causal":
        ours_kw["mask"] = theirs_mask = "causal"
    elif case == "bool":
        ours_kw["mask"], theirs_mask = allowed, mx.array(allowed)
    scale = q.shape[-1] ** -0.5
    theirs = mx.fast.scaled_dot_product_attention(mq, mk, mv, scale=scale, mask=theirs_mask)
    ours = pl.scaled_dot_product_attention(q, k, v, **ours_kw)  # NumPy
    assert_close(pl.to_numpy(theirs), ours)


# -- the attention block against HF ----------------------------------------------------------


def _hf_layer(kind: str, dtype: str):
    torch = _torch()
    tf = pytest.importorskip("transformers")
    common = dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=1, vocab_size=16, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    if kind == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m

        config, cls, rotary = tf.Qwen2Config(**common), m.Qwen2Attention, m.Qwen2RotaryEmbedding
    else:
        from transformers.models.qwen3 import modeling_qwen3 as m

        config = tf.Qwen3Config(**common, head_dim=12)  # H * D = 48 != E = 32, as in Qwen3
        cls, rotary = m.Qwen3Attention, m.Qwen3RotaryEmbedding
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = cls(config, layer_idx=0).eval()
    with torch.no_grad():  # weights as random_weight draws them; biases small; norms near 1
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.ndim == 1:
                p.uniform_(-0.3, 0.3)
            else:
                p.uniform_(-(p.shape[1] ** -0.5), p.shape[1] ** -0.5)
    return config, layer.to(getattr(torch, dtype)), rotary(config)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("offset", [0, 5])
def test_attention_block_equals_hf(kind, dtype, offset):
    torch = _torch()
    mu = pytest.importorskip("transformers.masking_utils")
    config, layer, rotary = _hf_layer(kind, dtype)
    B, L = 2, 6
    x, _ = random_array(7, (B, L, config.hidden_size), dtype, backend="torch")
    positions = torch.arange(offset, offset + L)[None].expand(B, L)
    cos, sin = rotary(x, positions)
    mask = mu.eager_mask(batch_size=B, q_length=L, kv_length=L, dtype=torch.float32).to(x.dtype)
    with torch.no_grad():
        hf, _ = layer(x, position_embeddings=(cos, sin), attention_mask=mask)
    weights = {
        "wq": layer.q_proj.weight, "wk": layer.k_proj.weight, "wv": layer.v_proj.weight,
        "wo": layer.o_proj.weight,
    }  # fmt: skip
    if kind == "qwen2":
        weights |= {"bq": layer.q_proj.bias, "bk": layer.k_proj.bias, "bv": layer.v_proj.bias}
    else:
        weights |= {"q_norm": layer.q_norm.weight, "k_norm": layer.k_norm.weight}
    weights = {k: w.detach() for k, w in weights.items()}
    rope = {"scaling": dict(config.rope_parameters)}
    kw = dict(
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=layer.head_dim, norm_eps=config.rms_norm_eps, rope=rope, offset=offset,
    )  # fmt: skip
    for backend in ("torch", "numpy"):
        ours = pl.attention(x, **weights, **kw, backend=backend)
        assert_close(pl.to_numpy(ours), pl.to_numpy(hf), err_msg=backend)


# -- mixed precision: float16 activations, float32 weights (mlx-lm's usual pairing) -----------


@pytest.mark.parametrize("backend", ["numpy", "torch", "mlx"])
def test_float16_activations_with_float32_weights_equal_mlx_lm_qwen3(backend):
    # mlx-lm's modules keep float32 weights and take float16 inputs; our block casts the weights
    # to x's dtype (docs/mixed-precision.md) and must agree within the float16 tolerance.
    pytest.importorskip(backend)
    mx = pytest.importorskip("mlx.core")
    qwen3 = pytest.importorskip("mlx_lm.models.qwen3")
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=16, num_key_value_heads=2,
        max_position_embeddings=128, head_dim=12, tie_word_embeddings=False, rope_theta=1e6,
    )  # fmt: skip
    layer = qwen3.Attention(args)
    H, H_kv, D, E = 4, 2, 12, 32
    shapes = {"wq": (H * D, E), "wk": (H_kv * D, E), "wv": (H_kv * D, E), "wo": (E, H * D)}
    w = {n: random_weight(i, s, "float32")[1].astype(np.float32) for i, (n, s) in
         enumerate(shapes.items())}  # fmt: skip
    for i, n in enumerate(("q_norm", "k_norm")):
        w[n] = random_array(10 + i, (D,), "float32", low=0.5, high=1.5)[1].astype(np.float32)
    layer.update(
        {
            "q_proj": {"weight": mx.array(w["wq"])}, "k_proj": {"weight": mx.array(w["wk"])},
            "v_proj": {"weight": mx.array(w["wv"])}, "o_proj": {"weight": mx.array(w["wo"])},
            "q_norm": {"weight": mx.array(w["q_norm"])},
            "k_norm": {"weight": mx.array(w["k_norm"])},
        }
    )  # fmt: skip
    assert layer.q_proj.weight.dtype == mx.float32
    _, x16 = random_array(7, (2, 6, E), "float16")
    theirs = layer(mx.array(x16.astype(np.float16)), mask="causal")
    mx.eval(theirs)
    x = pl.asarray(x16.astype(np.float16), backend=backend)
    weights = {n: pl.asarray(a, backend=backend) for n, a in w.items()}  # float32
    ours = pl.attention(
        x, **weights, num_heads=H, num_kv_heads=H_kv, head_dim=D, norm_eps=1e-6,
        rope={"base": 1e6},
    )  # fmt: skip
    # theirs computes in float32 (MLX promotes float16 @ float32); ours rounds in float16.
    want = np.array(theirs.astype(mx.float32)).astype(np.float64)
    assert_close(ours, want, backend=backend, dtype="float16")
