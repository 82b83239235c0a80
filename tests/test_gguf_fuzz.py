"""A property-based fuzz test of the GGUF reader: a valid small file written with
``gguf.GGUFWriter``, then truncated, its bytes flipped, its counts, lengths, types and offsets
inflated. Whatever Hypothesis does to it, ``pl.load`` gives a model or a ``CheckpointError``
naming the file, within a time bound and a memory bound (tracemalloc)."""

from __future__ import annotations

import os
import struct
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.models import CheckpointError, Model

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
from test_gguf import family_config, gguf_tokenizer_meta, random_weights, write_gguf  # noqa: E402

SECONDS = 10.0  # per load; a valid load of this file takes ~0.05 s
MIB = 256  # traced per load; the file is ~100 KB
EXTREMES = [0, 1, 2**8 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """The bytes of a valid 1-layer qwen2 GGUF (tokenizer, chat template, Q8_0 and F32
    tensors) and where its tensor data starts (the header before it is where counts live)."""
    folder = tmp_path_factory.mktemp("fuzz")
    cfg = family_config("qwen2", num_hidden_layers=1, vocab_size=300)
    file = folder / "valid.gguf"
    write_gguf(file, "qwen2", cfg, random_weights(cfg), tok=gguf_tokenizer_meta(folder / "tok"))
    assert isinstance(pl.load(file), Model)
    return file.read_bytes(), int(gguf.GGUFReader(file).data_offset)


#: A mutation: (kind, where, argument); ``apply`` performs them in order.
Mutation = tuple[str, int, int | bytes]


@st.composite
def mutations(draw: st.DrawFn, size: int, header: int) -> list[Mutation]:
    """One to three mutations; three draws in four land in the header, where every count,
    length, type and offset lives."""
    out: list[Mutation] = []
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, (header if draw(st.integers(0, 3)) else size) - 1))
        kind = draw(st.sampled_from(["truncate", "flip", "u32", "u64", "insert", "delete"]))
        arg: int | bytes = 0
        if kind == "flip":
            arg = draw(st.integers(1, 255))
        elif kind in ("u32", "u64"):
            bits = 32 if kind == "u32" else 64
            arg = draw(st.sampled_from(EXTREMES) | st.integers(0, 2**bits - 1)) % 2**bits
        elif kind == "insert":
            arg = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            arg = draw(st.integers(1, 16))
        out.append((kind, at, arg))
    return out


def apply(data: bytes, steps: list[Mutation]) -> bytes:
    out = bytearray(data)
    for kind, at, arg in steps:
        at = min(at, len(out))
        if kind == "truncate":
            del out[at:]
        elif kind == "flip" and at < len(out):
            out[at] ^= int(arg)  # type: ignore[arg-type]
        elif kind in ("u32", "u64"):
            n = 4 if kind == "u32" else 8
            out[at : at + n] = struct.pack("<Q", arg)[:n]
        elif kind == "insert":
            out[at:at] = arg  # type: ignore[assignment]
        elif kind == "delete":
            del out[at : at + int(arg)]  # type: ignore[arg-type]
    return bytes(out)


def test_fuzzed_gguf_is_a_model_or_a_checkpoint_error(
    valid: tuple[bytes, int], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("fuzzed")
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=int(os.environ.get("PL_FUZZ_EXAMPLES", "150")),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(steps=mutations(len(valid[0]), valid[1]))
    def check(steps: list[Mutation]) -> None:
        file = folder / "fuzzed.gguf"
        file.write_bytes(apply(valid[0], steps))
        tracemalloc.start()
        start = time.perf_counter()
        try:
            model = pl.load(file)
            outcome = "model"
            assert isinstance(model, Model)
            del model
        except CheckpointError as exc:
            outcome = "refused"
            assert "fuzzed.gguf" in str(exc), str(exc)
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert time.perf_counter() - start < SECONDS
        assert peak < MIB * 2**20, f"{peak / 2**20:.0f} MiB traced"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    check()
    assert outcomes.get("refused", 0) > 0, outcomes  # the mutations do reach the checks
