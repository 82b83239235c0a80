"""GGUF files of the families beyond Llama (``gemma2``, ``gemma3``, ``phi2``, ``phi3``, ``gpt2``),
written here as llama.cpp's
converter writes them (its tensor names, every Gemma norm weight stored as ``1 + w``, the
metadata keys), give the config and the logits of the HF folder holding the same weights, on
every backend. The real Gemma 3 270M file is checked against transformers in
``tests/test_oracle_gguf_gemma3.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.checkpoint.weights import expected_shapes
from portable_llm.decoder.config import DecoderConfig
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import write_checkpoint

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")

EPS = float(np.float32(1e-6))  # GGUF stores it as float32
#: llama.cpp's names of the Gemma tensors (HF's -> GGUF's).
_GEMMA = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gemma_config(model_type: str) -> dict[str, Any]:
    """A ``config.json`` that a GGUF describes exactly: 7 layers (Gemma 3's sixth is global),
    a sliding window of 4 tokens, HF's defaults for what GGUF does not hold."""
    return {
        "model_type": model_type, "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": EPS, "rope_theta": 1e6 if "3" in model_type else 1e4,
        "max_position_embeddings": 256, "sliding_window": 4, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh",
    }  # fmt: skip


def gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, i, rest = hf.split(".", 3)
    stem, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{_GEMMA[stem]}.{suffix}"


def write_gemma_gguf(path: Path, arch: str, cfg: dict[str, Any], tensors: dict[str, Any]) -> None:
    """``tensors`` (HF names) as llama.cpp's Gemma converters write them, in float32."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, field in {
        "block_count": "num_hidden_layers",
        "context_length": "max_position_embeddings",
        "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.key_length": "head_dim",
        "attention.value_length": "head_dim",
        "attention.sliding_window": "sliding_window",
    }.items():
        w.add_uint32(f"{arch}.{key}", cfg[field])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", 50.0)
        w.add_float32(f"{arch}.final_logit_softcapping", 30.0)
    for hf, value in tensors.items():
        stored = value + np.float32(1.0) if hf.endswith("norm.weight") else value
        w.add_tensor(gguf_name(hf), stored.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_weights(cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Weights of ``cfg``: norms (HF's ``w``, the scale being ``1 + w``) in ``[-0.2, 0.2]``."""
    rng = np.random.default_rng(3)
    out = {}
    for name, shape in expected_shapes(DecoderConfig.from_dict(cfg)).items():
        bound = 0.2 if len(shape) == 1 else 2.0 / np.sqrt(shape[-1])
        out[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
    return out


@pytest.mark.parametrize(("arch", "model_type"), [("gemma3", "gemma3_text"), ("gemma2", "gemma2")])
def test_gemma_gguf_equals_the_folder(
    arch: str, model_type: str, backend: str, tmp_path: Path
) -> None:
    cfg = gemma_config(model_type)
    weights = random_weights(cfg)
    write_gemma_gguf(tmp_path / "m.gguf", arch, cfg, weights)
    write_checkpoint(tmp_path / "hf", cfg, tensors=weights)
    ref = pl.load(tmp_path / "hf", backend=backend, dtype="float32")
    model = pl.load(tmp_path / "m.gguf", backend=backend, dtype="float32")
    assert model.config == ref.config
    assert model.config.sandwich_norms and model.config.norm_offset == 1.0
    if arch == "gemma3":
        assert "full_attention" in model.config.layer_types
    ids = [[5, 17, 42, 99, 3, 250, 7, 11, 8, 60]]  # longer than the window
    assert_close(model(ids), ref(ids), backend=backend)


#: llama.cpp's names of the Phi-2, Phi-3 and GPT-2 tensors (HF's -> GGUF's), q/k/v fused as
#: ``attn_qkv`` (and Phi-3's gate/up as ``ffn_up``), the rows stacked in HF's order.
_PLAIN = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.o_proj": "attn_output",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_PLAIN_TOP = {
    **_TOP,
    "lm_head.weight": "output.weight",
    "lm_head.bias": "output.bias",
    "model.norm.bias": "output_norm.bias",
    "model.embed_positions.weight": "position_embd.weight",
}
_FUSED = {"attn_qkv": ("q_proj", "k_proj", "v_proj"), "ffn_up": ("gate_proj", "up_proj")}


def plain_config(model_type: str) -> dict[str, Any]:
    """A 2-layer ``config.json`` of Phi-2 (``phi``: partial rotary), Phi-3 or GPT-2."""
    cfg: dict[str, Any] = {
        "model_type": model_type, "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "rms_norm_eps": EPS, "max_position_embeddings": 64, "bos_token_id": 2,
        "eos_token_id": 1, "tie_word_embeddings": model_type == "gpt2",
    }  # fmt: skip
    if model_type == "phi":
        cfg.update(partial_rotary_factor=0.5, rope_theta=1e4, hidden_act="gelu_new")
    if model_type == "phi3":
        cfg.update(num_key_value_heads=2, rope_theta=1e4, hidden_act="silu")
    if model_type == "gpt2":
        cfg.update(hidden_act="gelu_new")
    return cfg


def plain_tensors(cfg: dict[str, Any], tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF name -> tensor, as llama.cpp writes them (q/k/v fused; Phi-3's gate/up fused)."""
    out = {}
    for hf, value in tensors.items():
        if hf in _PLAIN_TOP:
            out[_PLAIN_TOP[hf]] = value
            continue
        _, _, i, rest = hf.split(".", 3)
        stem, suffix = rest.rsplit(".", 1)
        if stem in _PLAIN and not (cfg["model_type"] == "phi3" and stem == "mlp.up_proj"):
            out[f"blk.{i}.{_PLAIN[stem]}.{suffix}"] = value
    for g, pieces in _FUSED.items():
        prefix = "self_attn" if g == "attn_qkv" else "mlp"
        if g == "ffn_up" and cfg["model_type"] != "phi3":
            continue
        for i in range(cfg["num_hidden_layers"]):
            for suffix in ("weight", "bias"):
                rows = [tensors.get(f"model.layers.{i}.{prefix}.{p}.{suffix}") for p in pieces]
                if all(r is not None for r in rows):
                    out[f"blk.{i}.{g}.{suffix}"] = np.concatenate(rows)
    return out


def write_plain_gguf(
    path: Path, arch: str, cfg: dict[str, Any], tensors: dict[str, Any], *, q8: bool = False
) -> None:
    """``tensors`` as llama.cpp writes them: float32, or the matrices in Q8_0 (``q8``)."""
    w = gguf.GGUFWriter(str(path), arch)
    E, H = cfg["hidden_size"], cfg["num_attention_heads"]
    counts = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": E,
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": H,
        "attention.head_count_kv": cfg["num_key_value_heads"],
    }
    if arch != "gpt2":
        counts["rope.dimension_count"] = int(E // H * cfg.get("partial_rotary_factor", 1.0))
        w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    for key, value in counts.items():
        w.add_uint32(f"{arch}.{key}", value)
    eps = "layer_norm_rms_epsilon" if arch == "phi3" else "layer_norm_epsilon"
    w.add_float32(f"{arch}.attention.{eps}", cfg["rms_norm_eps"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    for name, value in plain_tensors(cfg, tensors).items():
        if q8 and value.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gpt2_layout(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF's GPT-2 checkpoint (``transformer.h.{i}``: Conv1D weights as (in, out), q/k/v fused
    as ``c_attn``) of the same weights."""
    out = {
        "transformer.wte.weight": weights["model.embed_tokens.weight"],
        "transformer.wpe.weight": weights["model.embed_positions.weight"],
        "transformer.ln_f.weight": weights["model.norm.weight"],
        "transformer.ln_f.bias": weights["model.norm.bias"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p, h = f"model.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            out[f"{h}ln_1.{kind}"] = weights[f"{p}input_layernorm.{kind}"]
            out[f"{h}ln_2.{kind}"] = weights[f"{p}post_attention_layernorm.{kind}"]
            qkv = [weights[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv"]
            out[f"{h}attn.c_attn.{kind}"] = np.concatenate(qkv).T.copy()
            for theirs, ours in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.up_proj"),
                                 ("mlp.c_proj", "mlp.down_proj")):  # fmt: skip
                out[f"{h}{theirs}.{kind}"] = weights[f"{p}{ours}.{kind}"].T.copy()
    return out


@pytest.mark.parametrize(
    ("arch", "model_type"), [("phi2", "phi"), ("phi3", "phi3"), ("gpt2", "gpt2")]
)
def test_fused_gguf_equals_the_folder(
    arch: str, model_type: str, backend: str, tmp_path: Path
) -> None:
    """Phi-2 (LayerNorm with biases, partial rotary, lm_head bias), Phi-3 (fused gate/up) and
    GPT-2 (learned positions): the fused tensors split into HF's, on read and through
    :class:`~portable_llm.checkpoint.gguf.GGUFSlices`."""
    from portable_llm.checkpoint.gguf import GGUFSlices

    cfg = plain_config(model_type)
    weights = random_weights(cfg)
    write_plain_gguf(tmp_path / "m.gguf", arch, cfg, weights)
    model = pl.load(tmp_path / "m.gguf", backend=backend, dtype="float32")
    ids = [[5, 17, 42, 99, 3, 250, 7, 11, 8, 60]]
    if model_type == "gpt2":  # transformers' GPT-2 on the same weights (its Conv1D layout)
        transformers = pytest.importorskip("transformers")
        torch = pytest.importorskip("torch")
        hf = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=300,
                n_positions=64,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_inner=64,
                layer_norm_epsilon=EPS,
                activation_function="gelu_new",
            )
        ).eval()
        state = {k: torch.from_numpy(v) for k, v in gpt2_layout(cfg, weights).items()}
        hf.load_state_dict(state, strict=False)
        with torch.no_grad():
            want = hf(torch.tensor(ids)).logits.numpy()
        assert_close(model(ids), want, backend=backend)
    else:
        write_checkpoint(tmp_path / "hf", cfg, tensors=weights)
        ref = pl.load(tmp_path / "hf", backend=backend, dtype="float32")
        assert model.config == ref.config
        assert_close(model(ids), ref(ids), backend=backend)
    slices = GGUFSlices(tmp_path / "m.gguf")
    assert set(slices.shapes) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(slices.read(name), value, err_msg=name)
        if value.ndim == 2 and value.shape[1] % 32 == 0:
            np.testing.assert_array_equal(slices.read(name, (slice(1, 5),)), value[1:5])


def test_fused_quantized_rows_split(backend: str, tmp_path: Path) -> None:
    """Kept quantized, the row blocks of Phi-3's fused Q8_0 ``attn_qkv`` and ``ffn_up`` are
    those of the dequantized tensor."""
    cfg = plain_config("phi3")
    write_plain_gguf(tmp_path / "m.gguf", "phi3", cfg, random_weights(cfg), q8=True)
    kept = pl.load(tmp_path / "m.gguf", backend=backend, dtype="float32", dequantize=False)
    floats = pl.load(tmp_path / "m.gguf", backend=backend, dtype="float32", dequantize=True)
    ids = [[5, 17, 42, 99, 3, 250, 7]]
    assert_close(kept(ids), floats(ids), backend=backend)
