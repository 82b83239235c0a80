"""The recurrent blocks against HF transformers' own torch functions (importable offline).

Qwen3-Next: ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` (GQA
heads, the L2 norm, a start state, the final state). Mamba-2: ``mamba2_chunk_scan`` (the
chunked SSD with D, dt bias, softplus, groups, a start state) and
``mamba2_selective_state_update`` (one decode step, with the z gate). LFM2:
``causal_conv1d_fn`` and ``causal_conv1d_update`` (the full sequence and one step with the
rolling state). Falcon-H1: the whole ``FalconH1Mixer`` (pure-torch path, random weights, every
option on) over a sequence and step by step through HF's cache (the states compared too), and
its ``FalconH1RMSNormGated``. Small float32 inputs; each call is one HF function call.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _t(seed: int, *shape: int, low: float = -1.0, high: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) * (high - low) + low


def _on(t, backend: str):
    return pl.asarray(t.numpy(), backend=backend)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_gated_delta_rule_matches_qwen3_next(backend, form):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    B, L, h_k, H, d_k, d_v = 2, 7, 2, 4, 8, 6
    q, k = _t(0, B, L, h_k, d_k), _t(1, B, L, h_k, d_k)
    v = _t(2, B, L, H, d_v)
    g, beta = _t(3, B, L, H, low=-1.0, high=0.0), _t(4, B, L, H, low=0.0, high=1.0)
    s0 = _t(5, B, H, d_k, d_v)
    fn = hf.torch_chunk_gated_delta_rule if form == "chunk" else hf.torch_recurrent_gated_delta_rule
    extra = {"chunk_size": 4} if form == "chunk" else {}
    with torch.no_grad():
        want_o, want_s = fn(q, k, v, g, beta, initial_state=s0.clone(), output_final_state=True,
                            use_qk_l2norm_in_kernel=True, **extra)  # fmt: skip
    o, s = pl.gated_delta_rule(*(_on(t, backend) for t in (q, k, v, g, beta)),
                               state=_on(s0, backend), qk_l2_norm=True, chunk_size=4,
                               impl="portable" if form == "chunk" else "recurrent")  # fmt: skip
    assert_close(o, want_o.numpy(), backend=backend)
    assert_close(s, want_s.numpy(), backend=backend)


def _mamba2_inputs():
    B, L, G, H, P, N = 2, 7, 2, 4, 3, 5
    return {
        "x": _t(10, B, L, H, P), "dt": _t(11, B, L, H), "A": -_t(12, H, low=0.5, high=2.0),
        "B": _t(13, B, L, G, N), "C": _t(14, B, L, G, N), "D": _t(15, H), "dt_bias": _t(16, H),
        "z": _t(17, B, L, H, P), "state": _t(18, B, H, P, N),
    }  # fmt: skip


def test_ssd_scan_matches_mamba2_chunk_scan(backend):
    from transformers.models.mamba2 import modeling_mamba2 as hf

    a = _mamba2_inputs()
    with torch.no_grad():
        want_y, want_s = hf.mamba2_chunk_scan(
            a["x"], a["dt"], a["A"], a["B"], a["C"], chunk_size=4, D=a["D"], dt_bias=a["dt_bias"],
            initial_states=a["state"].clone(), dt_softplus=True, return_final_states=True,
        )  # fmt: skip
    arrays = {n: _on(t, backend) for n, t in a.items()}
    y, s = pl.ssd_scan(arrays["x"], arrays["dt"], arrays["A"], arrays["B"], arrays["C"],
                       D=arrays["D"], dt_bias=arrays["dt_bias"], state=arrays["state"],
                       chunk_size=4, impl="portable")  # fmt: skip
    assert_close(y, want_y.numpy(), backend=backend)
    assert_close(s, want_s.numpy(), backend=backend)


def test_ssd_scan_step_matches_mamba2_selective_state_update(backend):
    from transformers.models.mamba2 import modeling_mamba2 as hf

    a = _mamba2_inputs()
    P, N = a["x"].shape[3], a["B"].shape[3]
    state = a["state"].clone()  # HF updates it in place
    with torch.no_grad():
        want_y = hf.mamba2_selective_state_update(
            state, a["x"][:, 0], a["dt"][:, 0, :, None].expand(-1, -1, P),
            a["A"][:, None, None].expand(-1, P, N), a["B"][:, 0], a["C"][:, 0],
            a["D"][:, None].expand(-1, P), dt_bias=a["dt_bias"][:, None].expand(-1, P),
            dt_softplus=True, z=a["z"][:, 0],
        )  # fmt: skip
    arrays = {n: _on(t[:, :1] if t.ndim >= 3 else t, backend) for n, t in a.items()}
    arrays["state"] = _on(a["state"], backend)
    y, s = pl.ssd_scan(arrays["x"], arrays["dt"], arrays["A"], arrays["B"], arrays["C"],
                       D=arrays["D"], z=arrays["z"], dt_bias=arrays["dt_bias"],
                       state=arrays["state"], impl="recurrent")  # fmt: skip
    assert_close(y[:, 0, ...], want_y.numpy(), backend=backend)
    assert_close(s, state.numpy(), backend=backend)


def test_short_conv_matches_lfm2_causal_conv1d(backend):
    from transformers.models.lfm2 import modeling_lfm2 as hf

    B, L, C, K = 2, 6, 5, 3
    x, w, b = _t(20, B, C, L), _t(21, C, K), _t(22, C)  # HF's (B, C, L) layout
    with torch.no_grad():
        want = hf.causal_conv1d_fn(x, w, b)
        state = torch.zeros(B, C, K - 1)
        state[..., :] = x[:, :, L - 1 - (K - 1) : L - 1]  # the K - 1 inputs before the last
        want_step = hf.causal_conv1d_update(x[:, :, -1:], state, w, b)
    xs = _on(x.transpose(1, 2).contiguous(), backend)  # (B, L, C)
    y, _ = pl.short_conv(xs, _on(w, backend), bias=_on(b, backend))
    assert_close(y, want.transpose(1, 2).numpy(), backend=backend)
    _, held = pl.short_conv(xs[:, : L - 1, :], _on(w, backend), bias=_on(b, backend))
    y1, new = pl.short_conv(xs[:, L - 1 :, :], _on(w, backend), bias=_on(b, backend), state=held)
    assert_close(y1, want_step.transpose(1, 2).numpy(), backend=backend)
    assert_close(new, np.ascontiguousarray(state.transpose(1, 2).numpy()), backend=backend)


def _falcon_h1_mixer(rms_norm: bool, before: bool):
    """transformers' ``FalconH1Mixer`` (its pure-torch path) with every option on (groups,
    both biases, the multipliers, the mup vector), random weights; and its config."""
    from transformers import FalconH1Config
    from transformers.models.falcon_h1 import modeling_falcon_h1 as hf

    config = FalconH1Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_ssm=24, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=5, mamba_d_conv=4,
        mamba_chunk_size=4, mamba_rms_norm=rms_norm, mamba_norm_before_gate=before,
        mamba_proj_bias=True, projectors_bias=True, ssm_in_multiplier=0.7,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 2.0], vocab_size=300,
    )  # fmt: skip
    torch.manual_seed(0)
    mixer = hf.FalconH1Mixer(config, 0).eval()
    mixer.register_buffer("mup_vector", hf.compute_mup_vector(config), persistent=False)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return mixer, config


@pytest.mark.slow_on("jax")  # the scan compiled for 5 lengths: ~30 s; the family tests run there
@pytest.mark.parametrize(("rms_norm", "before"), [(True, True), (True, False), (False, True)])
def test_mamba2_mixer_matches_falcon_h1_mixer(backend, rms_norm, before):
    """The whole sequence, then a prompt of 4 and one token at a time through HF's cache."""
    from transformers import DynamicCache

    from portable_llm.decoder.families import falcon_h1

    mixer, config = _falcon_h1_mixer(rms_norm, before)
    d = config.to_dict()
    w = {f"model.layers.0.mamba.{k}": _on(v.detach(), backend)
         for k, v in mixer.state_dict().items()}  # fmt: skip
    mup = falcon_h1.mup_vector(falcon_h1.ssm_multipliers(d), falcon_h1.mixer_sizes(d))
    weights = falcon_h1.read_mixer(w, 0, falcon_h1.mixer_options(d), mup, rms_norm=rms_norm)
    x = _t(30, 2, 7, 32)
    with torch.no_grad():
        want = mixer(x).numpy()
        cache = DynamicCache(config=config)
        steps = [mixer(x[:, :4], cache_params=cache)]
        steps += [mixer(x[:, t : t + 1], cache_params=cache) for t in range(4, 7)]
    y, _ = pl.mamba2_mixer(_on(x, backend), weights)
    assert_close(y, want, backend=backend)
    parts, state = [], None
    for start, end in [(0, 4), (4, 5), (5, 6), (6, 7)]:
        part, state = pl.mamba2_mixer(_on(x[:, start:end], backend), weights, state=state)
        parts.append(pl.to_numpy(part))
    assert_close(np.concatenate(parts, axis=1), torch.cat(steps, dim=1).numpy(), backend="numpy")
    assert_close(state[1], cache.get_recurrent_state(0, state_idx=0).numpy(), backend=backend)
    held = cache.get_conv_state(0, state_idx=0)[:, :, 1:]  # HF keeps K inputs, (B, C, K)
    assert_close(state[0], held.transpose(1, 2).numpy(), backend=backend)


@pytest.mark.parametrize("before", [True, False])
def test_gated_rms_norm_matches_falcon_h1(backend, before):
    from transformers.models.falcon_h1 import modeling_falcon_h1 as hf

    norm = hf.FalconH1RMSNormGated(12, eps=1e-5, n_groups=3, norm_before_gate=before)
    with torch.no_grad():
        norm.weight.copy_(_t(40, 12))
        x, gate = _t(41, 2, 5, 12), _t(42, 2, 5, 12)
        want = norm(x, gate).numpy()
    got = pl.gated_rms_norm(_on(x, backend), _on(gate, backend), _on(norm.weight.detach(), backend),
                            eps=1e-5, n_groups=3, norm_before_gate=before)  # fmt: skip
    assert_close(got, want, backend=backend)
