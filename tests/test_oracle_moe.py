"""moe against HF transformers' MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock.

Small random-init configs; HF's weights are copied in as HF stores them, the fused
``experts.gate_up_proj`` ``(X, 2I, E)`` split into its gate and up halves (no other reshaping).
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close, tolerance

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

E, INTER, X, TOP_K = 16, 24, 6, 2  # hidden size, expert intermediate size (I), experts, k


def _init(block, dtype: str):
    torch.manual_seed(0)  # the expert tensors are created with torch.empty: fill them all
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block.to(getattr(torch, dtype)).eval()


def _experts(block, backend: str) -> list:
    """HF's router and experts as moe takes them: w_router, experts_gate, experts_up, ..._down."""
    fused = block.experts.gate_up_proj.detach()  # (X, 2I, E)
    half = fused.shape[1] // 2
    hf = [block.gate.weight, fused[:, :half], fused[:, half:], block.experts.down_proj]
    return [pl.asarray(t.detach().numpy(), backend=backend) for t in hf]


def _hf_tolerance(dtype: str):
    # HF's routers take the softmax in float32 even for float64 input (``router_logits.float()``,
    # ``softmax(..., dtype=torch.float)``), so its float64 output has float32-accurate weights.
    return tolerance("float32") if dtype == "float64" else tolerance(dtype)


def _x(dtype: str):
    torch.manual_seed(1)
    return torch.randn(2, 5, E, dtype=getattr(torch, dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matches_mixtral_sparse_moe_block(backend, dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=E, intermediate_size=INTER, num_local_experts=X,
                           num_experts_per_tok=TOP_K, hidden_act="silu")  # fmt: skip
    block = _init(MixtralSparseMoeBlock(config), dtype)
    x = _x(dtype)
    with torch.no_grad():
        want = block(x).numpy()
    out = pl.moe(pl.asarray(x.numpy(), backend=backend), *_experts(block, backend),
                 top_k=TOP_K, norm_topk_prob=True)  # Mixtral always renormalises  # fmt: skip
    tol = _hf_tolerance(dtype)
    assert_close(out, want, rtol=tol.rtol, atol=tol.atol, backend=backend, dtype=dtype)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matches_qwen2_moe_sparse_moe_block(backend, dtype, norm_topk_prob):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=E, moe_intermediate_size=INTER, num_experts=X,
                            num_experts_per_tok=TOP_K, shared_expert_intermediate_size=20,
                            norm_topk_prob=norm_topk_prob, hidden_act="silu")  # fmt: skip
    block = _init(Qwen2MoeSparseMoeBlock(config), dtype)
    x = _x(dtype)
    with torch.no_grad():
        want = block(x).numpy()
    se = block.shared_expert
    shared = tuple(
        pl.asarray(p.weight.detach().numpy(), backend=backend)
        for p in (se.gate_proj, se.up_proj, se.down_proj)
    )
    shared_gate = pl.asarray(block.shared_expert_gate.weight.detach().numpy(), backend=backend)
    out = pl.moe(pl.asarray(x.numpy(), backend=backend), *_experts(block, backend),
                 top_k=TOP_K, norm_topk_prob=norm_topk_prob, shared=shared,
                 shared_gate=shared_gate)  # fmt: skip
    tol = _hf_tolerance(dtype)
    assert_close(out, want, rtol=tol.rtol, atol=tol.atol, backend=backend, dtype=dtype)
    assert np.abs(want).max() > 0.1  # the block did something: not a comparison of zeros
