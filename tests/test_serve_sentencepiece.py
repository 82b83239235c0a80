"""Issue 33: sampled requests to a server over a model whose tokenizer is a SentencePiece with
byte fallback. The streaming decoder raised mid-generation on such a tokenizer (a byte run that
turned text already sent into U+FFFD), and the server answered 500 to most sampled requests,
streams cut. Each request's text, streamed or whole, is now what ``generate`` draws with its seed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import skip_reason

if skip_reason("numpy") is not None:  # the server runs the model on NumPy
    pytest.skip(skip_reason("numpy"), allow_module_level=True)
pytest.importorskip("starlette", reason="the serve extra (starlette) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")

import portable_llm as pl  # noqa: E402
from portable_llm.serve import create_app  # noqa: E402
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint  # noqa: E402
from servers import serving  # noqa: E402
from test_tokenizer_stream import _build, _saved  # noqa: E402

PROMPT = "The cache"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pl.Model:
    """A random Llama-shaped checkpoint with a SentencePiece (byte fallback) tokenizer.json:
    with random weights, about half of the drawn ids are byte tokens."""
    tok, _ = _build("json-sentencepiece-byte-fallback", tmp_path_factory.mktemp("spm"))
    folder = tmp_path_factory.mktemp("model")
    write_checkpoint(folder, tiny_config("llama", vocab_size=tok.vocab_size), seed=3)
    _saved(tok, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return pl.load(folder, backend="numpy", dtype="float32")


def test_sampled_requests_stream_what_generate_draws(model: pl.Model) -> None:
    ids = model.tokenizer.encode_prompt(PROMPT)
    byte_ids = model.tokenizer._stream_rules(True)[1]
    app = create_app(model, model_name="spm", max_batch=8, pool_pages=64)
    args: dict[str, Any] = {"model": "spm", "prompt": PROMPT, "max_tokens": 24, "temperature": 1}
    runs = 0
    with serving(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="-") as client:
        for seed in range(6):
            drawn = list(pl.generate(model, ids, max_new_tokens=24, temperature=1.0, seed=seed))
            runs += any(i in byte_ids for i in drawn)
            chunks = list(client.completions.create(**args, seed=seed, stream=True))
            streamed = "".join(c.choices[0].text for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason in ("length", "stop")
            whole = client.completions.create(**args, seed=seed).choices[0].text
            assert streamed == whole == model.tokenizer.decode(drawn), seed
    assert runs >= 4  # most requests drew byte tokens
