"""The grammar's mask on every backend: ``generate`` with ``response_format`` gives, greedily,
the same valid JSON on each backend as on NumPy (the mask is built on the host and applied with
the backend's ``where``, on the logits' device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llguidance", reason="the grammar engine (the serve extra) is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the test extra)")

import portable_llm as pl  # noqa: E402
from portable_llm.testing.checkpoints import (  # noqa: E402
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grammar_backends")
    cfg = tiny_config("llama", max_position_embeddings=512)
    write_checkpoint(path, cfg, seed=11)
    write_tokenizer(path, vocab_size=cfg["vocab_size"])
    return path


def test_same_valid_json_on_every_backend(folder: Path, backend: str) -> None:
    expected = "".join(
        pl.generate(pl.load(folder, backend="numpy", dtype="float32"), "hello there",
                    max_new_tokens=200, response_format=FORMAT)
    )  # fmt: skip
    model = pl.load(folder, backend=backend, dtype="float32")
    gen = pl.generate(model, "hello there", max_new_tokens=200, response_format=FORMAT)
    text = "".join(gen)
    assert gen.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == expected
