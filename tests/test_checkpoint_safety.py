"""Broken, hostile and lying checkpoint folders: each is a clear error naming the file (a
``CheckpointError``, or ``FileNotFoundError`` for a missing file), never a raw library error, a
file read from outside the folder, or minutes of work; the command line prints one line."""

from __future__ import annotations

import json
import os
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.cli.cli import main
from portable_llm.models import CheckpointError, load
from portable_llm.testing.checkpoints import (
    random_tensors,
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)


def _folder(tmp_path: Path, family: str = "qwen2", **opts: object) -> Path:
    folder = tmp_path / "ckpt"
    cfg = tiny_config(family)
    write_checkpoint(folder, cfg, **opts)  # type: ignore[arg-type]
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return folder


def _cli_error(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``portable-llm generate`` prints for ``folder`` (exit code 1)."""
    code = main(["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    lines = re.sub(r"\n {4}", " ", captured.err).splitlines()  # wrapped at 100 columns
    assert len(lines) == 1, captured.err  # no traceback
    assert lines[0].startswith("portable-llm generate: error: load: ")
    return lines[0]


# -- safetensors files that are not ---------------------------------------------------------------


def _header(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _with_header(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def _truncated(raw: bytes) -> bytes:
    return raw[: len(raw) - 100]


def _garbage(raw: bytes) -> bytes:
    return b"this is not a safetensors file at all; " * 10


def _empty(raw: bytes) -> bytes:
    return b""


def _lying_shape(raw: bytes) -> bytes:
    header, data = _header(raw)
    header["model.norm.weight"]["shape"] = [32000]  # more than its offsets cover
    return _with_header(header, data)


def _lying_offsets(raw: bytes) -> bytes:
    header, data = _header(raw)
    begin, _ = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [begin, len(data) + 4096]  # past the end
    return _with_header(header, data)


CORRUPTIONS = [_truncated, _garbage, _empty, _lying_shape, _lying_offsets]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_safetensors_is_a_checkpoint_error_naming_the_file(
    corrupt, tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path)
    file = folder / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    with pytest.raises(CheckpointError, match=f"{file}' is not a valid safetensors file"):
        load(folder, backend=backend)
    assert f"{file}' is not a valid safetensors file" in _cli_error(folder, capsys)


def test_corrupt_shard_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "llama", shards=3)
    shard = folder / "model-00002-of-00003.safetensors"
    shard.write_bytes(_truncated(shard.read_bytes()))
    with pytest.raises(CheckpointError, match=f"{shard}' is not a valid safetensors file"):
        load(folder)


# -- JSON side files ------------------------------------------------------------------------------

JSON_FILES = [
    ("config.json", "[1, 2, 3]", "must hold an object"),
    ("config.json", '{"model_type": "qwen2",', "is not valid JSON"),
    ("config.json", b"\xff\xfe{}", "is not valid JSON"),
    ("model.safetensors.index.json", '{"metadata": {}}', "has no weight_map"),
    ("model.safetensors.index.json", '{"weight_map": [1]}', "has no weight_map"),
    ("model.safetensors.index.json", '{"weight_map": {"a": 3}}', "has no weight_map"),
    ("model.safetensors.index.json", "not json", "is not valid JSON"),
    ("tokenizer.json", '{"version": "1.0", "model": 5}', "is not a valid tokenizer"),
    ("tokenizer.json", "{{{", "is not a valid tokenizer"),
    ("tokenizer_config.json", '{"eos_token": ', "is not valid JSON"),
    ("tokenizer_config.json", '"just a string"', "must hold an object"),
    ("special_tokens_map.json", "[]", "must hold an object"),
    ("chat_template.json", "{", "is not valid JSON"),
    ("generation_config.json", "{'single': 'quotes'}", "is not valid JSON"),
    ("generation_config.json", '{"eos_token_id": "2"}', "eos_token_id must be an int >= 0"),
    ("generation_config.json", '{"eos_token_id": [2, -1]}', "eos_token_id must be an int >= 0"),
]


@pytest.mark.parametrize(("name", "content", "message"), JSON_FILES)
def test_malformed_json_file_is_named(
    name: str, content: str | bytes, message: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    folder = _folder(tmp_path, shards=2 if name.startswith("model.") else 1)
    file = folder / name
    if name == "chat_template.json":  # read only when no other file has a template
        config = json.loads((folder / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content)
    with pytest.raises(CheckpointError, match=f"load: '{file}'.* {message}"):
        load(folder)
    assert message in _cli_error(folder, capsys)


# -- tensors --------------------------------------------------------------------------------------


def test_integer_tensor_is_named(tmp_path: Path, backend: str) -> None:
    cfg = tiny_config("qwen2")
    tensors = random_tensors(cfg)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((48, 32), np.int32)
    tensors["model.norm.weight"] = np.ones(32, np.int64)
    write_checkpoint(tmp_path, cfg, tensors=tensors)
    with pytest.raises(CheckpointError) as info:
        load(tmp_path, backend=backend, dtype="float32")
    assert str(info.value).endswith(
        "tensors that are not float (F16, BF16, F32, F64) (2): "
        "model.layers.1.mlp.up_proj.weight (I32), model.norm.weight (I64)"
    )
    tensors["model.embed_tokens.weight"] = np.zeros((300, 32), np.int32)
    write_checkpoint(tmp_path, cfg, tensors=tensors)
    with pytest.raises(
        CheckpointError,
        match=r"model\.embed_tokens\.weight in '.*model\.safetensors' is stored as I32, not a "
        "float dtype",
    ):
        load(tmp_path, backend=backend)  # no dtype=: the embeddings' dtype is the default


def test_index_naming_a_missing_shard_says_which(tmp_path: Path) -> None:
    """The index exists but maps tensors to a file that is not there: the message names that
    file, never "no model.safetensors"."""
    folder = _folder(tmp_path, shards=2)
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.embed_tokens.weight"] = "model-elsewhere.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError) as info:
        load(folder)
    assert "names shard files that are not in the folder: model-elsewhere.safetensors" in str(
        info.value
    )
    assert "no model.safetensors" not in str(info.value)


# -- paths out of the folder ----------------------------------------------------------------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A valid checkpoint next to the one under test, whose files must never be read."""
    return _folder(tmp_path / "other")


@pytest.mark.parametrize("entry", ["../other/ckpt/model.safetensors", "ABSOLUTE", "a/../../x"])
def test_index_entries_out_of_the_folder_are_refused(
    entry: str, tmp_path: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path, shards=2)
    entry = str(outside / "model.safetensors") if entry == "ABSOLUTE" else entry
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.norm.weight"] = entry
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"absolute paths and '\.\.' are refused"):
        load(folder)
    assert "refused" in _cli_error(folder, capsys)


@pytest.mark.parametrize(
    "name", ["model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"]
)
def test_symlink_out_of_the_folder_is_refused(name: str, tmp_path: Path, outside: Path) -> None:
    folder = _folder(tmp_path)
    target = outside / ("tokenizer_config.json" if name.endswith(".jinja") else name)
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(target)
    with pytest.raises(CheckpointError, match=f"{folder / name}' leads out of the checkpoint"):
        load(folder)


def test_symlinked_shard_out_of_the_folder_is_refused(tmp_path: Path, outside: Path) -> None:
    folder = _folder(tmp_path, shards=2)
    shard = folder / "model-00001-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(outside / "model.safetensors")
    with pytest.raises(CheckpointError, match="leads out of the checkpoint folder"):
        load(folder)


def test_hub_cache_snapshot_symlinks_load(tmp_path: Path) -> None:
    """A Hub cache snapshot (files symlinked into the repository's blobs/) still loads, and
    gives the logits of the plain folder."""
    plain = _folder(tmp_path)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(plain.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    ids = [[5, 9, 200, 17]]
    np.testing.assert_array_equal(pl.to_numpy(load(snapshot)(ids)), pl.to_numpy(load(plain)(ids)))


# -- sizes checked against the weights first ------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "key", "what"),
    [
        ("qwen2", "num_hidden_layers", "layers"),
        ("mixtral", "num_local_experts", "experts"),
        ("qwen2_moe", "num_experts", "experts"),
    ],
)
def test_huge_counts_fail_at_once(family: str, key: str, what: str, tmp_path: Path) -> None:
    folder = _folder(tmp_path, family)
    file = folder / "config.json"
    cfg = json.loads(file.read_text())
    held = cfg[key]
    cfg[key] = 10**7
    file.write_text(json.dumps(cfg))
    start = time.perf_counter()
    with pytest.raises(
        CheckpointError, match=f"'{file}': {key}=10000000 but the weights hold {held} {what}$"
    ):
        load(folder)
    assert time.perf_counter() - start < 5.0  # minutes before the check


# -- config values checked at load, naming the file -----------------------------------------------

BAD_VALUES = [
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be finite and >= 0.0, got -1e-06"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a real number, got str '1e-6'"),
    ({"eos_token_id": "2"}, "eos_token_id must be an int, got str '2'"),
    ({"eos_token_id": [2, 3.5]}, "eos_token_id must be an int, got float 3.5"),
    ({"eos_token_id": -1}, "eos_token_id must be >= 0, got -1"),
    ({"bos_token_id": True}, "bos_token_id must be an int, got bool True"),
    ({"hidden_size": 32.0}, "hidden_size must be an int, got float 32.0"),
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1, got 0"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"rope_theta": "1e6"}, "rope_theta must be a real number"),
    ({"rope_theta": 0.5}, "rope_theta must be finite and > 1.0, got 0.5"),
    ({"sliding_window": -4, "use_sliding_window": True}, "sliding_window must be >= 0, got -4"),
    ({"layer_types": "full_attention"}, "layer_types must be a list"),
    ({"hidden_act": ["silu"]}, "unknown hidden_act ['silu']"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "factor must be > 0"),
    ({"model_type": "bert"}, "unsupported model_type 'bert'; supported: cohere2, "),
]


@pytest.mark.parametrize(("change", "message"), BAD_VALUES)
def test_bad_config_value_names_the_file(change: dict, message: str, tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    file = folder / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    with pytest.raises(CheckpointError) as info:
        load(folder)
    assert str(info.value).startswith(f"load: '{file}': ")
    assert message in str(info.value)


def test_edge_values_still_load(tmp_path: Path) -> None:
    """Values at the edges of what is allowed: eps 0, window null (none), eos as a list. (A
    window of 0 is refused: transformers cannot run it, tests/test_hardening_models.py.)"""
    folder = _folder(tmp_path, "mistral")
    file = folder / "config.json"
    change = {"rms_norm_eps": 0.0, "sliding_window": None, "eos_token_id": [2, 0]}
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    model = load(folder)
    assert model.config.rms_norm_eps == 0.0 and model.config.window(0) is None
    assert model.config.eos_token_id == (2, 0)


# -- the dtype message reads whole ----------------------------------------------------------------


def test_dtype_the_backend_lacks_says_what_to_pass(tmp_path: Path) -> None:
    pytest.importorskip("array_api_strict")
    pytest.importorskip("ml_dtypes")
    write_checkpoint(tmp_path, tiny_config("qwen2"), dtype="bfloat16")
    with pytest.raises(ValueError) as info:
        load(tmp_path, backend="array_api_strict")
    assert str(info.value).endswith(
        'pass dtype= to load the checkpoint in a dtype the backend has (e.g. dtype="float32")'
    )
    assert load(tmp_path, backend="array_api_strict", dtype="float32").dtype is not None
