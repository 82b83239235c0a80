"""mlx-lm quantized folders (``mlx_lm.convert(quantize=True)``) loaded by ``pl.load`` on every
backend, kept quantized, against mlx-lm's own model on the same folder; and the quantized ops
against MLX's own kernels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.ops.quant import QuantizedWeight, dequantize, quantize
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import save_hf_tokenizer, tiny_config, write_checkpoint

pytestmark = pytest.mark.oracle

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
mlx_lm_utils = pytest.importorskip("mlx_lm.utils")

IDS = np.random.default_rng(0).integers(3, 300, size=(2, 7))
# (bits, group_size, per-layer overrides) of each converted folder
VARIANTS: dict[str, tuple[int, int, dict[str, Any]]] = {
    "q4g64": (4, 64, {}),
    "q3g32": (3, 32, {}),
    "q8g128_mixed": (8, 128, {"model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 4}}),
}


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    cfg = tiny_config("qwen2", hidden_size=128, intermediate_size=256, head_dim=32)
    write_checkpoint(folder, cfg, seed=3)
    save_hf_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return folder


def _convert(hf: Path, out: Path, bits: int, group: int, overrides: dict[str, Any]) -> Path:
    def predicate(path: str, module: Any, *_: Any) -> Any:
        return overrides.get(path, True)

    mlx_lm.convert(
        hf_path=str(hf), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=group,
        quant_predicate=predicate if overrides else None,
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def mlx_folders(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx")
    return {
        name: _convert(hf_folder, root / name, bits, group, over)
        for name, (bits, group, over) in VARIANTS.items()
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_folder_logits_match_mlx_lm(mlx_folders: dict, variant: str, backend: str) -> None:
    folder = mlx_folders[variant]
    config = json.loads((folder / "config.json").read_text())
    bits, group, over = VARIANTS[variant]
    assert config["quantization"]["bits"] == bits
    for path, entry in over.items():
        assert config["quantization"][path]["bits"] == entry["bits"]
    ref, _ = mlx_lm_utils.load_model(folder)
    want = np.array(ref(mx.array(IDS)))
    model = pl.load(folder, backend=backend, dequantize=False)
    q = model.layers[0].attn.wq  # kept quantized, as converted
    assert isinstance(q, QuantizedWeight) and (q.bits, q.group_size) == (bits, group)
    assert isinstance(model.embed, QuantizedWeight)
    if over:
        down = model.layers[0].mlp.w_down
        entry = over["model.layers.0.mlp.down_proj"]
        assert (down.bits, down.group_size) == (entry["bits"], entry["group_size"])
    got = model(pl.asarray(IDS, backend=backend))
    # float32 throughout: mlx-lm's quantized_matmul and the portable dequantize-then-matmul sum
    # the same dequantized weights in another order (float32's tolerance).
    assert_close(got, want, backend=backend, dtype="float32")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_quantize_equals_mx_quantize(backend: str, bits: int, dtype: str) -> None:
    """Bit for bit, every backend's quantize against mx.quantize on the same rounded input."""
    bk = pl.get_backend(backend)
    if dtype not in bk.float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    w32 = np.random.default_rng(bits).normal(size=(16, 256)).astype(np.float32)
    wm = mx.array(w32).astype(getattr(mx, dtype))
    q, s, b = mx.quantize(wm, group_size=64, bits=bits)
    host = np.array(wm.astype(mx.float32))
    w = pl.asarray(host, backend=backend, dtype=dtype)
    qw = quantize(w, bits=bits, group_size=64)
    np.testing.assert_array_equal(bk.to_numpy(qw.packed), np.array(q))
    for got, exp in ((qw.scales, s), (qw.biases, b)):
        np.testing.assert_array_equal(
            bk.to_numpy(got).astype(np.float32), np.array(exp.astype(mx.float32))
        )
    want = np.array(mx.dequantize(q, s, b, group_size=64, bits=bits).astype(mx.float32))
    np.testing.assert_array_equal(bk.to_numpy(dequantize(qw)).astype(np.float32), want)


@pytest.fixture(scope="session")
def mixtral_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral converted by mlx-lm at 4 bits (its experts stacked: switch_mlp)."""
    root = tmp_path_factory.mktemp("moe")
    cfg = tiny_config("mixtral", hidden_size=128, intermediate_size=128, head_dim=32)
    write_checkpoint(root / "hf", cfg, seed=5)
    save_hf_tokenizer(root / "hf", vocab_size=cfg["vocab_size"])
    return _convert(root / "hf", root / "q", 4, 64, {})


def test_moe_folder_logits_match_mlx_lm(mixtral_folder: Path, backend: str) -> None:
    """Quantized MoE: mlx-lm's stacked experts load kept quantized, as (X, I, E) weights."""
    ref, _ = mlx_lm_utils.load_model(mixtral_folder)
    want = np.array(ref(mx.array(IDS)))
    model = pl.load(mixtral_folder, backend=backend, dequantize=False)
    gate = model.layers[0].moe.experts_gate  # the experts' gate projections, stacked
    assert isinstance(gate, QuantizedWeight) and gate.shape == (4, 128, 128)
    got = model(pl.asarray(IDS, backend=backend))
    assert_close(got, want, backend=backend, dtype="float32")
