"""Attention sinks, clamped SwiGLU and the grouped router against HF transformers' modules.

gpt-oss: ``eager_attention_forward`` with ``module.sinks`` (the sink appended to each row's
logits), ``GptOssExperts._apply_gate`` and the whole ``GptOssMLP`` (its biases zeroed: moe has
no expert biases; its router, a softmax over the top-k logits, is ``router="softmax"`` with
``norm_topk_prob=True``). DeepSeek V3: ``DeepseekV3TopkRouter`` and the whole ``DeepseekV3MoE``
(routed experts, the correction bias, the shared expert). Small random-init modules; HF's
weights are copied in as HF stores them.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close, tolerance

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _np(t) -> np.ndarray:
    """A torch tensor's values on the host (bfloat16 widened: NumPy has none)."""
    return t.detach().cpu().to(torch.float32 if t.dtype == torch.bfloat16 else t.dtype).numpy()


def _on(t, backend: str, dtype: str):
    return pl.asarray(_np(t), backend=backend, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sinks_match_gpt_oss_eager_attention(backend, dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    torch.manual_seed(0)
    B, H, H_kv, L, D = 2, 4, 2, 5, 8
    td = getattr(torch, dtype)
    q, k, v = (torch.randn(B, n, L, D).to(td) for n in (H, H_kv, H_kv))
    sinks = (torch.randn(H) * 2).to(td)
    causal = torch.full((L, L), torch.finfo(td).min, dtype=td).triu(1)[None, None]  # HF's mask
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=H // H_kv, training=False)
    with torch.no_grad():
        want, _ = eager_attention_forward(module, q, k, v, causal, scaling=D**-0.5)
    got = pl.scaled_dot_product_attention(
        *(_on(t, backend, dtype) for t in (q, k, v)), mask="causal",
        sinks=_on(sinks, backend, dtype),
    )  # fmt: skip
    # HF takes the softmax in the input dtype (no float32 upcast): bfloat16's tolerance covers it
    assert_close(got, _np(want.transpose(1, 2)), backend=backend, dtype=dtype)


def _gpt_oss_mlp(E: int, inter: int, X: int, top_k: int):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=E, intermediate_size=inter, num_local_experts=X,
                          num_experts_per_tok=top_k, swiglu_limit=0.5)  # fmt: skip
    block = GptOssMLP(config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.zeros_like(p) if "bias" in name else torch.randn_like(p) * 0.5)
    return block


def test_clamped_swiglu_matches_gpt_oss_apply_gate(backend):
    block = _gpt_oss_mlp(12, 8, 4, 2)
    torch.manual_seed(1)
    gate_up = torch.randn(3, 5, 16) * 3  # interleaved halves, values beyond the limit 0.5
    with torch.no_grad():
        want = block.experts._apply_gate(gate_up)
    gate, up = (_on(gate_up[..., j::2].contiguous(), backend, "float32") for j in (0, 1))
    # The module's own limit and alpha (transformers versions differ in how the config's
    # swiglu_limit reaches it); the inputs, 3 * randn, reach past gpt-oss's default 7 too.
    got = pl.clamped_swiglu(gate, up, limit=block.experts.limit, alpha=block.experts.alpha)
    assert_close(got, _np(want), backend=backend)


def test_moe_with_clamped_swiglu_matches_gpt_oss_mlp(backend):
    E, inter, X, top_k = 12, 8, 4, 2
    block = _gpt_oss_mlp(E, inter, X, top_k)
    torch.manual_seed(2)
    x = torch.randn(2, 5, E)
    with torch.no_grad():
        want, _ = block(x)
    gate_up = block.experts.gate_up_proj.detach()  # (X, E, 2I), gate and up interleaved
    experts = [
        gate_up[..., 0::2].transpose(1, 2),
        gate_up[..., 1::2].transpose(1, 2),
        block.experts.down_proj.detach().transpose(1, 2),
    ]  # (X, I, E) x2, (X, E, I)
    got = pl.moe(
        _on(x, backend, "float32"), _on(block.router.weight, backend, "float32"),
        *(_on(t.contiguous(), backend, "float32") for t in experts), top_k=top_k,
        norm_topk_prob=True, swiglu_limit=block.experts.limit, swiglu_alpha=block.experts.alpha,
    )  # fmt: skip
    assert_close(got, _np(want), backend=backend)


def _deepseek_moe(dtype: str):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=12, moe_intermediate_size=6, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, hidden_act="silu",
    )  # fmt: skip
    block = DeepseekV3MoE(config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        block.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    return block.to(getattr(torch, dtype))


def _grouped(block) -> dict:
    g = block.gate
    return {"router": "grouped", "top_k": g.top_k, "n_group": g.num_group,
            "topk_group": g.topk_group, "norm_topk_prob": g.norm_topk_prob,
            "routed_scaling_factor": g.routed_scaling_factor}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_grouped_route_matches_deepseek_v3_router(backend, dtype):
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    block = _deepseek_moe(dtype)
    torch.manual_seed(1)
    x = torch.randn(2, 5, 12, dtype=getattr(torch, dtype))
    with torch.no_grad():
        _, want_w, want_ids = block.gate(x)
    weights, ids = pl.route(
        _on(x, backend, dtype), _on(block.gate.weight, backend, dtype),
        e_score_correction_bias=_on(block.gate.e_score_correction_bias, backend, "float32"),
        **_grouped(block),
    )  # fmt: skip
    # HF's topk(sorted=False) leaves the order of the k open: compare by expert id.
    got_ids, want_ids = pl.to_numpy(ids).reshape(-1, 3), _np(want_ids)
    np.testing.assert_array_equal(np.sort(got_ids, -1), np.sort(want_ids, -1))
    got_w = np.take_along_axis(pl.to_numpy(weights).reshape(-1, 3), np.argsort(got_ids, -1), -1)
    want_w = np.take_along_axis(_np(want_w), np.argsort(want_ids, -1), -1)
    tol = tolerance("float32")  # HF computes the router in float32 for every dtype
    assert_close(got_w, want_w, rtol=tol.rtol, atol=tol.atol, dtype=got_w.dtype)


def test_moe_with_the_grouped_router_matches_deepseek_v3_moe(backend):
    block = _deepseek_moe("float32")
    torch.manual_seed(2)
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        want = block(x)
    fused = block.experts.gate_up_proj.detach()  # (X, 2I, E)
    half = fused.shape[1] // 2
    arrays = [block.gate.weight, fused[:, :half], fused[:, half:], block.experts.down_proj]
    s = block.shared_experts
    got = pl.moe(
        _on(x, backend, "float32"), *(_on(t, backend, "float32") for t in arrays),
        shared=tuple(_on(m.weight, backend, "float32")
                     for m in (s.gate_proj, s.up_proj, s.down_proj)),
        e_score_correction_bias=_on(block.gate.e_score_correction_bias, backend, "float32"),
        **_grouped(block),
    )  # fmt: skip
    assert_close(got, _np(want), backend=backend)
