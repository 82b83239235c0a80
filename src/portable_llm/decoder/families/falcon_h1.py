"""Falcon-H1 (transformers' ``FalconH1ForCausalLM``), read top-down: what it changes of Llama.

config.json
    Llama's names, and the Mamba-2 mixer's: ``mamba_d_ssm`` (its inner width ``I``; else
    ``mamba_expand * hidden_size``), ``mamba_n_heads`` (``H``), ``mamba_d_head`` (``P``,
    ``"auto"``: ``I / H``), ``mamba_n_groups``, ``mamba_d_state`` (``N``), ``mamba_d_conv``,
    ``mamba_chunk_size``, ``mamba_conv_bias``, ``mamba_proj_bias`` (``in_proj``'s bias),
    ``projectors_bias`` (``out_proj``'s), ``mamba_rms_norm`` and ``mamba_norm_before_gate``,
    ``time_step_limit``; the multipliers: ``embedding_multiplier``, ``lm_head_multiplier``,
    ``attention_in_multiplier``, ``attention_out_multiplier``, ``key_multiplier``,
    ``ssm_in_multiplier``, ``ssm_out_multiplier``, ``ssm_multipliers`` (five: the gate ``z``,
    ``x``, ``B``, ``C`` and ``dt`` parts of ``in_proj``'s output) and ``mlp_multipliers``
    (the gate projection's and ``down_proj``'s).
model
    the embeddings times ``embedding_multiplier``; the logits times ``lm_head_multiplier``.
layer
    ``r = input_layernorm(h)``;
    ``h = h + mamba(r) * ssm_out_multiplier + attention(r * attention_in_multiplier) *
    attention_out_multiplier`` (keys times ``key_multiplier`` before RoPE);
    ``h = h + mlp(pre_ff_layernorm(h))`` with the gate projection times ``mlp_multipliers[0]``
    before the activation and ``down_proj`` times ``mlp_multipliers[1]``.
mixer (``model.layers.{i}.mamba.``)
    :func:`~portable_llm.mamba2_mixer`: ``in_proj`` -> ``z, xBC, dt`` (times the mup vector of
    ``ssm_multipliers``), ``conv1d`` with SiLU, :func:`~portable_llm.ssd_scan` with ``D`` and
    ``dt_bias``, the gated RMSNorm ``norm`` (``mamba_rms_norm``) or ``y * silu(z)``,
    ``out_proj``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from portable_llm.backends import backend_of
from portable_llm.decoder.config_values import read_bool, read_int, read_real
from portable_llm.ops.mamba2 import Mamba2Weights

__all__ = ["mixer_options", "mup_vector", "read_mixer"]


def mixer_sizes(d: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """``(I, H, P, G, N)`` of the Mamba-2 mixer of the ``config.json`` ``d`` (HF's
    ``FalconH1Config`` rules and defaults)."""
    E = read_int(d, "hidden_size", required=True)
    inner = read_int(d, "mamba_d_ssm")
    if inner is None:  # HF: mamba_expand * hidden_size when mamba_d_ssm is null
        inner = (read_int(d, "mamba_expand") or 2) * E
    H = read_int(d, "mamba_n_heads") or 128
    P = d.get("mamba_d_head", "auto")
    P = inner // H if P in (None, "auto") else read_int(d, "mamba_d_head")
    if inner != H * P:
        raise ValueError(
            f"config.json: mamba_n_heads * mamba_d_head must equal the mixer's width "
            f"(mamba_d_ssm, else mamba_expand * hidden_size) {inner}, got {H} * {P}"
        )
    G = read_int(d, "mamba_n_groups") or 1
    if H % G:
        raise ValueError(f"config.json: mamba_n_groups={G} must divide mamba_n_heads={H}")
    return inner, H, P, G, read_int(d, "mamba_d_state") or 256


def mixer_options(d: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~portable_llm.ops.mamba2.Mamba2Weights` options of the ``config.json`` ``d``
    (HF's defaults where it leaves them out)."""
    _, _, P, G, _ = mixer_sizes(d)
    limit = d.get("time_step_limit") or (0.0, math.inf)
    if not isinstance(limit, list | tuple) or len(limit) != 2:
        raise ValueError(f"config.json: time_step_limit must be [lo, hi], got {limit!r}")
    lo = read_real({"time_step_limit[0]": limit[0]}, "time_step_limit[0]", 0.0, low=0.0)
    hi = read_real({"time_step_limit[1]": limit[1]}, "time_step_limit[1]", math.inf, low=lo,
                   finite=False)  # fmt: skip
    return {
        "n_groups": G,
        "head_dim": P,
        "norm_before_gate": read_bool(d, "mamba_norm_before_gate", True),
        "eps": read_real(d, "rms_norm_eps", 1e-5, low=0.0),
        "in_multiplier": read_real(d, "ssm_in_multiplier", 1.0, low=0.0, low_open=True),
        "dt_limit": (lo, hi),
        "chunk_size": read_int(d, "mamba_chunk_size") or 256,
    }


def mup_vector(d: Mapping[str, Any]) -> list[float] | None:
    """HF's ``compute_mup_vector``: ``in_proj``'s ``I + (I + 2 G N) + H`` outputs each times
    its part's multiplier of ``ssm_multipliers`` (z, x, B, C, dt); ``None`` when all are 1."""
    inner, H, _, G, N = mixer_sizes(d)
    given = d.get("ssm_multipliers") or [1.0] * 5
    if not isinstance(given, list | tuple) or len(given) != 5:
        raise ValueError(f"config.json: ssm_multipliers must list 5 reals, got {given!r}")
    m = [read_real({"ssm_multipliers": v}, "ssm_multipliers", 1.0, low=0.0, low_open=True)
         for v in given]  # fmt: skip
    if m == [1.0] * 5:
        return None
    widths = (inner, inner, G * N, G * N, H)
    return [v for v, width in zip(m, widths, strict=True) for _ in range(width)]


def read_mixer(
    w: Mapping[str, Any], i: int, options: Mapping[str, Any], mup: list[float] | None, *,
    rms_norm: bool,
) -> Mamba2Weights:  # fmt: skip
    """Layer ``i``'s mixer, ``model.layers.{i}.mamba.*`` of the weights ``w`` (the model's
    backend and dtype): ``A = -exp(A_log)`` in float32 (float64 for float64 weights), the mup
    vector in the weights' dtype (HF's buffer), the gated norm only with ``rms_norm``
    (``mamba_rms_norm``; else HF's ``nn.Identity`` and ``y * silu(z)``)."""
    p = f"model.layers.{i}.mamba."
    in_proj = w[p + "in_proj.weight"]
    bk = backend_of(in_proj)
    assert bk is not None
    xp = bk.xp
    A_log = w[p + "A_log"]
    A = -xp.exp(xp.astype(A_log, xp.float64 if A_log.dtype == xp.float64 else xp.float32))
    conv = w[p + "conv1d.weight"]  # (C, 1, K)
    vec = None
    if mup is not None:
        vec = xp.asarray(mup, dtype=in_proj.dtype, device=bk.device_of(in_proj))
    return Mamba2Weights(
        in_proj=in_proj,
        conv=xp.reshape(conv, (conv.shape[0], conv.shape[2])),  # (C, K)
        A=A,
        D=w[p + "D"],
        dt_bias=w[p + "dt_bias"],
        out_proj=w[p + "out_proj.weight"],
        in_bias=w.get(p + "in_proj.bias"),
        conv_bias=w.get(p + "conv1d.bias"),
        out_bias=w.get(p + "out_proj.bias"),
        norm=w[p + "norm.weight"] if rms_norm else None,
        mup=vec,
        **options,
    )
