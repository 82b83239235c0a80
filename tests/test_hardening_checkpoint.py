"""Hostile checkpoints (issue 22), one regression test per class: counts checked against the
file's size or the tensors present before anything is allocated, bounded error messages,
typed and ranged metadata, the containment rule, and every failure a ``CheckpointError`` (or
``ValueError``/``TypeError``) that names the file and the key. The files are small, built by
the tests."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.checkpoint.files import MAX_MESSAGE, CheckpointError, checkpoint_file
from portable_llm.checkpoint.gguf_header import read_gguf_header
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
from test_gguf import (  # noqa: E402
    family_config,
    gguf_tokenizer_meta,
    random_weights,
    write_gguf,
)
from test_gguf import rewrite_gguf as rewrite  # noqa: E402

VT = gguf.GGUFValueType


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid 1-layer qwen2 GGUF with a byte-level BPE tokenizer (300 tokens)."""
    folder = tmp_path_factory.mktemp("hostile_gguf")
    cfg = family_config("qwen2", num_hidden_layers=1)
    tok = gguf_tokenizer_meta(folder / "tok")
    file = folder / "base.gguf"
    write_gguf(file, "qwen2", cfg, random_weights(cfg), tok=tok)
    return file


def patch_count(src: Path, dst: Path, key: str, count: int) -> Path:
    """``src`` with the item count of array ``key`` overwritten in place (the bytes after it
    unchanged): a file of the same size that claims ``count`` items."""
    field = gguf.GGUFReader(src).fields[key]
    at = field.offset + 8 + len(key.encode()) + 4 + 4  # key length, key, type, item type
    data = bytearray(src.read_bytes())
    data[at : at + 8] = struct.pack("<Q", count)
    dst.write_bytes(bytes(data))
    return dst


def _bounded(fn: Any, *, seconds: float = 10.0, mib: float = 64.0) -> None:
    """Run ``fn`` under tracemalloc: it must finish within ``seconds`` and trace at most
    ``mib`` MiB."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < seconds
    assert peak < mib * 2**20, f"{peak / 2**20:.0f} MiB traced"


# -- counts against the file's size and the tensors present --------------------------------------


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
def test_metadata_array_claiming_2_40_items(base: Path, tmp_path: Path, key: str) -> None:
    """An array declaring 2**40 items is refused from the file's size before any is read (the
    reader used to read on past the end, growing ~70 MB/s)."""
    bad = patch_count(base, tmp_path / "big.gguf", key, 2**40)

    def load() -> None:
        with pytest.raises(CheckpointError, match=r"big\.gguf.*item count of metadata .* is "):
            pl.load(bad)

    _bounded(load)


def test_tensor_and_key_counts_are_checked_against_the_size(base: Path, tmp_path: Path) -> None:
    data = bytearray(base.read_bytes())
    for at, what in ((8, "the tensor count"), (16, "the metadata key count")):
        bad = bytearray(data)
        bad[at : at + 8] = struct.pack("<Q", 2**62)
        (tmp_path / "c.gguf").write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=f"{what} is {2**62}, but the"):
            pl.load(tmp_path / "c.gguf")


@pytest.mark.parametrize("blocks", [300_000, 3_000_000, 2**40])
def test_block_count_against_the_tensors(base: Path, tmp_path: Path, blocks: int) -> None:
    """A block_count larger than the layers the file holds tensors of fails at once, in a short
    message (3,000,000 used to allocate 2.85 GB; 300,000 gave a 94-million-character error)."""
    bad = rewrite(base, tmp_path / "b.gguf", {"qwen2.block_count": (blocks, VT.UINT64)})

    def load() -> None:
        with pytest.raises(CheckpointError) as info:
            pl.load(bad)
        assert f"qwen2.block_count={blocks} but the weights hold 1 layers" in str(info.value)
        assert len(str(info.value)) < 300

    _bounded(load, seconds=5.0)


def test_every_message_is_bounded(base: Path, tmp_path: Path) -> None:
    huge = "x" * 10**6
    assert len(str(CheckpointError(huge))) <= MAX_MESSAGE
    bad = rewrite(base, tmp_path / "a.gguf", {"general.architecture": (huge, VT.STRING)})
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'xxx") as info:
        pl.load(bad)
    assert len(str(info.value)) < 400


# -- metadata of the wrong type or range --------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "kind", "message"),
    [
        ("qwen2.attention.head_count_kv", 2.7, VT.FLOAT32, "must be an integer >= 1, got 2.7"),
        ("qwen2.attention.head_count_kv", "abc", VT.STRING, "must be an integer >= 1, got 'abc'"),
        ("qwen2.attention.head_count_kv", [2, 1], VT.ARRAY, r"differs between layers \(\[2, 1\]"),
        ("qwen2.attention.head_count", -4, VT.INT32, "must be an integer >= 1, got -4"),
        ("qwen2.block_count", True, VT.BOOL, "must be an integer >= 1, got True"),
        ("qwen2.attention.layer_norm_rms_epsilon", "1e-6", VT.STRING, "must be a number"),
        ("qwen2.rope.freq_base", float("nan"), VT.FLOAT32, "must be finite"),
        ("tokenizer.ggml.bos_token_id", 2**32 - 1, VT.UINT32, "4294967295 is not a token id"),
        ("tokenizer.ggml.eos_token_id", -1, VT.INT32, "-1 is not a token id"),
        ("tokenizer.ggml.tokens", list(range(300)), VT.ARRAY, "must be a list of strings"),
        ("tokenizer.ggml.token_type", [1] * 7, VT.ARRAY, "has 7 entries for 300 tokens"),
        ("tokenizer.ggml.add_bos_token", 3, VT.UINT8, "must be a bool, got 3"),
        ("tokenizer.chat_template", 5, VT.INT32, "must be a string, got 5"),
    ],
)
def test_wrong_metadata_names_the_file_and_the_key(
    base: Path, tmp_path: Path, key: str, value: Any, kind: Any, message: str
) -> None:
    bad = rewrite(base, tmp_path / "m.gguf", {key: (value, kind)})
    with pytest.raises(CheckpointError, match=rf"m\.gguf'?: GGUF metadata {key}: {message}"):
        pl.load(bad)


def test_vocabulary_must_match_the_embedding(base: Path, tmp_path: Path) -> None:
    """50 tokens for 300 embedding rows used to load and generate ids with no text."""
    tokens = gguf.GGUFReader(base).fields["tokenizer.ggml.tokens"].contents()[:50]
    bad = rewrite(
        base,
        tmp_path / "v.gguf",
        {
            "tokenizer.ggml.tokens": (tokens, VT.ARRAY),
            "tokenizer.ggml.token_type": (None, None),
            "tokenizer.ggml.merges": (None, None),
        },
    )
    with pytest.raises(CheckpointError, match=r"has 50 tokens but token_embd\.weight has 300 rows"):
        pl.load(bad)


@pytest.mark.parametrize("shape", [(32,), (4, 8, 300)])
def test_embedding_of_the_wrong_rank(tmp_path: Path, shape: tuple[int, ...]) -> None:
    cfg = family_config("qwen2", num_hidden_layers=1)
    weights = random_weights(cfg)
    weights["model.embed_tokens.weight"] = np.ones(shape, np.float32)
    file = tmp_path / "e.gguf"
    write_gguf(file, "qwen2", cfg, weights, types={"token_embd.weight": "F32"})
    with pytest.raises(CheckpointError, match=r"e\.gguf.*token_embd\.weight has shape"):
        pl.load(file)


def test_bad_merges_and_a_bos_outside_the_alphabet(base: Path, tmp_path: Path) -> None:
    """The tokenizers library's bare Exception (merges of unknown tokens) and a KeyError of the
    tokenizer build are CheckpointErrors naming the file."""
    bad = rewrite(base, tmp_path / "t.gguf", {"tokenizer.ggml.merges": (["zzz qqq"], VT.ARRAY)})
    with pytest.raises(CheckpointError, match=r"t\.gguf.*tokenizer"):
        pl.load(bad)
    tokens = gguf.GGUFReader(base).fields["tokenizer.ggml.tokens"].contents()
    tokens[1] = "\u20ac\u20ac"  # the BOS, spelled outside the byte-level alphabet
    change = {
        "tokenizer.ggml.tokens": (tokens, VT.ARRAY),
        "tokenizer.ggml.add_bos_token": (True, VT.BOOL),
    }
    bad = rewrite(base, tmp_path / "b.gguf", change)
    with pytest.raises(CheckpointError, match=r"b\.gguf.*tokenizer"):
        pl.load(bad)


def test_text_file_named_gguf(tmp_path: Path) -> None:
    (tmp_path / "notes.gguf").write_text("hello, I am text\n" * 20)
    with pytest.raises(CheckpointError, match=r"notes\.gguf.*does not start with the GGUF magic"):
        pl.load(tmp_path / "notes.gguf")


def test_tensor_data_past_the_end(base: Path, tmp_path: Path) -> None:
    (tmp_path / "cut.gguf").write_bytes(base.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*lies past the end of the file"):
        pl.load(tmp_path / "cut.gguf")


def assert_header_as_gguf_reads_it(file: Path) -> None:
    """The one-pass header reader gives every metadata value, tensor shape, type and byte that
    the ``gguf`` package's ``GGUFReader`` gives for ``file``."""
    header = read_gguf_header(file)
    reader = gguf.GGUFReader(file)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.fields == theirs
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = header.tensors[t.name]
        assert (ours.shape, ours.kind, ours.n_elements) == (
            tuple(int(n) for n in t.shape),
            t.tensor_type.name,
            int(t.n_elements),
        )
        assert ours.data.tobytes() == np.asarray(t.data).tobytes()


def test_header_reads_as_gguf_reads_it(base: Path) -> None:
    assert_header_as_gguf_reads_it(base)


def test_big_endian_file_is_refused_by_name(base: Path, tmp_path: Path) -> None:
    data = bytearray(base.read_bytes())
    data[4:8] = struct.pack(">I", 3)  # the version as llama.cpp's --bigendian writes it
    (tmp_path / "be.gguf").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"be\.gguf.*written big-endian"):
        pl.load(tmp_path / "be.gguf")


def test_invalid_utf8_is_refused_where_it_is_read(base: Path, tmp_path: Path) -> None:
    """A metadata string that is not UTF-8 fails the load only when a reader needs it, naming
    the key; one nobody reads (``general.description``) does not stop the load."""
    for key, fails in (("tokenizer.chat_template", True), ("general.description", False)):
        marked = rewrite(base, tmp_path / "m.gguf", {key: ("@" * 16, VT.STRING)})
        data = marked.read_bytes()
        assert data.count(b"@" * 16) == 1
        bad = tmp_path / f"{key}.gguf"
        bad.write_bytes(data.replace(b"@" * 16, b"\xff\xfe" * 8))
        if fails:
            with pytest.raises(CheckpointError, match=f"{key}: cannot be read"):
                pl.load(bad)
        else:
            assert pl.load(bad).config.num_hidden_layers == 1


# -- folders --------------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    cfg = tiny_config("qwen2")
    write_checkpoint(folder, cfg)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return folder


def test_symlink_loop_is_named(folder: Path) -> None:
    (folder / "chat_template.jinja").symlink_to(folder / "chat_template.jinja")
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja' cannot be resolved"):
        pl.load(folder)


def test_nul_in_a_shard_name(folder: Path) -> None:
    with pytest.raises(CheckpointError, match="NUL character"):
        checkpoint_file(folder, "model\x00.safetensors")


def test_json_nested_too_deeply(folder: Path) -> None:
    (folder / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"generation_config\.json'?: JSON nested too deeply"):
        pl.load(folder)


@pytest.mark.parametrize("bits", [4.0, "4", True])
def test_quantization_bits_must_be_an_int(folder: Path, bits: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"bits": bits, "group_size": 64}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"quantization: bits must be one of"):
        pl.load(folder)


def test_tokenizer_regex_panic_is_a_value_error(folder: Path) -> None:
    """A pre-tokenizer regex that exceeds the regex engine's limits makes the Rust library
    panic (a BaseException that escapes ``except Exception``): a ValueError instead."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {
        "type": "Split",
        "pattern": {"Regex": "(a+)+b"},
        "behavior": "Isolated",
        "invert": False,
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = pl.load(folder).tokenizer
    assert tokenizer.encode("ab") == tokenizer.encode("ab")
    with pytest.raises(ValueError, match="encode: the tokenizer failed on this text"):
        tokenizer.encode("a" * 40_000)


def test_malformed_tokenizer_json_is_named(folder: Path) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["merges"] = [["zzz", "qqq"]]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json' is not a valid tokenizer"):
        pl.load(folder)
