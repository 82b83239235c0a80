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
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar

from portable_llm.backends import backend_of
from portable_llm.decoder.config_values import read_bool, read_int, read_real
from portable_llm.decoder.families.base import (
    Family,
    LayerConfig,
    no_windows,
    read_attention,
    read_mlp,
)
from portable_llm.decoder.layer_weights import Layer
from portable_llm.decoder.mixer import RecurrentMixer
from portable_llm.ops.affine import times
from portable_llm.ops.kernels import KernelSet
from portable_llm.ops.mamba2 import Mamba2Weights, mamba2_body
from portable_llm.ops.quant import QuantizedWeight

__all__ = [
    "FAMILY",
    "Mamba2",
    "mixer_options",
    "mixer_sizes",
    "mup_vector",
    "read_mixer",
    "ssm_multipliers",
]


def mixer_sizes(d: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """``(I, H, P, G, N)`` of the Mamba-2 mixer of the ``config.json`` ``d`` (HF's
    ``FalconH1Config`` rules and defaults)."""
    E = read_int(d, "hidden_size", required=True)
    inner = read_int(d, "mamba_d_ssm") if "mamba_d_ssm" in d else 1024  # HF's class default
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
    limit = [_json_float(v) for v in limit]
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


def _json_float(value: Any) -> Any:
    """A float as transformers writes a non-finite one into ``config.json``
    (``{"__float__": "Infinity"}``; JSON has no infinity), else ``value`` itself."""
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        text = value["__float__"]
        if text in ("Infinity", "-Infinity", "NaN"):
            return float(text.replace("Infinity", "inf"))
    return value


def ssm_multipliers(d: Mapping[str, Any]) -> tuple[float, ...]:
    """``ssm_multipliers`` of the ``config.json`` ``d``: five reals > 0 (z, x, B, C, dt; all 1
    when absent)."""
    given = d.get("ssm_multipliers") or [1.0] * 5
    if not isinstance(given, list | tuple) or len(given) != 5:
        raise ValueError(f"config.json: ssm_multipliers must list 5 reals, got {given!r}")
    return tuple(_multiplier({"ssm_multipliers": v}, "ssm_multipliers") for v in given)


def mup_vector(
    multipliers: tuple[float, ...], sizes: tuple[int, int, int, int, int]
) -> list[float] | None:
    """HF's ``compute_mup_vector``: ``in_proj``'s ``I + (I + 2 G N) + H`` outputs each times
    its part's multiplier (z, x, B, C, dt) of ``ssm_multipliers``, for the mixer's ``sizes``
    ``(I, H, P, G, N)`` (:func:`mixer_sizes`); ``None`` when all are 1."""
    if all(v == 1.0 for v in multipliers):
        return None
    inner, H, _, G, N = sizes
    widths = (inner, inner, G * N, G * N, H)
    return [v for v, width in zip(multipliers, widths, strict=True) for _ in range(width)]


def read_mixer(
    w: Mapping[str, Any], i: int, options: Mapping[str, Any], mup: list[float] | None, *,
    rms_norm: bool,
) -> Mamba2Weights:  # fmt: skip
    """Layer ``i``'s mixer, ``model.layers.{i}.mamba.*`` of the weights ``w`` (the model's
    backend and dtype; ``in_proj`` and ``out_proj`` may be quantized, a GGUF's): ``A =
    -exp(A_log)`` in float32 (float64 for float64 weights), the mup vector in the weights'
    dtype (HF's buffer), the gated norm only with ``rms_norm`` (``mamba_rms_norm``; else HF's
    ``nn.Identity`` and ``y * silu(z)``)."""
    p = f"model.layers.{i}.mamba."
    D = w[p + "D"]  # an array of the model's dtype (the projections may be quantized)
    bk = backend_of(D)
    assert bk is not None, "a checkpoint's vectors are arrays of the model's backend"
    xp = bk.xp
    A_log = w[p + "A_log"]
    A = -xp.exp(xp.astype(A_log, xp.float64 if A_log.dtype == xp.float64 else xp.float32))
    conv = w[p + "conv1d.weight"]  # (C, 1, K)
    vec = None
    if mup is not None:
        vec = xp.asarray(mup, dtype=D.dtype, device=bk.device_of(D))
    return Mamba2Weights(
        in_proj=w[p + "in_proj.weight"],
        conv=xp.reshape(conv, (conv.shape[0], conv.shape[2])),  # (C, K)
        A=A,
        D=D,
        dt_bias=w[p + "dt_bias"],
        out_proj=w[p + "out_proj.weight"],
        in_bias=w.get(p + "in_proj.bias"),
        conv_bias=w.get(p + "conv1d.bias"),
        out_bias=w.get(p + "out_proj.bias"),
        norm=w[p + "norm.weight"] if rms_norm else None,
        mup=vec,
        **options,
    )


def fields(d: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields Falcon-H1 changes: its
    mixer's options and the multipliers the layer recipe folds into the weights (``mixer``)."""
    inner, H, _, _, N = mixer_sizes(d)
    mlp = d.get("mlp_multipliers") or [1.0, 1.0]
    if not isinstance(mlp, list | tuple) or len(mlp) != 2:
        raise ValueError(f"config.json: mlp_multipliers must list 2 reals, got {mlp!r}")
    mixer = {
        **mixer_options(d),
        "ssm_multipliers": ssm_multipliers(d),
        "d_ssm": inner,
        "n_heads": H,
        "d_state": N,
        "rms_norm": read_bool(d, "mamba_rms_norm"),
        "d_conv": read_int(d, "mamba_d_conv") or 4,
        "conv_bias": read_bool(d, "mamba_conv_bias", True),
        "proj_bias": read_bool(d, "mamba_proj_bias"),
        "projectors_bias": read_bool(d, "projectors_bias"),
        "mlp_multipliers": tuple(
            _multiplier({"mlp_multipliers": v}, "mlp_multipliers") for v in mlp
        ),
    }
    for key in MULTIPLIERS:
        mixer[key] = _multiplier(d, key)
    return {
        "embedding_multiplier": _multiplier(d, "embedding_multiplier"),
        "logit_scale": _multiplier(d, "lm_head_multiplier"),
        "mlp_bias": read_bool(d, "mlp_bias"),
        "mixer": MappingProxyType(mixer),
    }


#: The multipliers of a layer's sublayers that the recipe folds into the weights.
MULTIPLIERS = (
    "attention_in_multiplier",
    "attention_out_multiplier",
    "key_multiplier",
    "ssm_out_multiplier",
)


def _multiplier(d: Mapping[str, Any], key: str) -> float:
    """A multiplier of ``config.json`` (1.0 when absent): a finite real > 0."""
    return read_real(d, key, 1.0, low=0.0, low_open=True)


@dataclass(frozen=True)
class Mamba2(Mamba2Weights, RecurrentMixer):
    """Falcon-H1's ``FalconH1Mixer``: :func:`~portable_llm.ops.mamba2.mamba2_body` over its
    weights; its state ``(conv, ssm)``: ``(B, K - 1, I + 2 G N)`` and ``(B, H, P, N)``."""

    projections: ClassVar[tuple[str, ...]] = ("in_proj", "out_proj")
    own_dtype: ClassVar[tuple[str, ...]] = ("A",)  # -exp(A_log) in float32, as HF's

    def mix(
        self, xp: Any, kn: KernelSet, x: Any, state: tuple[Any, ...] | None, *,
        pads: Any, all_states: bool,
    ) -> tuple[Any, tuple[Any, ...]]:  # fmt: skip
        mask = None if pads is None else xp.astype(pads[:, :, 0], x.dtype)  # (B, L)
        s = None if state is None else (state[0], state[1])
        return mamba2_body(xp, kn, x, self, s, all_states=all_states, mask=mask)


def read_layer(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i``: the attention and the Mamba-2 mixer over one normed input, their outputs
    added; then the MLP. The sublayers' multipliers are folded into their projections (each
    is linear in them): ``attention_in_multiplier`` into ``q/k/v_proj``, ``key_multiplier``
    into ``k_proj`` (RoPE is linear), ``attention_out_multiplier`` into ``o_proj``,
    ``ssm_out_multiplier`` into the mixer's ``out_proj``, ``mlp_multipliers`` into
    ``gate_proj`` and ``down_proj``; ``ssm_in_multiplier`` and the mup vector stay in the
    mixer (:func:`~portable_llm.mamba2_mixer`)."""
    p, m = f"model.layers.{i}.", cfg.mixer
    a = read_attention(cfg, w, i)
    into, key, out = (m[k] for k in ("attention_in_multiplier", "key_multiplier",
                                     "attention_out_multiplier"))  # fmt: skip
    a = replace(
        a, wq=_scaled(a.wq, into), wk=_scaled(a.wk, into * key), wv=_scaled(a.wv, into),
        wo=_scaled(a.wo, out), bk=_scaled(a.bk, key), bo=_scaled(a.bo, out),
    )  # fmt: skip
    f = read_mlp(w, i)
    gate, down = m["mlp_multipliers"]
    f = replace(
        f, w_gate=_scaled(f.w_gate, gate), b_gate=_scaled(f.b_gate, gate),
        w_down=_scaled(f.w_down, down), b_down=_scaled(f.b_down, down),
    )  # fmt: skip
    sizes = (m["d_ssm"], m["n_heads"], m["head_dim"], m["n_groups"], m["d_state"])
    mup = mup_vector(m["ssm_multipliers"], sizes)
    mixer = read_mixer(w, i, {k: m[k] for k in OPTIONS}, mup, rms_norm=m["rms_norm"])
    ssm_out = m["ssm_out_multiplier"]
    mixer = replace(mixer, out_proj=_scaled(mixer.out_proj, ssm_out),
                    out_bias=_scaled(mixer.out_bias, ssm_out))  # fmt: skip
    return Layer(
        input_norm=w[p + "input_layernorm.weight"],
        post_norm=w[p + "post_attention_layernorm.weight"],  # HF pre_ff_layernorm
        attn=a,
        mlp=f,
        moe=None,
        mixer=Mamba2(**mixer.__dict__),
    )


#: The keys of ``config.mixer`` that are :class:`Mamba2Weights` options.
OPTIONS = ("n_groups", "head_dim", "norm_before_gate", "eps", "in_multiplier", "dt_limit",
           "chunk_size")  # fmt: skip


def _scaled(w: Any, c: float) -> Any:
    """``w * c`` (a weight or bias of the model's backend; ``None`` stays ``None``): HF's
    multiplier of a projection's output, folded into it (in float32, rounded once to the
    weight's dtype)."""
    if w is None or c == 1.0:
        return w
    if isinstance(w, QuantizedWeight):
        raise ValueError(
            "falcon_h1: a multiplier other than 1 cannot be folded into a quantized projection; "
            "load the float checkpoint (llama.cpp's converter folds them into the file)"
        )
    bk = backend_of(w)
    assert bk is not None
    return times(bk.xp, w, c)


def tensors(cfg: Any, i: int, out: dict[str, tuple[int, ...]]) -> None:
    """Layer ``i``'s mixer tensors (``model.layers.{i}.mamba.*``) beside Llama's."""
    m = cfg.mixer
    E, P, G = cfg.hidden_size, m["head_dim"], m["n_groups"]
    H = m["n_heads"]
    Di = H * P
    C = Di + 2 * G * m["d_state"]
    q = f"model.layers.{i}.mamba."
    out |= {q + "in_proj.weight": (Di + C + H, E), q + "conv1d.weight": (C, 1, m["d_conv"]),
            q + "A_log": (H,), q + "D": (H,), q + "dt_bias": (H,),
            q + "out_proj.weight": (E, Di)}  # fmt: skip
    extra = {
        "in_proj.bias": ("proj_bias", (Di + C + H,)),
        "conv1d.bias": ("conv_bias", (C,)),
        "norm.weight": ("rms_norm", (Di,)),
        "out_proj.bias": ("projectors_bias", (E,)),
    }
    for name, (flag, shape) in extra.items():
        if m[flag]:
            out[q + name] = shape


FAMILY = Family(
    "falcon_h1",
    defaults={"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_key_value_heads": 8},
    o_bias=True,
    fields=fields,
    layer_types=no_windows,
    read_layer=read_layer,
    names=(
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        (".feed_forward.", ".mlp."),
        ("model.final_layernorm.", "model.norm."),
    ),
    tensors=tensors,
)
