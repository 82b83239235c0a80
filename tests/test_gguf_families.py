"""GGUF files of the families beyond Llama (``gemma2``, ``gemma3``), written here as llama.cpp's
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
