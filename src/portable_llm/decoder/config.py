"""The decoder configuration: one frozen dataclass read from an HF ``config.json``.

Field names are HF's (``hidden_size``, ``num_key_value_heads``, ``rms_norm_eps``, ...). Where the
families differ only in a default or in which tensors exist (Qwen2's fixed q/k/v biases, Qwen3's
q/k norms, Mistral's window on every layer, Qwen2-MoE's sparse-step rule), :func:`from_dict`
resolves the difference once, into plain fields the model reads without knowing the family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from portable_llm.core.checks import check_int, check_real
from portable_llm.ops.activations import ACTIVATIONS
from portable_llm.rotary.scaling import ROPE_TYPES, rope_spec

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderConfig"]

#: The ``model_type`` values :func:`portable_llm.load` reads.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "qwen2",
    "qwen3",
    "llama",
    "mistral",
    "mixtral",
    "qwen2_moe",
)
LAYER_TYPES = ("full_attention", "sliding_attention")
# HF's class defaults where config.json may leave a field out (per family where they differ).
_DEFAULT_THETA = {"mixtral": 1e6}
_DEFAULT_EPS = {"mixtral": 1e-5}
_DEFAULT_HEAD_DIM = {"qwen3": 128}


@dataclass(frozen=True)
class DecoderConfig:
    """A Llama-style decoder, with the options the supported families need.

    Read one with :meth:`from_dict` (an HF ``config.json`` as a dict) or :func:`read_config`.
    ``rope`` holds the options of :func:`portable_llm.rotary.rope` (``base``, ``scaling``,
    ``max_position_embeddings``); ``layer_types[i]`` is ``"full_attention"`` or
    ``"sliding_attention"`` (then ``sliding_window`` applies); ``moe_layers[i]`` says whether
    layer i is a mixture of experts.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str = "silu"
    max_position_embeddings: int | None = None
    rope: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q_proj, k_proj, v_proj biases
    o_bias: bool = False  # o_proj bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # Llama mlp_bias
    qk_norm: bool = False  # Qwen3 q_norm / k_norm
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Mixture of experts (Mixtral, Qwen2-MoE); num_experts == 0: every layer is a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (``None``: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecoderConfig:
        """Read an HF ``config.json`` dict; keys the decoder does not use are ignored.

        Raises
        ------
        ValueError
            An unsupported ``model_type`` (the message lists the supported ones), an unknown
            rope type or layer type, a missing or inconsistent size, or a value of the wrong
            type or range (``rms_norm_eps < 0``, a token id that is not an int, a flag that is
            not a bool, ...).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"config.json: expected an object ({{...}}), got {type(d).__name__}")
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: unsupported model_type {mt!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            _int(d, key, required=True)
        E, n, H = d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"]
        H_kv = _int(d, "num_key_value_heads") or H
        if H % H_kv:
            raise ValueError(
                f"config.json: num_attention_heads={H} is not a multiple of "
                f"num_key_value_heads={H_kv}"
            )
        head_dim = _int(d, "head_dim") or _DEFAULT_HEAD_DIM.get(mt) or E // H
        if head_dim < 1:
            raise ValueError(
                f"config.json: head_dim must be >= 1; hidden_size={E} // num_attention_heads={H} "
                "is 0 (give head_dim)"
            )
        act = d.get("hidden_act", "silu")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ValueError(
                f"config.json: unknown hidden_act {act!r}; known: {', '.join(sorted(ACTIVATIONS))}"
            )
        bias = _bool(d, "attention_bias")
        moe = _moe(mt, d, n)
        window, layer_types = _windows(mt, d, n)
        return cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=E,
            intermediate_size=_int(d, "intermediate_size", required=True),
            num_hidden_layers=n,
            num_attention_heads=H,
            num_key_value_heads=H_kv,
            head_dim=head_dim,
            rms_norm_eps=_real(d, "rms_norm_eps", _DEFAULT_EPS.get(mt, 1e-6), low=0.0),
            hidden_act=act,
            max_position_embeddings=_int(d, "max_position_embeddings"),
            rope=MappingProxyType(_rope(mt, d)),
            tie_word_embeddings=_bool(d, "tie_word_embeddings"),
            qkv_bias={"qwen2": True, "qwen2_moe": _bool(d, "qkv_bias", True)}.get(mt, bias),
            o_bias=bias if mt in ("llama", "qwen3") else False,
            mlp_bias=_bool(d, "mlp_bias") if mt == "llama" else False,
            qk_norm=mt == "qwen3",
            sliding_window=window,
            layer_types=layer_types,
            num_experts=moe.get("num_experts", 0),
            num_experts_per_tok=moe.get("top_k", 0),
            norm_topk_prob=moe.get("norm", False),
            moe_intermediate_size=moe.get("size", 0),
            shared_expert_intermediate_size=moe.get("shared", 0),
            moe_layers=moe.get("layers", (False,) * n),
            bos_token_id=_token(d, "bos_token_id"),
            eos_token_id=_tokens(d, "eos_token_id"),
            pad_token_id=_token(d, "pad_token_id", low=None),
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``rope`` as a dict)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rope"] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in self.rope.items()}
        return out


def _int(d: Mapping[str, Any], key: str, *, required: bool = False, low: int = 1) -> Any:
    value = d.get(key)
    if value is None:
        if required:
            raise ValueError(f"config.json: {key} is missing")
        return None
    try:
        return check_int("config.json", key, value, low=low)
    except TypeError as exc:  # a config value of the wrong type is a ValueError, as the rest
        raise ValueError(str(exc)) from None


def _real(d: Mapping[str, Any], key: str, default: float, *, low: float, **opts: Any) -> float:
    value = d.get(key)
    if value is None:
        return default
    try:
        return check_real("config.json", key, value, low=low, **opts)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _bool(d: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def _token(d: Mapping[str, Any], key: str, *, low: int | None = 0) -> int | None:
    value = d.get(key)
    if isinstance(value, list | tuple):  # some configs list one id
        value = value[0] if value else None
    if value is None:
        return None
    try:
        return check_int("config.json", key, value, low=low)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _tokens(d: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = d.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list | tuple) else [value]
    return tuple(_token({key: v}, key) or 0 for v in values)


def _rope(mt: str, d: Mapping[str, Any]) -> dict[str, Any]:
    """``{"base", "scaling", "max_position_embeddings"}`` from ``rope_parameters`` (v5) or
    ``rope_theta`` + ``rope_scaling`` (v4), as HF's config standardisation reads them."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"config.json: rope_parameters must be a dict, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(
            "config.json: rope_parameters per layer type (a dict of dicts) are not supported; "
            f"got keys {sorted(params)}"
        )
    scaling = dict(params)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"config.json: unknown rope type {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = scaling.get("rope_theta", d.get("rope_theta", _DEFAULT_THETA.get(mt, 10000.0)))
    theta = _real({"rope_theta": theta}, "rope_theta", 0.0, low=1.0, low_open=True)
    scaling.update(rope_type=kind, rope_theta=theta)
    prf = d.get("partial_rotary_factor")
    if prf is not None:
        scaling.setdefault("partial_rotary_factor", prf)
    mpe = d.get("max_position_embeddings")
    if kind in ("llama3", "yarn") and mpe is not None:
        scaling.setdefault("original_max_position_embeddings", mpe)
    out: dict[str, Any] = {"base": theta, "scaling": MappingProxyType(scaling)}
    if kind == "dynamic":
        out["max_position_embeddings"] = mpe
    rope_spec(
        "config.json",
        out["scaling"],
        base=theta,
        max_position_embeddings=out.get("max_position_embeddings"),
    )  # every field checked now, not at the first forward
    return out


def _windows(mt: str, d: Mapping[str, Any], n: int) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` by each family's rule (HF's ``__post_init__``)."""
    window = _int(d, "sliding_window", low=0) or None  # 0: no window, as HF's sliding mask
    if mt in ("mistral", "mixtral"):  # the window (when set) applies to every layer
        kinds = ["sliding_attention" if window else "full_attention"] * n
    elif mt == "llama":
        window, kinds = None, ["full_attention"] * n
    else:  # qwen2, qwen3, qwen2_moe: use_sliding_window switches the window on
        if not _bool(d, "use_sliding_window"):
            window = None
        given = d.get("layer_types")
        mwl = _int(d, "max_window_layers", low=0)
        mwl = 28 if mwl is None else mwl
        if given is not None:
            if not isinstance(given, list | tuple):
                raise ValueError(f"config.json: layer_types must be a list, got {given!r}")
            kinds = list(given)
        elif mt == "qwen2_moe":
            kinds = [
                "sliding_attention" if window and (i + 1) % 2 and i < mwl else "full_attention"
                for i in range(n)
            ]
        else:
            kinds = [
                "sliding_attention" if window and i >= mwl else "full_attention" for i in range(n)
            ]
    if len(kinds) != n or any(not isinstance(k, str) or k not in LAYER_TYPES for k in kinds):
        raise ValueError(
            f"config.json: layer_types must list {n} entries from {LAYER_TYPES}, got {kinds!r}"
        )
    return window, tuple(kinds)


def _moe(mt: str, d: Mapping[str, Any], n: int) -> dict[str, Any]:
    if mt == "mixtral":
        x = _int(d, "num_local_experts") or _int(d, "num_experts") or 8
        return {
            "num_experts": x,
            "top_k": _int(d, "num_experts_per_tok") or 2,
            "norm": True,  # MixtralTopKRouter always renormalises
            "size": _int(d, "intermediate_size", required=True),
            "layers": (True,) * n,
        }
    if mt != "qwen2_moe":
        return {}
    x = _int(d, "num_experts", low=0)
    x = 60 if x is None else x
    step = _int(d, "decoder_sparse_step") or 1
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list | tuple):
        raise ValueError(f"config.json: mlp_only_layers must be a list of ints, got {only!r}")
    dense = {_int({"mlp_only_layers": i}, "mlp_only_layers", low=0) for i in only}
    layers = tuple(x > 0 and i not in dense and (i + 1) % step == 0 for i in range(n))
    top_k = _int(d, "num_experts_per_tok") or 4
    if x > 0 and top_k > x:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} exceeds num_experts={x}")
    return {
        "num_experts": x,
        "top_k": top_k,
        "norm": _bool(d, "norm_topk_prob"),
        "size": _int(d, "moe_intermediate_size") or 1408,
        "shared": _int(d, "shared_expert_intermediate_size") or 5632,
        "layers": layers,
    }
