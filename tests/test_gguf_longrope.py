"""A Phi-3 ``longrope`` GGUF, written as llama.cpp's ``convert_hf_to_gguf`` writes one (the
factors as ``rope_factors_long``/``rope_factors_short`` float32 tensors, the original length as
``phi3.rope.scaling.original_context_length``, the attention factor as ``.attn_factor``), gives
the logits of the HF folder holding the same weights and ``rope_scaling``, on every backend,
below and beyond the original length. (transformers reads no longrope from a GGUF; the HF
folder's longrope is checked against transformers in ``tests/test_oracle_longrope.py``.)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import write_checkpoint

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
sys.path.insert(0, str(Path(__file__).parent))
from test_gguf_families import plain_config, plain_tensors, random_weights  # noqa: E402

OMPE = 8
IDS = [[5, 17, 42, 99, 3, 250, 7, 11, 8, 60, 13, 21]]


def _config() -> dict:
    cfg = plain_config("phi3")  # head_dim 8: 4 pairs, max_position_embeddings 64
    cfg["original_max_position_embeddings"] = OMPE
    cfg["rope_scaling"] = {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.2, 1.4, 1.6],
        "long_factor": [1.0, 3.0, 6.0, 9.0],
    }
    return cfg


def _write(
    path: Path, cfg: dict, tensors: dict, *, factors: tuple[str, ...] = ("long", "short")
) -> None:
    w = gguf.GGUFWriter(str(path), "phi3")
    E, H = cfg["hidden_size"], cfg["num_attention_heads"]
    for key, value in {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": E, "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": H, "attention.head_count_kv": cfg["num_key_value_heads"],
        "rope.dimension_count": E // H, "rope.scaling.original_context_length": OMPE,
    }.items():  # fmt: skip
        w.add_uint32(f"phi3.{key}", value)
    w.add_float32("phi3.rope.freq_base", cfg["rope_theta"])
    w.add_float32("phi3.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    scale = cfg["max_position_embeddings"] / OMPE  # llama.cpp's converter
    w.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(OMPE)))
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    for name, value in plain_tensors(cfg, tensors).items():
        w.add_tensor(name, value.astype(np.float32))
    for kind in factors:
        value = np.array(cfg["rope_scaling"][f"{kind}_factor"], np.float32)
        w.add_tensor(f"rope_factors_{kind}.weight", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_longrope_gguf_equals_the_folder(backend: str, tmp_path: Path) -> None:
    cfg = _config()
    weights = random_weights(cfg)
    _write(tmp_path / "m.gguf", cfg, weights)
    write_checkpoint(tmp_path / "hf", cfg, tensors=weights)
    model = pl.load(tmp_path / "m.gguf", backend=backend, dtype="float32")
    ref = pl.load(tmp_path / "hf", backend=backend, dtype="float32")
    scaling = model.config.rope["scaling"]
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == OMPE
    assert scaling["long_factor"] == cfg["rope_scaling"]["long_factor"]
    assert model.recompute_after == OMPE
    for length in (6, 12):  # short factors, then long (12 > 8)
        ids = [IDS[0][:length]]
        assert_close(model(ids), ref(ids), backend=backend)


def test_longrope_gguf_factor_tensors(tmp_path: Path) -> None:
    """No factor tensors: the plain RoPE (a Phi-3 4k file); only one of them (either): a clear
    error naming both."""
    from portable_llm.checkpoint import CheckpointError

    cfg = _config()
    weights = random_weights(cfg)
    _write(tmp_path / "plain.gguf", cfg, weights, factors=())
    plain = pl.load(tmp_path / "plain.gguf", backend="numpy")
    assert plain.config.rope["scaling"]["rope_type"] == "default"
    _write(tmp_path / "long.gguf", cfg, weights, factors=("long",))
    with pytest.raises(CheckpointError, match=r"rope_factors_short\.weight is missing"):
        pl.load(tmp_path / "long.gguf", backend="numpy")
    _write(tmp_path / "short.gguf", cfg, weights, factors=("short",))
    with pytest.raises(CheckpointError, match=r"rope_factors_long\.weight is missing"):
        pl.load(tmp_path / "short.gguf", backend="numpy")
