"""GGUF files of issue 31's families (llama.cpp's architectures ``smollm3``, ``olmo2``,
``granite``, ``starcoder2``, ``cohere2``, ``qwen3moe``), written here with gguf-py as llama.cpp's
converters write them (its tensor names, q/k rows permuted for ``smollm3`` and ``granite``, each
architecture's metadata keys, the matrices in Q8_0 and Q4_0, routers and vectors in float32),
from a random-initialised transformers model; read kept quantized, they give transformers'
logits on the same (dequantized) weights, on every backend.

The test models switch on what llama.cpp's reading of each architecture holds: SmolLM3's no-RoPE
layers (llama.cpp: every fourth, HF's default; no window), OLMo 2's norms after each sublayer
and whole-projection q/k norms, Granite's four multipliers and its biases, StarCoder2's LayerNorm
with biases and ``c_fc``/``c_proj``, Cohere 2's parallel block, logit scale and window (every
fourth layer global, without RoPE), Qwen3-MoE's per-head q/k norms and renormalised top-2 of 4
experts on every layer (llama.cpp has no dense ``mlp_only_layers`` and no window).
"""

from __future__ import annotations

import os
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from conftest import numpy_only
from portable_llm.checkpoint.weights import family_name
from portable_llm.ops.quant import QuantizedWeight
from portable_llm.testing import assert_close

pytestmark = pytest.mark.oracle
os.environ.setdefault("HF_HUB_OFFLINE", "1")
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 300
IDS = np.random.default_rng(1).integers(3, V, size=(2, 12))
_BASE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256,
         "tie_word_embeddings": False}  # fmt: skip
#: llama.cpp's architecture -> (transformers' class prefix, the test model's config).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm3": ("SmolLM3", {**_BASE, "num_hidden_layers": 4, "pad_token_id": 0}),
    "olmo2": ("Olmo2", {**_BASE, "num_hidden_layers": 2, "num_attention_heads": 8,
                        "num_key_value_heads": 4}),
    "granite": ("Granite", {**_BASE, "num_hidden_layers": 2, "embedding_multiplier": 3.0,
                            "residual_multiplier": 0.5, "attention_multiplier": 0.1,
                            "logits_scaling": 2.0, "attention_bias": True, "mlp_bias": True}),
    "starcoder2": ("Starcoder2", {**_BASE, "num_hidden_layers": 2}),
    "cohere2": ("Cohere2", {**_BASE, "num_hidden_layers": 4, "sliding_window": 6,
                            "logit_scale": 0.5, "tie_word_embeddings": True}),
    "qwen3moe": ("Qwen3Moe", {**_BASE, "num_hidden_layers": 2, "head_dim": 24,
                              "moe_intermediate_size": 32, "num_experts": 4,
                              "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "lfm2": ("Lfm2", {**_BASE, "num_hidden_layers": 4, "block_multiple_of": 32,
                      "layer_types": ["conv", "full_attention", "conv", "conv"]}),
}  # fmt: skip
#: HF's module names -> llama.cpp's (OLMo 2's ``post_attention_layernorm`` is its own name).
_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm", "self_attn.out_proj": "attn_output",
    "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
    "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj",
    "conv.out_proj": "shortconv.out_proj",
}  # fmt: skip
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
        "model.embedding_norm": "token_embd_norm"}  # fmt: skip
Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0


def _hf_model(arch: str) -> Any:
    name, extra = FAMILIES[arch]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=V, bos_token_id=1, eos_token_id=2, **extra
    )
    torch.manual_seed(len(arch))
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():  # wider than the default init
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif p.ndim == 1:
                p.copy_(torch.rand_like(p) * 0.4 + 0.8)
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    return model


def _kind(hf: str, value: np.ndarray) -> Any:
    """The file's type of HF's tensor ``hf``: Q4_0 MLPs and experts, Q8_0 the other matrices,
    float32 vectors and routers (llama.cpp's converter keeps ``ffn_gate_inp`` in float32)."""
    if value.ndim == 1 or hf.endswith("mlp.gate.weight") or value.shape[-1] % 32:
        return None  # (and LFM2's convolution: rows of K = 3 values)
    return Q4_0 if ".mlp." in hf else Q8_0


def _held(hf: str, value: np.ndarray) -> np.ndarray:
    """The values the file holds of HF's tensor ``hf``: its blocks quantized and dequantized."""
    kind = _kind(hf, value)
    return (
        value if kind is None else gguf.quants.dequantize(gguf.quants.quantize(value, kind), kind)
    )


def _gguf_tensors(arch: str, state: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, Any]]:
    """llama.cpp's tensors (name -> float32 values, the file's type) of HF's ``state``."""
    out = {}
    for hf, value in state.items():
        kind = _kind(hf, value)
        stem, _, suffix = hf.rpartition(".")
        if stem in _TOP:
            out[f"{_TOP[stem]}.{suffix}"] = value, kind
            continue
        _, _, i, rest = hf.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # (X, 2I, E): llama.cpp's gate and up apart
            half = value.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"] = value[:, :half], kind
            out[f"blk.{i}.ffn_up_exps.weight"] = value[:, half:], kind
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{i}.ffn_down_exps.weight"] = value, kind
        else:
            stem, _, suffix = rest.rpartition(".")
            g = _NAMES[stem]
            if arch == "olmo2" and stem == "post_attention_layernorm":
                g = "post_attention_norm"
            if stem == "conv.conv":  # llama.cpp's converter squeezes (E, 1, K) to (E, K)
                value = value[:, 0, :]
            out[f"blk.{i}.{g}.{suffix}"] = value, kind
    return out


def _write_tensors(w: Any, items: Any) -> None:
    """The tensors ``(gguf name, value, kind)`` into the writer ``w``, then the file: ``kind``
    ``None`` as float32, ``MXFP4`` as its raw bytes, else quantized by gguf-py."""
    for name, value, kind in items:
        if kind is None:
            w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        elif kind == MXFP4:
            w.add_tensor(name, value, raw_dtype=kind)
        else:
            w.add_tensor(
                name, gguf.quants.quantize(np.ascontiguousarray(value), kind), raw_dtype=kind
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (weights and biases): each head's two
    halves interleaved, for its rotary layout."""
    shape = w.shape
    return w.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _write(
    path: Path,
    arch: str,
    cfg: Any,
    tensors: dict[str, tuple[np.ndarray, Any]],
    skip: str | None = None,
) -> None:
    """``tensors`` (:func:`_gguf_tensors`) with the metadata llama.cpp's converter of ``arch``
    writes (but the key ``skip``)."""
    w = gguf.GGUFWriter(str(path), arch)
    if skip is not None:  # every write of that key drops it
        add_key = w.add_key_value
        w.add_key_value = lambda key, *a, **k: None if key == skip else add_key(key, *a, **k)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    if arch == "lfm2":  # the MLP's adjusted width; H_kv per layer, 0 on the convolutions
        w.add_feed_forward_length(
            next(t for n, (t, _) in tensors.items() if "ffn_gate" in n).shape[0]
        )
        w.add_head_count_kv(
            [0 if k == "conv" else cfg.num_key_value_heads for k in cfg.layer_types]
        )
        w.add_shortconv_l_cache(cfg.conv_L_cache)
        w.add_vocab_size(cfg.vocab_size)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "starcoder2":
        w.add_layer_norm_eps(cfg.norm_epsilon)
    elif arch == "cohere2":
        w.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.norm_eps if arch == "lfm2" else cfg.rms_norm_eps)
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch in ("smollm3", "granite", "cohere2"):  # LlamaModel's, Cohere 2's (its full rotary)
        w.add_rope_dimension_count(D)
    if arch == "qwen3moe":
        w.add_key_length(D)
        w.add_value_length(D)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch == "cohere2":
        w.add_logit_scale(cfg.logit_scale)
        w.add_sliding_window(cfg.sliding_window)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    items = []
    for name, (value, kind) in tensors.items():
        if arch in ("smollm3", "granite") and ".attn_q." in name:
            value = _permute(value, cfg.num_attention_heads)
        elif arch in ("smollm3", "granite") and ".attn_k." in name:
            value = _permute(value, cfg.num_key_value_heads)
        items.append((name, value, kind))
    _write_tensors(w, items)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, np.ndarray]]:
    """arch -> (its GGUF file, transformers' model, its float32 logits of ``IDS`` on the
    file's weights dequantized)."""
    root = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for arch in FAMILIES:
        model = _hf_model(arch)
        state = {k: v.numpy() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            del state["lm_head.weight"]
        _write(root / f"{arch}.gguf", arch, model.config, _gguf_tensors(arch, state))
        held = {k: torch.from_numpy(_held(k, v)) for k, v in state.items()}
        model.load_state_dict(held, strict=False)  # a tied head follows the embedding
        with torch.no_grad():
            want = model(torch.tensor(IDS)).logits.float().numpy()
        out[arch] = (root / f"{arch}.gguf", model, want)
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_logits_match_transformers(gguf_files: dict, arch: str, backend: str) -> None:
    """Kept quantized (Q8_0/Q4_0 matrices as MLX's affine codes, the stacked experts
    dequantized), the file gives transformers' logits on its weights."""
    path, hf, want = gguf_files[arch]
    model = pl.load(path, backend=backend, dtype="float32", dequantize=False)
    assert model.config.model_type == hf.config.model_type
    attention = next(layer.attn for layer in model.layers if layer.attn is not None)
    assert isinstance(attention.wq, QuantizedWeight)
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend, dtype="float32")


@numpy_only
@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_slices_read_the_weights(gguf_files: dict, arch: str) -> None:
    """A partitioned load's reader (:class:`~portable_llm.checkpoint.gguf.GGUFSlices`) gives
    every tensor as transformers holds it: the q/k rows and biases un-permuted, the experts'
    gate and up halves apart, the quantized blocks dequantized exactly as gguf-py does."""
    from portable_llm.checkpoint.gguf import GGUFSlices

    path, hf, _ = gguf_files[arch]
    mt = hf.config.model_type  # StarCoder2's c_fc/c_proj: the decoder's up/down_proj
    want = {family_name(mt, k): _held(k, v.numpy()) for k, v in hf.state_dict().items()}
    for name, value in list(want.items()):
        if name.endswith("experts.gate_up_proj"):
            stem, half = name.removesuffix("gate_up_proj"), value.shape[1] // 2
            want[stem + "gate_proj"], want[stem + "up_proj"] = value[:, :half], value[:, half:]
    slices = GGUFSlices(path)
    for name, shape in slices.shapes.items():
        got = slices.read(name)
        assert got.shape == shape
        np.testing.assert_array_equal(got, want[name], err_msg=name)


@numpy_only
@pytest.mark.parametrize(
    ("arch", "key"),
    [("granite", "granite.logit_scale"), ("cohere2", "cohere2.attention.sliding_window"),
     ("qwen3moe", "qwen3moe.expert_count")],
)  # fmt: skip
def test_gguf_missing_family_key(arch: str, key: str, tmp_path: Path) -> None:
    """A file without one of its architecture's required keys: an error naming the key."""
    model = _hf_model(arch)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    tensors = _gguf_tensors(arch, state)
    _write(tmp_path / "m.gguf", arch, model.config, tensors, skip=key)
    with pytest.raises(pl.CheckpointError, match=f"GGUF metadata key {key} is missing"):
        pl.load(tmp_path / "m.gguf", backend="numpy")


MXFP4 = gguf.GGMLQuantizationType.MXFP4
_GPT_OSS = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
            "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                "original_max_position_embeddings": 64}}  # fmt: skip


def _mxfp4(value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(the MXFP4 blocks, their values)`` of ``value`` ``(.., N, K)``."""
    blocks = gguf.quants.quantize(value, MXFP4)
    return blocks, gguf.quants.dequantize(blocks, MXFP4)


def _gpt_oss_file(path: Path) -> tuple[Any, np.ndarray]:
    """A gpt-oss GGUF as llama.cpp's converter writes an MXFP4 model (gate and up
    de-interleaved and transposed to ``(X, I, E)``, down to ``(X, E, I)``, the three in MXFP4;
    ``attn_sinks``, ``post_attention_norm``, the router ``ffn_gate_inp`` with its bias; YaRN),
    the other matrices Q8_0; and transformers' logits of ``IDS`` on the file's values."""
    config = transformers.GptOssConfig(vocab_size=V, bos_token_id=1, eos_token_id=2, **_GPT_OSS)
    torch.manual_seed(7)
    hf = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 0.1 if name.endswith(("bias", "sinks")) else 0.15
            p.copy_(torch.randn_like(p) * scale if p.ndim > 1 or "norm" not in name else
                    torch.rand_like(p) * 0.4 + 0.8)  # fmt: skip
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    tensors: dict[str, tuple[np.ndarray, Any]] = {}
    held: dict[str, np.ndarray] = {}
    names = {**_NAMES, "post_attention_layernorm": "post_attention_norm",
             "mlp.router": "ffn_gate_inp"}  # fmt: skip
    for hf_name, value in state.items():
        stem, _, suffix = hf_name.rpartition(".")
        if stem in _TOP:
            tensors[f"{_TOP[stem]}.{suffix}"] = value, _kind(hf_name, value)
            held[hf_name] = _held(hf_name, value)
            continue
        _, _, i, rest = hf_name.split(".", 3)
        b = f"blk.{i}."
        if rest == "mlp.experts.gate_up_proj":  # (X, E, 2I), gate and up interleaved
            gate, gate_q = _mxfp4(np.ascontiguousarray(value[..., 0::2].swapaxes(1, 2)))
            up, up_q = _mxfp4(np.ascontiguousarray(value[..., 1::2].swapaxes(1, 2)))
            tensors[b + "ffn_gate_exps.weight"], tensors[b + "ffn_up_exps.weight"] = (
                (gate, MXFP4),
                (up, MXFP4),
            )
            both = np.empty_like(value)
            both[..., 0::2], both[..., 1::2] = gate_q.swapaxes(1, 2), up_q.swapaxes(1, 2)
            held[hf_name] = both
        elif rest == "mlp.experts.gate_up_proj_bias":
            tensors[b + "ffn_gate_exps.bias"] = value[..., 0::2], None
            tensors[b + "ffn_up_exps.bias"] = value[..., 1::2], None
            held[hf_name] = value
        elif rest == "mlp.experts.down_proj":  # (X, I, E)
            down, down_q = _mxfp4(np.ascontiguousarray(value.swapaxes(1, 2)))
            tensors[b + "ffn_down_exps.weight"] = down, MXFP4
            held[hf_name] = down_q.swapaxes(1, 2)
        elif rest == "mlp.experts.down_proj_bias":
            tensors[b + "ffn_down_exps.bias"] = value, None
            held[hf_name] = value
        elif rest == "self_attn.sinks":
            tensors[b + "attn_sinks.weight"] = value, None
            held[hf_name] = value
        else:
            stem, _, suffix = rest.rpartition(".")
            kind = None if "router" in stem else _kind(hf_name, value)
            tensors[f"{b}{names[stem]}.{suffix}"] = value, kind
            held[hf_name] = value if kind is None else _held(hf_name, value)
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()})
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.float().numpy()
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_expert_count(config.num_local_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_sliding_window(config.sliding_window)
    w.add_expert_feed_forward_length(config.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(config.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _write_tensors(w, ((name, value, kind) for name, (value, kind) in tensors.items()))
    return hf, want


@pytest.fixture(scope="module")
def gpt_oss_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("gguf_gpt_oss") / "gpt-oss.gguf"
    return path, _gpt_oss_file(path)[1]


def test_gpt_oss_gguf_matches_transformers(gpt_oss_file: tuple, backend: str) -> None:
    """llama.cpp's ``gpt-oss``: the MXFP4 experts kept as :class:`~portable_llm.MXFP4Weight`,
    attention sinks, the router's bias, the experts' biases, YaRN, a window on the even layers:
    transformers' logits on the file's values."""
    path, want = gpt_oss_file
    model = pl.load(path, backend=backend, dtype="float32")  # dequantize="auto" keeps MXFP4
    assert model.config.model_type == "gpt_oss"
    assert model.config.layer_types == ("sliding_attention", "full_attention")
    scaling = model.config.rope["scaling"]  # the file's YaRN, not gpt-oss's defaults
    assert (scaling["factor"], scaling["original_max_position_embeddings"]) == (4.0, 64)
    assert isinstance(model.layers[0].moe.experts_gate, pl.MXFP4Weight)  # kept quantized
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend, dtype="float32")


#: Falcon-H1's multipliers, powers of 2: folded into the weights as llama.cpp's converter does
#: and divided out again for transformers, exactly.
_FALCON_H1 = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 2,
              "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_chunk_size": 4,
              "mamba_rms_norm": True, "mamba_norm_before_gate": False,
              "max_position_embeddings": 256, "embedding_multiplier": 2.0,
              "lm_head_multiplier": 0.5, "attention_in_multiplier": 2.0,
              "attention_out_multiplier": 0.5, "key_multiplier": 0.5, "ssm_in_multiplier": 0.5,
              "ssm_out_multiplier": 2.0, "ssm_multipliers": [0.5, 2.0, 0.25, 1.0, 4.0],
              "mlp_multipliers": [2.0, 0.5]}  # fmt: skip


def _falcon_h1_scale(hf_name: str, cfg: Any) -> Any:
    """The factor llama.cpp's Falcon-H1 converter folds into HF's tensor ``hf_name`` (a float,
    ``in_proj``'s a per-row vector, or 1)."""
    table = {"down_proj": cfg.mlp_multipliers[1], "gate_proj": cfg.mlp_multipliers[0],
             "k_proj": cfg.key_multiplier * cfg.attention_in_multiplier,
             "q_proj": cfg.attention_in_multiplier, "v_proj": cfg.attention_in_multiplier,
             "o_proj": cfg.attention_out_multiplier, "out_proj": cfg.ssm_out_multiplier,
             "lm_head": cfg.lm_head_multiplier,
             "embed_tokens": cfg.embedding_multiplier}  # fmt: skip
    if not hf_name.endswith(".weight"):
        return 1.0
    if "in_proj" in hf_name:  # z, x, B, C, dt rows
        I, GN, H = cfg.mamba_d_ssm, cfg.mamba_n_groups * cfg.mamba_d_state, cfg.mamba_n_heads  # noqa: E741
        widths = (I, I, GN, GN, H)
        rows = np.repeat(np.float32(cfg.ssm_multipliers), widths)
        return (cfg.ssm_in_multiplier * rows)[:, None]
    return next((v for k, v in table.items() if k in hf_name), 1.0)


def _falcon_h1_file(path: Path) -> np.ndarray:
    """A Falcon-H1 GGUF as llama.cpp's converter writes it (the multipliers folded in, the
    convolution squeezed, ``A = -exp(A_log)`` and ``D`` as ``(H, 1)``, the gated norm
    ``(G, I / G)``, ``dt_bias`` as ``ssm_dt.bias``, its names from gguf-py's own map), the
    matrices Q8_0; transformers' logits of ``IDS`` on the file's values."""
    config = transformers.FalconH1Config(vocab_size=V, bos_token_id=1, eos_token_id=2,
                                         **_FALCON_H1)  # fmt: skip
    torch.manual_seed(11)
    hf = transformers.FalconH1ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn_like(p) * 0.15)
            elif "norm" in name or name.endswith(".D"):
                p.copy_(torch.rand_like(p) * 0.4 + 0.8)
            else:  # biases, A_log, dt_bias
                p.copy_(torch.randn_like(p) * 0.3)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, config.num_hidden_layers)
    G, I = config.mamba_n_groups, config.mamba_d_ssm  # noqa: E741
    held, w = {}, gguf.GGUFWriter(str(path), "falcon-h1")
    tensors = []
    for hf_name, t in hf.state_dict().items():
        value = t.numpy()
        scale = _falcon_h1_scale(hf_name, config)
        folded = (value * scale).astype(np.float32)
        kind = _kind(hf_name, folded)
        stored = folded if kind is None else _held(hf_name, folded)
        held[hf_name] = stored / scale  # exact: powers of 2
        g = names.get_name(hf_name.replace(".dt_bias", ".dt_proj.bias"),
                           try_suffixes=(".weight", ".bias"))  # fmt: skip
        if not g.endswith((".weight", ".bias", "ssm_a", "ssm_d")):  # a map entry with its suffix
            g += ".weight"
        if hf_name.endswith("A_log"):
            folded, held[hf_name] = -np.exp(value)[:, None], value
        elif hf_name.endswith(".D"):
            folded = value[:, None]
        elif hf_name.endswith("mamba.norm.weight"):
            folded = value.reshape(G, I // G)
        elif hf_name.endswith("conv1d.weight"):
            folded = value[:, 0, :]
        tensors.append((g, folded, kind))
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()})
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.float().numpy()
    for key, value in (("block_count", config.num_hidden_layers),
                       ("context_length", config.max_position_embeddings),
                       ("embedding_length", config.hidden_size),
                       ("feed_forward_length", config.intermediate_size),
                       ("attention.head_count", config.num_attention_heads),
                       ("attention.head_count_kv", config.num_key_value_heads),
                       ("attention.key_length", config.head_dim),
                       ("attention.value_length", config.head_dim),
                       ("ssm.conv_kernel", config.mamba_d_conv), ("ssm.inner_size", I),
                       ("ssm.state_size", config.mamba_d_state),
                       ("ssm.time_step_rank", config.mamba_n_heads),
                       ("ssm.group_count", G), ("vocab_size", V)):  # fmt: skip
        w.add_uint32(f"falcon-h1.{key}", value)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _write_tensors(w, tensors)
    return want


@pytest.fixture(scope="module")
def falcon_h1_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("gguf_falcon_h1") / "falcon-h1.gguf"
    return path, _falcon_h1_file(path)


def test_falcon_h1_gguf_matches_transformers(falcon_h1_file: tuple, backend: str) -> None:
    """llama.cpp's ``falcon-h1``: the multipliers folded into the weights (read as 1), the
    Mamba-2 mixer's tensors in llama.cpp's shapes and forms, the gated norm after the gate:
    transformers' logits on the file's values (Q8_0 matrices kept quantized)."""
    path, want = falcon_h1_file
    model = pl.load(path, backend=backend, dtype="float32", dequantize=False)
    assert model.config.model_type == "falcon_h1"
    assert model.config.embedding_multiplier == 1.0  # folded into token_embd
    assert isinstance(model.layers[0].attn.wq, QuantizedWeight)
    mixer = model.layers[0].mixer  # its projections kept quantized too
    assert isinstance(mixer.in_proj, QuantizedWeight) and isinstance(
        mixer.out_proj, QuantizedWeight
    )
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend, dtype="float32")


_DEEPSEEK = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
             "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
             "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.0,
             "norm_topk_prob": True, "max_position_embeddings": 256}  # fmt: skip


def _deepseek_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A DeepSeek V3 GGUF as llama.cpp's ``deepseek2`` converter writes it (``kv_b_proj``
    split into ``attn_k_b`` ``(H, R, d_n)`` and ``attn_v_b`` ``(H, d_v, R)``, the experts
    stacked, ``exp_probs_b``, llama.cpp's MQA head counts and lengths beside the MLA ones,
    names from gguf-py's own map), Q8_0/Q4_0 matrices; transformers' logits on its values, and
    layer 0's ``kv_b_proj``."""
    config = transformers.DeepseekV3Config(vocab_size=V, bos_token_id=1, eos_token_id=2,
                                           **_DEEPSEEK)  # fmt: skip
    torch.manual_seed(5)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn_like(p) * 0.15)
            elif "norm" in name:
                p.copy_(torch.rand_like(p) * 0.4 + 0.8)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    for k in [k for k in state if k.endswith("e_score_correction_bias")]:  # a buffer
        state[k] = np.random.default_rng(5).normal(0, 0.1, state[k].shape).astype(np.float32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config.num_hidden_layers)
    H, R, dn, dv = 4, 32, 16, 16
    tensors, held = {}, {}
    for hf_name, value in state.items():
        kind = _kind(hf_name, value)
        held[hf_name] = _held(hf_name, value)
        b = "blk." + hf_name.split(".")[2] + "." if ".layers." in hf_name else ""
        if hf_name.endswith("kv_b_proj.weight"):  # llama.cpp's split, kept float32
            heads = value.reshape(H, dn + dv, R)
            tensors[b + "attn_k_b.weight"] = heads[:, :dn].swapaxes(1, 2), None
            tensors[b + "attn_v_b.weight"] = heads[:, dn:], None
            held[hf_name] = value
        elif hf_name.endswith("experts.gate_up_proj"):
            half = value.shape[1] // 2
            tensors[b + "ffn_gate_exps.weight"] = value[:, :half], kind
            tensors[b + "ffn_up_exps.weight"] = value[:, half:], kind
        elif hf_name.endswith("experts.down_proj"):
            tensors[b + "ffn_down_exps.weight"] = value, kind
        elif hf_name.endswith("e_score_correction_bias"):
            tensors[b + "exp_probs_b.bias"] = value, None
        else:
            g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            g = g if g.endswith((".weight", ".bias")) else g + ".weight"
            tensors[g] = value, kind
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()})
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.float().numpy()
    kv_b = state["model.layers.0.self_attn.kv_b_proj.weight"]
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, v in (("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                   ("feed_forward_length", 96), ("attention.head_count", H),
                   ("attention.head_count_kv", 1), ("attention.key_length", R + 8),
                   ("attention.value_length", R), ("attention.key_length_mla", dn + 8),
                   ("attention.value_length_mla", dv), ("attention.q_lora_rank", 32),
                   ("attention.kv_lora_rank", R), ("rope.dimension_count", 8),
                   ("leading_dense_block_count", 1), ("expert_feed_forward_length", 32),
                   ("expert_count", 4), ("expert_used_count", 2), ("expert_shared_count", 1),
                   ("expert_group_count", 2), ("expert_group_used_count", 1),
                   ("expert_gating_func", 2), ("vocab_size", V)):  # fmt: skip
        w.add_uint32(f"deepseek2.{key}", v)
    w.add_float32("deepseek2.expert_weights_scale", 2.0)
    w.add_bool("deepseek2.expert_weights_norm", True)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _write_tensors(w, ((g, value, kind) for g, (value, kind) in tensors.items()))
    return want, kv_b


@pytest.fixture(scope="module")
def deepseek_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, Any]:
    path = tmp_path_factory.mktemp("gguf_deepseek") / "deepseek2.gguf"
    return path, *_deepseek_file(path)


def test_deepseek2_gguf_matches_transformers(deepseek_file: tuple, backend: str) -> None:
    """llama.cpp's ``deepseek2`` read as DeepSeek V3: the latent attention (``kv_b_proj``
    joined from ``attn_k_b``/``attn_v_b``, ``q_a``/``q_b``), a dense then a MoE layer with the
    grouped sigmoid router, its correction bias, scale and shared expert: transformers' logits
    on the file's values."""
    path, want, _ = deepseek_file
    model = pl.load(path, backend=backend, dtype="float32", dequantize=False)
    cfg = model.config
    assert (cfg.model_type, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.head_dim) == (
        "deepseek_v3", 32, 16, 8)  # fmt: skip
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (2, 1, 2.0)
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend, dtype="float32")


@numpy_only
def test_deepseek2_gguf_slices_join_kv_b(deepseek_file: tuple) -> None:
    """A partitioned load's reader joins ``attn_k_b``/``attn_v_b`` into HF's ``kv_b_proj``
    (its rows too)."""
    from portable_llm.checkpoint.gguf import GGUFSlices

    path, _, kv_b = deepseek_file
    slices = GGUFSlices(path)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert slices.shapes[name] == kv_b.shape
    np.testing.assert_array_equal(slices.read(name), kv_b)
    np.testing.assert_array_equal(slices.read(name, (slice(8, 40),)), kv_b[8:40])


_GLM = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "partial_rotary_factor": 0.5, "use_qk_norm": True,
        "attention_bias": True, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.0,
        "norm_topk_prob": True, "max_position_embeddings": 256}  # fmt: skip


def _glm4moe_file(path: Path) -> np.ndarray:
    """A GLM-4.5 GGUF as llama.cpp's ``glm4moe`` converter writes it (``block_count`` counting
    a multi-token-prediction layer, whose tensors follow: not run), names from gguf-py's own
    map, Q8_0/Q4_0 matrices; transformers' logits on its values."""
    config = transformers.Glm4MoeConfig(vocab_size=V, bos_token_id=1, eos_token_id=2, **_GLM)
    torch.manual_seed(9)
    hf = transformers.Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn_like(p) * 0.15)
            elif "norm" in name:
                p.copy_(torch.rand_like(p) * 0.4 + 0.8)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    for k in [k for k in state if k.endswith("e_score_correction_bias")]:  # a buffer
        state[k] = np.random.default_rng(9).normal(0, 0.1, state[k].shape).astype(np.float32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, 3)
    tensors, held = {}, {}
    for hf_name, value in state.items():
        kind = _kind(hf_name, value)
        held[hf_name] = _held(hf_name, value)
        b = "blk." + hf_name.split(".")[2] + "." if ".layers." in hf_name else ""
        if hf_name.endswith("experts.gate_up_proj"):
            half = value.shape[1] // 2
            tensors[b + "ffn_gate_exps.weight"] = value[:, :half], kind
            tensors[b + "ffn_up_exps.weight"] = value[:, half:], kind
        elif hf_name.endswith("experts.down_proj"):
            tensors[b + "ffn_down_exps.weight"] = value, kind
        elif hf_name.endswith("e_score_correction_bias"):
            tensors[b + "exp_probs_b.bias"] = value, None
        else:
            g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            g = g if g.endswith((".weight", ".bias")) else g + ".weight"
            tensors[g] = value, kind
    mtp = np.random.default_rng(1).normal(0, 0.1, (64, 128)).astype(np.float32)
    tensors["blk.2.nextn.eh_proj.weight"] = mtp, None  # the MTP layer (not run)
    tensors["blk.2.attn_norm.weight"] = np.ones(64, np.float32), None
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()})
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.float().numpy()
    w = gguf.GGUFWriter(str(path), "glm4moe")
    for key, v in (("block_count", 3), ("nextn_predict_layers", 1), ("context_length", 256),
                   ("embedding_length", 64), ("feed_forward_length", 96),
                   ("attention.head_count", 4), ("attention.head_count_kv", 2),
                   ("attention.key_length", 16), ("attention.value_length", 16),
                   ("rope.dimension_count", 8), ("leading_dense_block_count", 1),
                   ("expert_feed_forward_length", 32), ("expert_count", 4),
                   ("expert_used_count", 2), ("expert_shared_count", 1),
                   ("expert_gating_func", 2), ("vocab_size", V)):  # fmt: skip
        w.add_uint32(f"glm4moe.{key}", v)
    w.add_float32("glm4moe.expert_weights_scale", 2.0)
    w.add_bool("glm4moe.expert_weights_norm", True)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _write_tensors(w, ((g, value, kind) for g, (value, kind) in tensors.items()))
    return want


@pytest.fixture(scope="module")
def glm4moe_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("gguf_glm4moe") / "glm4moe.gguf"
    return path, _glm4moe_file(path)


def test_glm4moe_gguf_matches_transformers(glm4moe_file: tuple, backend: str) -> None:
    """llama.cpp's ``glm4moe`` read as GLM-4.5: partial RoPE (``rope.dimension_count`` of
    ``key_length``), q/k norms, q/k/v biases, a dense then a MoE layer with the sigmoid router,
    its correction bias, scale and shared expert; the MTP layer counted in ``block_count``
    skipped: transformers' logits on the file's values."""
    path, want = glm4moe_file
    model = pl.load(path, backend=backend, dtype="float32", dequantize=False)
    assert (model.config.model_type, model.config.num_hidden_layers) == ("glm4_moe", 2)
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend, dtype="float32")


_QWEN3_NEXT = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "partial_rotary_factor": 0.25, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32, "num_experts": 4,
               "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
               "mlp_only_layers": [], "linear_num_key_heads": 2, "linear_key_head_dim": 32,
               "linear_num_value_heads": 4, "linear_value_head_dim": 32,
               "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention", "full_attention"],
               "full_attention_interval": 2, "max_position_embeddings": 256,
               "tie_word_embeddings": False}  # fmt: skip


def _cut_qkvz(value: np.ndarray, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``Qwen3NextModel`` cut of HF's ``in_proj_qkvz`` (rows per key-head group:
    q, k, v, z) into ``attn_qkv`` (every group's q, then k, then v) and ``attn_gate`` (z)."""
    h_k, d_k = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    vz = cfg.linear_num_value_heads // h_k * cfg.linear_value_head_dim
    groups = value.reshape(h_k, 2 * d_k + 2 * vz, -1)
    cuts = np.cumsum([0, d_k, d_k, vz, vz])
    q, k, v, z = (groups[:, a:b].reshape(-1, value.shape[-1]) for a, b in pairwise(cuts))
    return np.concatenate([q, k, v]), z


def _qwen3_next_file(path: Path) -> np.ndarray:
    """A Qwen3-Next GGUF as llama.cpp's ``qwen3next`` converter writes it (``in_proj_qkvz`` cut
    into ``attn_qkv`` and ``attn_gate``, ``A = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``,
    the convolution squeezed, every norm but the DeltaNet's gated one stored as ``1 + w``, the
    ``ssm.*`` keys, names from gguf-py's own map), Q8_0 matrices and Q4_0 experts;
    transformers' logits of ``IDS`` on the file's values."""
    config = transformers.Qwen3NextConfig(vocab_size=V, bos_token_id=1, eos_token_id=2,
                                          **_QWEN3_NEXT)  # fmt: skip
    torch.manual_seed(13)
    hf = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn_like(p) * 0.15)
            elif "norm" in name:  # the zero-centred norms' w (scale 1 + w), the gated one's
                p.copy_(torch.rand_like(p) * 0.4 - 0.2 if "linear_attn" not in name else
                        torch.rand_like(p) * 0.4 + 0.8)  # fmt: skip
            else:  # A_log, dt_bias
                p.copy_(torch.randn_like(p) * 0.3)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, config.num_hidden_layers)
    tensors, held = {}, {}
    for hf_name, t in hf.state_dict().items():
        value = t.numpy()
        kind = _kind(hf_name, value)
        held[hf_name] = _held(hf_name, value)  # row-wise blocks: the cut rows quantize alike
        b = "blk." + hf_name.split(".")[2] + "." if ".layers." in hf_name else ""
        if hf_name.endswith("in_proj_qkvz.weight"):
            qkv, z = _cut_qkvz(value, config)
            tensors[b + "attn_qkv.weight"], tensors[b + "attn_gate.weight"] = (qkv, kind), (z, kind)
        elif hf_name.endswith("experts.gate_up_proj"):
            half = value.shape[1] // 2
            tensors[b + "ffn_gate_exps.weight"] = value[:, :half], kind
            tensors[b + "ffn_up_exps.weight"] = value[:, half:], kind
        elif hf_name.endswith("experts.down_proj"):
            tensors[b + "ffn_down_exps.weight"] = value, kind
        elif hf_name.endswith(".A_log"):
            a = -np.exp(value)  # float32, as the reader's log(-a) reads it back
            tensors[b + "ssm_a"], held[hf_name] = (a, None), np.log(-a)
        elif hf_name.endswith(".dt_bias"):
            tensors[b + "ssm_dt.bias"] = value, None
        else:
            g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            g = g if g.endswith((".weight", ".bias")) else g + ".weight"
            if hf_name.endswith("conv1d.weight"):
                value = value[:, 0, :]
            elif hf_name.endswith("norm.weight") and "linear_attn" not in hf_name:
                value = value + np.float32(1.0)  # llama.cpp's 1 + w, read back as (1 + w) - 1
                held[hf_name] = value - np.float32(1.0)
            tensors[g] = value, kind
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()})
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.float().numpy()
    w = gguf.GGUFWriter(str(path), "qwen3next")
    for key, v in (("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                   ("feed_forward_length", 96), ("attention.head_count", 4),
                   ("attention.head_count_kv", 2), ("attention.key_length", 32),
                   ("attention.value_length", 32), ("expert_count", 4), ("expert_used_count", 2),
                   ("expert_feed_forward_length", 32),
                   ("expert_shared_feed_forward_length", 32), ("ssm.conv_kernel", 4),
                   ("ssm.state_size", 32), ("ssm.group_count", 2), ("ssm.time_step_rank", 4),
                   ("ssm.inner_size", 128), ("full_attention_interval", 2),
                   ("rope.dimension_count", 8), ("vocab_size", V)):  # fmt: skip
        w.add_uint32(f"qwen3next.{key}", v)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _write_tensors(w, ((g, value, kind) for g, (value, kind) in tensors.items()))
    return want


@pytest.fixture(scope="module")
def qwen3_next_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("gguf_qwen3_next") / "qwen3next.gguf"
    return path, _qwen3_next_file(path)


@pytest.mark.slow_on("jax")  # the prefill's chunked delta rule runs eagerly there: 26 s (load 3.5)
def test_qwen3next_gguf_matches_transformers(qwen3_next_file: tuple, backend: str) -> None:
    """llama.cpp's ``qwen3next`` read as Qwen3-Next: a Gated DeltaNet layer (``attn_qkv`` and
    ``attn_gate`` kept quantized, ``ssm_ba``, ``ssm_a`` = ``-exp(A_log)``, the squeezed
    convolution), then a gated full attention with partial RoPE (``attn_q`` with the gate's
    rows, read as floats), a MoE with a gated shared expert on both, the norms' ``1 + w``:
    transformers' logits on the file's values."""
    path, want = qwen3_next_file
    model = pl.load(path, backend=backend, dtype="float32", dequantize=False)
    cfg = model.config
    assert (cfg.model_type, cfg.layer_types) == (
        "qwen3_next",
        ("linear_attention", "full_attention"),
    )
    mixer = model.layers[0].mixer
    assert isinstance(mixer.w_qkv, QuantizedWeight) and isinstance(mixer.w_z, QuantizedWeight)
    assert isinstance(mixer.w_out, QuantizedWeight)
    assert_close(model(pl.asarray(IDS, backend=backend)), want, backend=backend, dtype="float32")


@numpy_only
def test_qwen3next_gguf_slices_read_the_weights(qwen3_next_file: tuple) -> None:
    """A partitioned load's reader gives the DeltaNet's tensors in the family's form: HF's
    ``in_proj_qkvz`` as ``split_qkvz`` cuts it, ``A_log``, the norms less llama.cpp's 1."""
    from portable_llm.checkpoint.gguf import GGUFSlices

    path, _ = qwen3_next_file
    model = pl.load(path, backend="numpy", dtype="float32", dequantize=True)
    slices = GGUFSlices(path)
    mixer = model.layers[0].mixer
    for name, want in (("in_proj_qkv.weight", mixer.w_qkv), ("in_proj_z.weight", mixer.w_z),
                       ("A_log", mixer.A_log)):  # fmt: skip
        got = slices.read("model.layers.0.linear_attn." + name)
        np.testing.assert_array_equal(got, np.asarray(want), err_msg=name)
    norm = slices.read("model.layers.1.self_attn.q_norm.weight")
    np.testing.assert_array_equal(norm, np.asarray(model.layers[1].attn.q_norm))
