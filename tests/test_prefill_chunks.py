"""Chunked prefill (``prefill_step_size=`` of generate_step and generate).

The prompt goes into the caches in chunks; the first step's log-probabilities are checked
against the float64 NumPy forward of the whole prompt
(:func:`portable_llm.testing.decoder.decoder_logits`), on every backend, with chunks shorter and
longer than the sliding windows of Mistral (window 4: every layer a ``RotatingKVCache``) and
Qwen2-MoE (a window-3 layer beside a full one), with left-padded batches, with a prompt cache,
and on JAX's fixed-size caches. The peak memory of a long prompt is measured with
``tracemalloc`` on NumPy (whose arrays report their buffers to it).
"""

from __future__ import annotations

import tracemalloc
from itertools import islice

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.models import load
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from portable_llm.testing.decoder import decoder_logits

FAMILIES = ["mistral", "qwen2_moe"]
CHUNKS = [1, 3, 5, None]  # 3 < window 4 < 5; None: one chunk
L = 11


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(f"chunks_{family}")
        cfg = tiny_config(family)
        out[family] = (folder, cfg, write_checkpoint(folder, cfg, seed=40 + i))
    return out


def _ids(seed: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 300, size=n)]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_the_float64_forward(
    folders: dict, backend: str, family: str, chunk: int | None
) -> None:
    folder, cfg, tensors = folders[family]
    model = load(folder, backend=backend, dtype="float32")
    prompt = _ids(1, L)
    steps = pl.generate_step(model, prompt, prefill_step_size=chunk)
    tokens, logprobs = [], []
    for token, lp in islice(steps, 3):
        tokens.append(token)
        logprobs.append(lp)
    seq = list(prompt)
    for step in range(3):  # the decode steps after a chunked prefill too
        want = _log_softmax(decoder_logits(np.array(seq), tensors, cfg)[-1])
        assert_close(logprobs[step], want, backend=backend, dtype="float32")
        assert tokens[step] == int(np.argmax(want))
        seq.append(tokens[step])


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("chunk", [2, 5])
def test_chunked_prefill_of_a_left_padded_batch(folders: dict, backend: str, chunk: int) -> None:
    folder, cfg, tensors = folders["mistral"]
    model = load(folder, backend=backend, dtype="float32")
    rows = [_ids(2, 3), _ids(3, 9), _ids(4, 6)]
    ids, left_padding = pl.left_pad(rows)
    steps = pl.generate_step(model, ids, left_padding=left_padding, prefill_step_size=chunk)
    _, logprobs = next(steps)
    for b, row in enumerate(rows):
        want = _log_softmax(decoder_logits(np.array(row), tensors, cfg)[-1])
        assert_close(logprobs[b, ...], want, backend=backend, dtype="float32")


@pytest.mark.slow_on("jax")
def test_chunked_prefill_after_a_prompt_cache(folders: dict, backend: str) -> None:
    folder, cfg, tensors = folders["qwen2_moe"]
    model = load(folder, backend=backend, dtype="float32")
    first, second = _ids(5, 4), _ids(6, 7)
    cache = model.make_cache()
    turn = pl.generate(model, first, max_new_tokens=2, stop=(), prompt_cache=cache)
    said = list(turn)
    steps = pl.generate_step(model, second, cache=cache, prefill_step_size=3)
    _, logprobs = next(steps)
    want = _log_softmax(decoder_logits(np.array(first + said + second), tensors, cfg)[-1])
    assert_close(logprobs, want, backend=backend, dtype="float32")


def test_generate_with_chunks_equals_one_chunk(folders: dict, backend: str) -> None:
    folder, _, _ = folders["mistral"]
    model = load(folder, backend=backend, dtype="float32")
    prompt = _ids(7, 10)
    one = list(pl.generate(model, prompt, max_new_tokens=4, stop=(), prefill_step_size=None))
    chunked = list(pl.generate(model, prompt, max_new_tokens=4, stop=(), prefill_step_size=3))
    assert chunked == one


def _peak_bytes(model: pl.Model, prompt: list[int], chunk: int | None) -> int:
    tracemalloc.start()
    try:
        next(pl.generate_step(model, prompt, prefill_step_size=chunk))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_peak_memory_is_bounded_by_the_chunk(tmp_path) -> None:
    """NumPy: a 1024-token prompt in chunks of 16 peaks far below one chunk, whose attention
    scores are ``(B, H, L, S)`` = 4 * 1024 * 1024 float32 (16 MiB) where a chunk's are
    ``4 * 16 * 1024`` (256 KiB); the caches of both hold the same 1024 keys (256 KiB)."""
    cfg = tiny_config("qwen2", max_position_embeddings=2048)
    write_checkpoint(tmp_path, cfg, seed=9)
    model = load(tmp_path, dtype="float32")
    prompt = _ids(8, 1024)
    one = _peak_bytes(model, prompt, None)
    chunked = _peak_bytes(model, prompt, 16)
    assert chunked * 8 < one, (chunked, one)
    assert one > 4 * 1024 * 1024  # the one-chunk prefill does hold quadratic scores


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_prefill_step_size_is_refused_before_running(folders: dict, bad: object) -> None:
    folder, _, _ = folders["mistral"]
    model = load(folder, dtype="float32")
    error = TypeError if isinstance(bad, float | bool) else ValueError
    with pytest.raises(error, match="prefill_step_size"):
        pl.generate(model, [5, 6, 7], prefill_step_size=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="prefill_step_size"):
        pl.generate_step(model, [5, 6, 7], prefill_step_size=bad)  # type: ignore[arg-type]


def test_cli_prefill_step_size(folders: dict, capsys: pytest.CaptureFixture) -> None:
    from portable_llm.cli.cli import main

    folder, _, _ = folders["mistral"]
    prompt = _ids(10, 9)
    want = list(pl.generate(load(folder), prompt, max_new_tokens=5, prefill_step_size=None))
    ids = ",".join(map(str, prompt))
    args = ["generate", str(folder), "--ids", ids, "--max-new-tokens", "5"]
    assert main([*args, "--prefill-step-size", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ",".join(map(str, want))
    with pytest.raises(SystemExit) as exc:  # a usage error, in the flag's words
        main([*args, "--prefill-step-size", "0"])
    assert exc.value.code == 2
    assert "--prefill-step-size: expected an integer >= 1" in capsys.readouterr().err
