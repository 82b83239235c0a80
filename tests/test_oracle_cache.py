"""KV caches against independent implementations: HF transformers' ``DynamicCache`` driving a
``Qwen2Attention`` layer (its weights copied into our attention block), and mlx-lm's
``KVCache`` / ``RotatingKVCache`` with its own attention, fed the same chunks.

HF computes RoPE's angles in float32, so the comparison runs in float32 at float32's tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.attn.block import attention
from portable_llm.attn.padding import left_pad
from portable_llm.caches.kv import KVCache, RotatingKVCache
from portable_llm.testing import assert_close

pytestmark = pytest.mark.oracle

E, H, H_KV, D = 16, 4, 2, 4
THETA = 10000.0


@pytest.fixture(scope="session")
def hf_layer():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    cfg = transformers.Qwen2Config(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=H_KV, head_dim=D,
        rope_theta=THETA, num_hidden_layers=1, vocab_size=32,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = qwen2.Qwen2Attention(cfg, layer_idx=0).eval()
    rotary = qwen2.Qwen2RotaryEmbedding(cfg)
    weights = {
        "wq": layer.q_proj.weight, "wk": layer.k_proj.weight, "wv": layer.v_proj.weight,
        "wo": layer.o_proj.weight, "bq": layer.q_proj.bias, "bk": layer.k_proj.bias,
        "bv": layer.v_proj.bias,
    }  # fmt: skip
    kw = {k: v.detach() for k, v in weights.items()}
    return torch, transformers, cfg, layer, rotary, kw


def _hf_step(torch, layer, rotary, cache, x, positions, allowed):
    """One HF forward of the chunk ``x`` at ``positions`` (B, L) with ``allowed`` (B, L, S)."""
    cos, sin = rotary(x, positions)
    bias = torch.zeros(allowed.shape, dtype=x.dtype)
    bias = bias.masked_fill(~allowed, torch.finfo(x.dtype).min)[:, None]  # (B, 1, L, S)
    with torch.no_grad():
        out, _ = layer(x, (cos, sin), bias, past_key_values=cache)
    return out


@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 2, 1], [7]], ids=["tokens", "mixed", "one"])
def test_dynamic_cache_decoding_matches_ours(hf_layer, chunks):
    torch, transformers, cfg, layer, rotary, kw = hf_layer
    x = torch.randn(2, sum(chunks), E, generator=torch.Generator().manual_seed(1))
    theirs, ours, t = transformers.DynamicCache(config=cfg), KVCache(step=4), 0
    for n in chunks:
        positions = torch.arange(t, t + n)[None].expand(2, n)
        allowed = (torch.arange(t + n)[None, :] <= torch.arange(t, t + n)[:, None])[None]
        want = _hf_step(torch, layer, rotary, theirs, x[:, t : t + n], positions, allowed)
        got = attention(x[:, t : t + n], num_heads=H, num_kv_heads=H_KV, cache=ours,
                        rope={"base": THETA}, **kw)  # fmt: skip
        assert_close(got, want, err_msg=f"chunk at {t}")
        t += n
    assert ours.offset == theirs.get_seq_length() == t


def test_dynamic_cache_left_padded_batch_matches_ours(hf_layer):
    """HF's padded batch: ``attention_mask`` (B, S), positions ``cumsum(mask) - 1``."""
    torch, transformers, cfg, layer, rotary, kw = hf_layer
    lengths, steps = [5, 2, 3], 3
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randn(n, E, generator=gen) for n in lengths]
    new = torch.randn(len(lengths), steps, E, generator=gen)
    _, pad = left_pad([np.zeros(n, dtype=np.int64) for n in lengths], backend="torch")
    W = max(lengths)
    x = torch.zeros(len(lengths), W, E)
    for b, p in enumerate(prompts):
        x[b, W - len(p) :] = p
    theirs, ours = transformers.DynamicCache(config=cfg), KVCache(left_padding=pad)
    key_ok = torch.arange(W)[None, :] >= pad[:, None]  # (B, S): HF's attention_mask
    t, n, chunk = 0, W, x
    for step in range(steps + 1):
        positions = (torch.cumsum(key_ok.long(), -1) - 1).clamp(min=0)[:, t : t + n]
        causal = torch.arange(t + n)[None, :] <= torch.arange(t, t + n)[:, None]  # (L, S)
        allowed = causal[None] & key_ok[:, None, :]
        want = _hf_step(torch, layer, rotary, theirs, chunk, positions, allowed)
        got = attention(chunk, num_heads=H, num_kv_heads=H_KV, cache=ours,
                        rope={"base": THETA}, **kw)  # fmt: skip
        for b in range(len(lengths)):  # padded query rows are garbage in HF (all keys masked)
            real = slice(max(0, int(pad[b]) - t), n)
            assert_close(got[b, real], want[b, real], err_msg=f"row {b}, step {step}")
        t += n
        n, chunk = 1, new[:, step : step + 1]
        key_ok = torch.cat([key_ok, torch.ones(len(lengths), 1, dtype=torch.bool)], dim=1)


# -- mlx-lm -----------------------------------------------------------------------------------


def _mlx_lm_run(theirs, ours, chunks: list[int], seed: int = 0) -> None:
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

    rng = np.random.default_rng(seed)
    t = 0
    for n in chunks:
        q, k, v = (mx.array(rng.uniform(-2, 2, (1, h, n, 8)).astype(np.float32))
                   for h in (H, H_KV, H_KV))  # fmt: skip
        mask = theirs.make_mask(n, window_size=None, return_array=False)  # before their update
        k_t, v_t = theirs.update_and_fetch(k, v)
        want = mlx_lm_attention(q, k_t, v_t, theirs, scale=8**-0.5, mask=mask)
        k_o, v_o = ours.update_and_fetch(k, v)
        mask, window = ours.make_mask()
        got = pl.scaled_dot_product_attention(q, k_o, v_o, mask=mask, window=window)
        assert_close(got, want, err_msg=f"chunk of {n} at {t}")
        t += n
    assert ours.offset == theirs.offset


@pytest.mark.parametrize("chunks", [[1] * 9, [3, 1, 1, 5, 1, 2, 1]], ids=["tokens", "mixed"])
def test_mlx_lm_kv_cache_matches_ours(chunks):
    cache = pytest.importorskip("mlx_lm.models.cache")
    _mlx_lm_run(cache.KVCache(), KVCache(step=4), chunks)


@pytest.mark.parametrize(
    "keep, chunks",
    [(0, [1] * 12), (0, [3, 1, 1, 5, 1, 2, 1, 1, 1, 6, 1]), (2, [3] + [1] * 10)],
    ids=["tokens", "chunks-past-the-window", "sinks"],
)
def test_mlx_lm_rotating_kv_cache_matches_ours(keep, chunks):
    """With ``keep > 0`` only single tokens past the window: for a multi-token chunk there,
    mlx-lm's mask (a plain window over its returned keys) hides the kept tokens from the chunk's
    later queries, which our rule (``j < keep`` or in the last ``max_size - keep``) keeps."""
    cache = pytest.importorskip("mlx_lm.models.cache")
    _mlx_lm_run(cache.RotatingKVCache(6, keep=keep), RotatingKVCache(6, keep, step=4), chunks)


def test_mlx_lm_trim_matches_ours():
    cache = pytest.importorskip("mlx_lm.models.cache")
    theirs, ours = cache.RotatingKVCache(8), RotatingKVCache(8, step=4)
    _mlx_lm_run(theirs, ours, [2, 1, 1])
    assert theirs.trim(2) == ours.trim(2) == 2
    _mlx_lm_run(theirs, ours, [1, 3, 1], seed=1)
    assert ours.offset == 7
