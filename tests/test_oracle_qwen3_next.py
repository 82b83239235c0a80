"""Qwen3-Next's two token mixers against transformers' own modules on random weights
(``Qwen3NextGatedDeltaNet`` and ``Qwen3NextAttention``, their pure-torch paths): the whole
prompt at once, and its last tokens one at a time from the state (or cache) the first ones
left, each against the rows of HF's full forward (causal, so the truth for every row).

The checkpoint's layouts are split as the family reads them (``in_proj_qkvz``/``in_proj_ba``
per key-head group, ``q_proj``'s interleaved query and gate); the zero-centred norms are given
as their scale ``1 + w``, as the model forms them at load.
"""

from __future__ import annotations

import pytest

import portable_llm as pl
from portable_llm.backends import get_backend
from portable_llm.decoder.families.qwen3_next import (
    GatedDeltaNet,
    split_ba,
    split_gated_q_proj,
    split_qkvz,
)
from portable_llm.ops.kernels import Kernels
from portable_llm.testing import assert_close

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

E, L, PREFIX = 64, 7, 5  # the last L - PREFIX tokens run one at a time
SCALE = 0.2  # of the random weights: outputs of order 1


def _config(**extra):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**extra,
        hidden_size=E, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=4,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        attn_implementation="eager",
    )  # fmt: skip


def _randomised(module, seed: int):
    """Every parameter drawn anew (the norms' too, so that their layout matters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * SCALE)
    return module.eval()


def _x(seed: int = 1):
    return torch.randn(2, L, E, generator=torch.Generator().manual_seed(seed))


def _on(t, backend: str):
    return pl.asarray(t.detach().numpy(), backend=backend)


def _deltanet(hf, backend: str) -> GatedDeltaNet:
    xp = get_backend(backend).xp
    h_k, d_k, H, d_v = hf.num_k_heads, hf.head_k_dim, hf.num_v_heads, hf.head_v_dim
    w_qkv, w_z = split_qkvz(xp, _on(hf.in_proj_qkvz.weight, backend), h_k, d_k, H, d_v)
    w_b, w_a = split_ba(xp, _on(hf.in_proj_ba.weight, backend), h_k, H)
    return GatedDeltaNet(
        w_qkv=w_qkv, w_z=w_z, w_b=w_b, w_a=w_a, conv=_on(hf.conv1d.weight[:, 0, :], backend),
        dt_bias=_on(hf.dt_bias, backend), A_log=_on(hf.A_log, backend),
        norm=_on(hf.norm.weight, backend), w_out=_on(hf.out_proj.weight, backend),
        num_k_heads=h_k, head_k_dim=d_k, num_v_heads=H, head_v_dim=d_v,
        eps=hf.layer_norm_epsilon,
    )  # fmt: skip


def test_gated_deltanet_matches_transformers(backend):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf = _randomised(Qwen3NextGatedDeltaNet(_config(), layer_idx=0), seed=0)
    x = _x()
    with torch.no_grad():
        want = hf(x).numpy()  # (B, L, E)
    be = get_backend(backend)
    mixer, kn, xs = _deltanet(hf, backend), Kernels(be), _on(x, backend)
    whole, _ = mixer.mix(be.xp, kn, xs, None)
    assert_close(whole, want, backend=backend)
    out, state = mixer.mix(be.xp, kn, xs[:, :PREFIX, :], None)  # the chunked prefill
    assert_close(out, want[:, :PREFIX], backend=backend)
    for t in range(PREFIX, L):  # then one token at a time (the recurrent forms)
        out, state = mixer.mix(be.xp, kn, xs[:, t : t + 1, :], state)
        assert_close(out, want[:, t : t + 1], backend=backend)


def test_gated_deltanet_all_states_resume(backend):
    """The states after each token of a chunk (what a speculative rewind restores): resuming
    from the one after token t gives HF's row t + 1."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf = _randomised(Qwen3NextGatedDeltaNet(_config(), layer_idx=0), seed=2)
    x = _x(3)
    with torch.no_grad():
        want = hf(x).numpy()
    be = get_backend(backend)
    mixer, kn, xs = _deltanet(hf, backend), Kernels(be), _on(x, backend)
    _, (conv, S) = mixer.mix(be.xp, kn, xs[:, : L - 1, :], None, all_states=True)
    assert tuple(conv.shape)[:2] == (2, L - 1) and tuple(S.shape)[:2] == (2, L - 1)
    t = 2  # resume after token t (0-based): the next row is t + 1
    out, _ = mixer.mix(be.xp, kn, xs[:, t + 1 : t + 2, :], (conv[:, t, ...], S[:, t, ...]))
    assert_close(out, want[:, t + 1 : t + 2], backend=backend)


def _causal(n: int):
    return torch.full((n, n), float("-inf")).triu(1)[None, None]  # (1, 1, L, L)


def test_gated_attention_matches_transformers(backend):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextAttention,
        Qwen3NextRotaryEmbedding,
    )

    cfg = _config(attention_bias=True)  # q_proj's bias holds the gate's too
    hf = _randomised(Qwen3NextAttention(cfg, layer_idx=1), seed=4)
    x = _x(5)
    with torch.no_grad():
        pos = Qwen3NextRotaryEmbedding(cfg)(x, torch.arange(L)[None])
        want = hf(x, pos, _causal(L))[0].numpy()  # (B, L, E)
    H, H_kv, D = 4, 2, 16
    xp = get_backend(backend).xp
    wq, wg = split_gated_q_proj(xp, _on(hf.q_proj.weight, backend), H, D)
    bq, bg = split_gated_q_proj(xp, _on(hf.q_proj.bias, backend), H, D)
    kw = {
        "wq": wq, "wg": wg, "bq": bq, "bg": bg, "bk": _on(hf.k_proj.bias, backend),
        "bv": _on(hf.v_proj.bias, backend), "wk": _on(hf.k_proj.weight, backend),
        "wv": _on(hf.v_proj.weight, backend), "wo": _on(hf.o_proj.weight, backend),
        "q_norm": _on(1.0 + hf.q_norm.weight, backend),  # the zero-centred scale
        "k_norm": _on(1.0 + hf.k_norm.weight, backend), "norm_eps": cfg.rms_norm_eps,
        "num_heads": H, "num_kv_heads": H_kv, "head_dim": D,
        "rope": {"base": 10000.0, "dims": 4},  # partial_rotary_factor 0.25 of D = 16
    }  # fmt: skip
    xs, bo = _on(x, backend), _on(hf.o_proj.bias, backend)  # the block has no o_proj bias
    assert_close(pl.attention(xs, **kw) + bo, want, backend=backend)
    cache = pl.KVCache()
    assert_close(pl.attention(xs[:, :PREFIX, :], cache=cache, **kw) + bo, want[:, :PREFIX],
                 backend=backend)  # fmt: skip
    for t in range(PREFIX, L):
        out = pl.attention(xs[:, t : t + 1, :], cache=cache, **kw) + bo
        assert_close(out, want[:, t : t + 1], backend=backend)


def test_gated_attention_gate_shape_is_checked():
    x = pl.asarray([[[0.0] * 8]])
    w = pl.asarray([[0.0] * 8] * 8)
    with pytest.raises(ValueError, match=r"attention: wg must have shape \(8, 8\)"):
        pl.attention(x, wq=w, wk=w, wv=w, wo=w, wg=w[:4], num_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="attention: bg is the output gate's bias"):
        pl.attention(x, wq=w, wk=w, wv=w, wo=w, bg=w[0], num_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"the bias of wg must have shape \(8,\)"):
        pl.attention(x, wq=w, wk=w, wv=w, wo=w, wg=w, bg=w[0, :4], num_heads=2, num_kv_heads=2)
