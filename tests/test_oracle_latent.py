"""Multi-head latent attention against HF transformers' ``DeepseekV3Attention``.

A tiny random-init module (built offline from a ``DeepseekV3Config``): with the query LoRA and
without it (``q_lora_rank=None``), DeepSeek's interleaved rotary pairs and HF's rotate-half ones,
yarn scaling with ``mscale_all_dim`` (the softmax scale's ``mscale ** 2``), in float32 and
bfloat16; both forms of ours against HF's eager attention, which expands the heads.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SIZES = {"hidden_size": 32, "num_attention_heads": 4, "kv_lora_rank": 16,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
# HF name -> ours
NAMES = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "wq_b",
         "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "wkv_b",
         "o_proj": "wo"}  # fmt: skip


def _hf(q_lora_rank: int | None, interleave: bool):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    config = DeepseekV3Config(
        **SIZES, num_key_value_heads=4, q_lora_rank=q_lora_rank, rope_interleave=interleave,
        max_position_embeddings=256, rope_scaling=dict(YARN),
    )  # fmt: skip
    config._attn_implementation = "eager"
    module = DeepseekV3Attention(config, 0).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            norm = "layernorm" in name
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if norm else 0.3 * torch.randn_like(p))
    return config, module, DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("q_lora_rank", "interleave"), [(12, True), (None, False)])
def test_latent_attention_matches_deepseek_v3_attention(
    backend, dtype, form, q_lora_rank, interleave
):
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    config, module, rotary = _hf(q_lora_rank, interleave)
    td = getattr(torch, dtype)
    module = module.to(td)
    torch.manual_seed(1)
    B, L = 2, 5
    x = torch.randn(B, L, SIZES["hidden_size"]).to(td)
    cos, sin = rotary(x, torch.arange(L)[None].expand(B, -1))
    causal = torch.full((L, L), torch.finfo(td).min, dtype=td).triu(1)[None, None]
    with torch.no_grad():
        want, _ = module(x, (cos.to(td), sin.to(td)), causal)

    def on(t):
        return pl.asarray(t.detach().float().numpy(), backend=backend, dtype=dtype)

    weights = {NAMES[n.rsplit(".", 1)[0]]: on(p) for n, p in module.state_dict().items()}
    rope = {"traditional": interleave, "base": config.rope_parameters["rope_theta"],
            "scaling": config.rope_parameters, "max_position_embeddings": 256}  # fmt: skip
    got = pl.latent_attention(
        on(x), **weights, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, rope=rope, form=form,
    )  # fmt: skip
    assert_close(got, want.float().numpy().astype(np.float32), backend=backend, dtype=dtype)
