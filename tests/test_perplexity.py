"""Perplexity and KL divergence (``pl.perplexity``, ``portable-llm perplexity``).

The expected values are computed here from the models' full forwards in float64, by the
definitions (``softmax``, ``-log p``, ``sum p log(p / q)``), not by the module's own helpers.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import portable_llm as pl
from conftest import numpy_only
from portable_llm.cli.cli import main
from portable_llm.generation.perplexity import (
    chunk_windows,
    load_logprobs,
    perplexity,
    save_logprobs,
)
from portable_llm.models import load
from portable_llm.ops.quant import QuantizedWeight, dequantize
from portable_llm.testing import tolerance
from portable_llm.testing.checkpoints import (
    quantized_weights,
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)

CTX = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = {}
    for name, seed in (("a", 3), ("b", 4)):
        folder = tmp_path_factory.mktemp(f"ppl_{name}")
        write_checkpoint(folder, tiny_config("llama"), seed=seed)
        write_tokenizer(folder, vocab_size=300)
        out[name] = folder
    return out


def _probs(model: pl.Model, chunk: np.ndarray) -> np.ndarray:
    """Next-token probabilities ``(ctx, V)`` of a chunk from the model's full causal forward
    (no cache), in float64 by the definition of softmax."""
    logits = np.asarray(pl.to_numpy(model(chunk[None, :]))[0], dtype=np.float64)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 300, size=n)


@numpy_only
def test_perplexity_is_exp_of_the_mean_nll_of_each_chunks_second_half(folders) -> None:
    model = load(folders["a"], backend="numpy", dtype="float64")
    ids = _ids(3 * CTX + 5)  # three whole chunks and a tail that is left out
    got = perplexity(model, ids, ctx=CTX)
    nll = []
    for c in range(3):
        chunk = ids[c * CTX : (c + 1) * CTX]
        p = _probs(model, chunk)
        for j in range(CTX // 2, CTX - 1):  # position j predicts token j + 1
            nll.append(-math.log(p[j, chunk[j + 1]]))
    assert got.tokens == len(nll) == 3 * (CTX // 2 - 1)
    np.testing.assert_allclose(got.nll, nll, rtol=1e-12)
    assert got.perplexity == pytest.approx(math.exp(np.mean(nll)), rel=1e-12)
    sd = np.std(nll) / math.sqrt(len(nll) - 1)
    assert got.perplexity_error == pytest.approx(got.perplexity * sd, rel=1e-9)
    assert got.kl is None and got.same_top is None
    with pytest.raises(ValueError, match="no base model"):
        _ = got.kl_mean


@numpy_only
def test_kl_from_another_model_by_the_definition(folders) -> None:
    model = load(folders["a"], backend="numpy", dtype="float64")
    base = load(folders["b"], backend="numpy", dtype="float64")
    ids = _ids(2 * CTX, seed=1)
    got = perplexity(model, ids, ctx=CTX, base=base)
    kl, same = [], []
    for c in range(2):
        chunk = ids[c * CTX : (c + 1) * CTX]
        q, p = _probs(model, chunk), _probs(base, chunk)
        for j in range(CTX // 2, CTX - 1):
            kl.append(float(np.sum(p[j] * np.log(p[j] / q[j]))))
            same.append(p[j].argmax() == q[j].argmax())
    np.testing.assert_allclose(got.kl, kl, rtol=1e-9, atol=1e-15)
    assert got.kl_mean == pytest.approx(np.mean(kl), rel=1e-9)
    assert got.kl_quantile(0.99) == pytest.approx(np.quantile(kl, 0.99), rel=1e-9)
    assert got.top1_agreement == pytest.approx(np.mean(same))
    assert got.kl_mean > 0  # two different random models


@numpy_only
def test_a_model_against_itself_and_its_saved_logprobs(folders, tmp_path) -> None:
    model = load(folders["a"], backend="numpy", dtype="float32")
    ids = _ids(2 * CTX, seed=2)
    kept: list[np.ndarray] = []
    itself = perplexity(model, ids, ctx=CTX, base=model, keep=kept.append)
    assert np.all(itself.kl == 0) and itself.top1_agreement == 1.0
    path = save_logprobs(tmp_path / "base", kept)
    assert path.suffix == ".npy"
    saved = load_logprobs(path)
    assert saved.shape == (itself.tokens, 300)
    other = load(folders["b"], backend="numpy", dtype="float32")
    by_model = perplexity(other, ids, ctx=CTX, base=model)
    by_file = perplexity(other, ids, ctx=CTX, base=saved)
    # float32 log-probabilities saved, float64 formed from the same logits: float32's rounding
    np.testing.assert_allclose(by_file.kl, by_model.kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(by_file.same_top, by_model.same_top)
    with pytest.raises(ValueError, match="saved base has"):
        perplexity(other, _ids(4 * CTX), ctx=CTX, base=saved)  # more chunks than were saved


@numpy_only
def test_bos_replaces_each_chunks_first_token(folders) -> None:
    model = load(folders["a"], backend="numpy", dtype="float64")
    ids = _ids(2 * CTX, seed=5)
    got = perplexity(model, ids, ctx=CTX, bos=1)
    want = ids.copy()
    want[0], want[CTX] = 1, 1
    np.testing.assert_allclose(got.nll, perplexity(model, want, ctx=CTX).nll, rtol=1e-12)
    assert not np.allclose(got.nll, perplexity(model, ids, ctx=CTX).nll)


def test_kept_codes_against_the_float64_dequantized_model(tmp_path, backend) -> None:
    """The exact mode (codes kept, float32 activations) against the same weights dequantized
    in float64 on NumPy: KL within what float32's tolerance allows. With ``d`` the largest
    logit difference, every log-probability moves by at most ``2 d``, so ``KL <= 2 d``; ``d``
    is bounded by the tolerance table's float32 row at the logits' magnitude."""
    if "float32" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float32")
    write_checkpoint(tmp_path, tiny_config("llama", intermediate_size=64), seed=9)
    cfg = load(tmp_path, backend="numpy", dtype="float64").config
    kept = pl.Model(cfg, quantized_weights(tmp_path, backend=backend), pl.get_backend(backend))
    floats = {
        k: pl.to_numpy(dequantize(w)).astype(np.float64) if isinstance(w, QuantizedWeight) else
        pl.to_numpy(w).astype(np.float64)
        for k, w in quantized_weights(tmp_path, backend="numpy").items()
    }  # fmt: skip
    base = pl.Model(cfg, floats, pl.get_backend("numpy"))
    ids = _ids(2 * CTX, seed=7)
    got = perplexity(kept, ids, ctx=CTX, base=base)
    logits = max(float(np.abs(pl.to_numpy(base(ids[None, c : c + CTX]))).max()) for c in (0, CTX))
    tol = tolerance("float32", backend)
    bound = 2 * (tol.atol + tol.rtol * logits)
    assert got.kl.max() <= bound, (got.kl.max(), bound)
    assert got.top1_agreement >= 0.9


@numpy_only
def test_bad_input_is_named(folders) -> None:
    model = load(folders["a"], backend="numpy", dtype="float32")
    with pytest.raises(ValueError, match="fewer than one chunk of ctx=12"):
        perplexity(model, _ids(CTX - 1), ctx=CTX)
    with pytest.raises(TypeError, match="base must be a model"):
        perplexity(model, _ids(CTX), ctx=CTX, base=[1, 2])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        perplexity(model, np.full(CTX, 400), ctx=CTX)
    with pytest.raises(ValueError, match="ctx"):
        chunk_windows(100, 2)
    assert chunk_windows(100, 30, chunks=2) == [slice(0, 30), slice(30, 60)]


_FIGURES = re.compile(r"perplexity: ([\d.]+) \+/- ([\d.]+)")


@numpy_only
def test_cli_prints_perplexity_kl_and_saves_a_base(folders, tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 20))
    path = str(folders["a"])
    common = [path, "--text", str(text), "--ctx", "16", "--dtype", "float32"]
    saved = tmp_path / "base.npy"
    assert main(["perplexity", *common, "--save-logprobs", str(saved)]) == 0
    first = capsys.readouterr().out
    ppl = float(_FIGURES.search(first).group(1))  # type: ignore[union-attr]
    model = load(folders["a"], backend="numpy", dtype="float32")
    ids = model.tokenizer.encode(text.read_text(), add_special_tokens=False)
    assert ppl == pytest.approx(perplexity(model, ids, ctx=16).perplexity, abs=1e-4)
    assert "tokens scored: the second half of" in first and "tok/s" in first
    assert main(["perplexity", *common, "--kl-base", str(folders["b"])]) == 0
    against = capsys.readouterr().out
    other = load(folders["b"], backend="numpy", dtype="float32")
    want = perplexity(model, ids, ctx=16, base=other)
    mean = float(re.search(r"mean ([\d.]+)", against).group(1))  # type: ignore[union-attr]
    assert mean == pytest.approx(want.kl_mean, abs=1e-6)
    assert f"{100 * want.top1_agreement:.2f} %" in against
    assert main(["perplexity", *common, "--kl-base", str(saved)]) == 0
    itself = capsys.readouterr().out
    assert "mean 0.000000" in itself and "same top token as the base: 100.00 %" in itself
    with pytest.raises(SystemExit) as exit_:
        main(["perplexity", path, "--text", str(tmp_path / "none.txt")])
    assert exit_.value.code == 2
    assert "--text: no such file or folder" in capsys.readouterr().err
