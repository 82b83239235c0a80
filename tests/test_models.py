"""Checkpoints on every backend: logits against a float64 reference, cached decode, batches.

The checkpoints are written here with NumPy and ``safetensors`` alone
(:mod:`portable_llm.testing.checkpoints`): one tiny model per supported family, random weights
under HF's tensor names. The reference (:func:`portable_llm.testing.decoder.decoder_logits`)
reads the config and tensors itself and composes the float64 formulas of
:mod:`portable_llm.testing.reference`. Checkpoint errors, configs and tokenizers:
``test_models_loading.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import portable_llm as pl
from conftest import numpy_only
from portable_llm.attn.padding import left_pad
from portable_llm.models import load
from portable_llm.testing import MODEL_TOLERANCES, assert_close
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer
from portable_llm.testing.decoder import decoder_logits

FAMILIES = ["qwen2", "qwen3", "llama", "mistral", "mixtral", "qwen2_moe"]


def _all_experts(cfg: dict) -> dict:
    """The MoE config with every expert routed: no top-k choice that half precision may flip."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    return {**cfg, "num_experts_per_tok": experts} if experts else cfg


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """family -> (folder, config dict, tensors): float32 weights, with a tokenizer."""
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(family)
        cfg = tiny_config(family)
        out[family] = (folder, cfg, write_checkpoint(folder, cfg, seed=i))
        write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return out


@pytest.fixture(scope="session")
def half_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """family -> (folder, config, tensors): bfloat16 weights, MoE with every expert routed."""
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(f"{family}_bf16")
        cfg = _all_experts(tiny_config(family))
        out[family] = (folder, cfg, write_checkpoint(folder, cfg, seed=10 + i, dtype="bfloat16"))
    return out


# One full-forward length and one prompt length for every test: JAX compiles each op once per
# shape, and shared shapes keep its cache warm across tests.
L = 10
PROMPT = 4
NEW = 6


def _ids(seed: int, L: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 300, size=L)


#: float64 on JAX: the dense families without windows (the x64 path is the same code in every
#: family, and llama finds most of its programs compiled by qwen2's); the others' float64 runs,
#: each a model compiled anew, are slow there. Every family runs float32 on JAX, and float64 on
#: every other backend.
_FLOAT64_SLOW_ON_JAX = ("qwen3", "mistral", "mixtral", "qwen2_moe")


@pytest.mark.parametrize(
    ("dtype", "family"),
    [
        pytest.param(
            dtype,
            family,
            id=f"{dtype}-{family}",
            marks=[pytest.mark.slow_on("jax")]
            if dtype == "float64" and family in _FLOAT64_SLOW_ON_JAX
            else [],
        )
        for dtype in ("float32", "float64")
        for family in FAMILIES
    ],
)
def test_logits_match_reference(checkpoints: dict, family: str, backend: str, dtype: str) -> None:
    folder, cfg, tensors = checkpoints[family]
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    model = load(folder, backend=backend, dtype=dtype)
    ids = _ids(0, L)
    logits = model(pl.asarray(ids[None], backend=backend))  # (1, 9, V)
    assert_close(logits[0, ...], decoder_logits(ids, tensors, cfg), backend=backend, dtype=dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_logits(
    half_checkpoints: dict, family: str, backend: str, dtype: str
) -> None:
    folder, cfg, tensors = half_checkpoints[family]
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    model = load(folder, backend=backend, dtype=dtype)  # bfloat16 values are exact in float16
    ids = _ids(1, L)
    logits = model(pl.asarray(ids[None], backend=backend))
    tol = MODEL_TOLERANCES[dtype]
    ref = decoder_logits(ids, tensors, cfg)
    assert_close(logits[0, ...], ref, backend=backend, dtype=dtype, rtol=tol.rtol, atol=tol.atol)


def test_default_dtype_is_the_checkpoints(half_checkpoints: dict, backend: str) -> None:
    folder, _, _ = half_checkpoints["qwen2"]
    bk = pl.get_backend(backend)
    if "bfloat16" not in bk.float_dtypes():
        with pytest.raises(ValueError, match=r"bfloat16.*pass dtype="):
            load(folder, backend=backend)
        return
    model = load(folder, backend=backend)
    assert model.dtype == bk.dtypes["bfloat16"]
    assert model.embed.dtype == bk.dtypes["bfloat16"]


@pytest.mark.parametrize(
    "family",
    [
        # Slow on JAX: Qwen3 (q/k norms) and Mixtral (experts) decode through the same caches
        # as Qwen2 and Qwen2-MoE (experts and a window), which run there.
        pytest.param(f, marks=[pytest.mark.slow_on("jax")] if f in ("qwen3", "mixtral") else [])
        for f in FAMILIES
    ],
)
def test_cached_decode_equals_full_forward(checkpoints: dict, family: str, backend: str) -> None:
    """Prefill 5 tokens, decode 2 one at a time, then a chunk of 3: every step's logits equal
    those of one full causal forward (the windows of Mistral (4) and Qwen2-MoE's first layer
    (3) rotate their caches, by single tokens and by a chunk)."""
    folder, _, _ = checkpoints[family]
    model = load(folder, backend=backend, dtype="float32")
    ids = _ids(2, L)
    full = model(pl.asarray(ids[None], backend=backend))  # (1, L, V)
    cache = model.make_cache()
    start = 0
    for stop in (5, 6, 7, L):
        step = model(pl.asarray(ids[None, start:stop], backend=backend), cache=cache)
        assert_close(step, full[:, start:stop, :], err_msg=f"tokens {start}..{stop - 1}")
        start = stop
    assert cache[0].offset == L


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("family", ["mistral", "qwen2_moe"])
def test_batch_of_unequal_prompts(checkpoints: dict, family: str, backend: str) -> None:
    """Left-padded prompts of lengths 9 and 6, prefilled and decoded together, give each
    prompt's own logits (sliding windows, rotating caches and MoE routing see the padding)."""
    folder, _, _ = checkpoints[family]
    model = load(folder, backend=backend, dtype="float32")
    prompts = [_ids(3, L - 1), _ids(4, 6)]
    ids, pad = left_pad(prompts, backend=backend)  # (2, 9), (2,)
    uncached = model(ids, left_padding=pad)  # (2, 9, V)
    cache = model.make_cache(left_padding=pad)
    batch = model(ids, cache=cache)
    follow = np.array([[11], [12]])
    batch_next = model(pl.asarray(follow, backend=backend), cache=cache)  # (2, 1, V)
    for b, prompt in enumerate(prompts):
        alone = model(pl.asarray(np.append(prompt, follow[b])[None], backend=backend))
        n, P = len(prompt), L - 1
        assert_close(uncached[b, P - n :, :], alone[0, :n, :], err_msg=f"row {b}, no cache")
        assert_close(batch[b, P - n :, :], alone[0, :n, :], err_msg=f"row {b}, prefill")
        assert_close(batch_next[b, ...], alone[0, n:, :], err_msg=f"row {b}, decode")


def _greedy_reference(ids: np.ndarray, tensors: dict, cfg: dict, n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(decoder_logits(np.array(seq), tensors, cfg)[-1])))
    return seq[len(ids) :]


@pytest.mark.parametrize("family", ["mistral", "qwen2_moe"])
def test_greedy_generation_matches_reference(checkpoints: dict, family: str, backend: str) -> None:
    folder, cfg, tensors = checkpoints[family]
    model = load(folder, backend=backend, dtype="float32")
    prompt = _ids(6, PROMPT)
    got = list(pl.generate(model, prompt, max_new_tokens=NEW, stop=()))
    assert got == _greedy_reference(prompt, tensors, cfg, NEW)
    assert all(isinstance(t, int) for t in got)


def test_generate_stops_at_a_stop_token(checkpoints: dict, backend: str) -> None:
    folder, _, _ = checkpoints["mistral"]
    model = load(folder, backend=backend, dtype="float32")
    prompt = _ids(6, PROMPT)
    free = list(pl.generate(model, prompt, max_new_tokens=NEW, stop=()))
    stopped = pl.generate(model, prompt, max_new_tokens=NEW, stop=[free[3]])
    assert list(stopped) == free[: free.index(free[3])]
    assert stopped.stats.prompt_tokens == PROMPT
    assert stopped.stats.generated_tokens == free.index(free[3])
    assert stopped.stats.decode_steps == free.index(free[3])  # the stop token's step counts
    assert stopped.stats.prefill_seconds > 0


def _eos_checkpoint(
    folder: Path, checkpoint: tuple, *, config_eos: object, generation_eos: object
) -> pl.Model:
    """The checkpoint rewritten with these ``eos_token_id``s (``None``: the key left out)."""
    _, cfg, tensors = checkpoint
    cfg = {k: v for k, v in cfg.items() if k != "eos_token_id"}
    if config_eos is not None:
        cfg["eos_token_id"] = config_eos
    write_checkpoint(folder, cfg, tensors=tensors)
    generation = {} if generation_eos is None else {"eos_token_id": generation_eos}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return load(folder, dtype="float32")


def _free_run(checkpoint: tuple) -> tuple[np.ndarray, list[int], int]:
    """A prompt, its greedy continuation without stop tokens, and the index of the first new
    token that differs from the first one (a stop id there must cut the run there)."""
    model = load(checkpoint[0], dtype="float32")
    prompt = _ids(6, PROMPT)
    free = list(pl.generate(model, prompt, max_new_tokens=NEW, stop=()))
    later = next(i for i, t in enumerate(free) if t != free[0])  # StopIteration: vacuous test
    return prompt, free, later


def test_generate_stops_at_the_generation_config_eos(checkpoints: dict, tmp_path: Path) -> None:
    """``generation_config.json``'s eos_token_id wins over config.json's; without it, config's."""
    prompt, free, later = _free_run(checkpoints["mistral"])
    model = _eos_checkpoint(
        tmp_path / "both", checkpoints["mistral"], config_eos=free[0], generation_eos=free[later]
    )
    assert list(pl.generate(model, prompt, max_new_tokens=NEW)) == free[:later]
    model = _eos_checkpoint(
        tmp_path / "config", checkpoints["mistral"], config_eos=free[later], generation_eos=None
    )
    assert list(pl.generate(model, prompt, max_new_tokens=NEW)) == free[:later]
    model = _eos_checkpoint(
        tmp_path / "none", checkpoints["mistral"], config_eos=None, generation_eos=None
    )
    assert list(pl.generate(model, prompt, max_new_tokens=NEW)) == free


@pytest.mark.parametrize("where", ["generation_config", "config"])
def test_generate_stops_at_any_of_a_list_of_eos_ids(
    checkpoints: dict, tmp_path: Path, where: str
) -> None:
    prompt, free, later = _free_run(checkpoints["mistral"])
    unused = [t for t in range(300) if t not in free][:2]
    eos = [unused[0], free[later], unused[1]]  # neither the first id nor the last alone
    model = _eos_checkpoint(
        tmp_path,
        checkpoints["mistral"],
        config_eos=eos if where == "config" else None,
        generation_eos=eos if where == "generation_config" else None,
    )
    stopped = pl.generate(model, prompt, max_new_tokens=NEW)
    assert list(stopped) == free[:later]
    assert stopped.stats.generated_tokens == later


def test_sampling_is_reproducible_with_a_seed(checkpoints: dict, backend: str) -> None:
    folder, _, _ = checkpoints["mistral"]
    model = load(folder, backend=backend, dtype="float32")
    prompt = _ids(7, PROMPT)
    opts = {"max_new_tokens": NEW, "temperature": 1.5, "top_k": 50, "stop": ()}
    first = list(pl.generate(model, prompt, seed=3, **opts))
    assert list(pl.generate(model, prompt, seed=3, **opts)) == first
    draws = {tuple(pl.generate(model, prompt, seed=s, **opts)) for s in range(4, 8)}
    assert len(draws | {tuple(first)}) > 1  # a different seed gives another continuation


def test_text_prompt_streams_text(checkpoints: dict, backend: str) -> None:
    folder, _, _ = checkpoints["mistral"]
    model = load(folder, backend=backend, dtype="float32")
    assert model.tokenizer is not None
    prompt = "The keys"  # 4 tokens: the shapes of the other generation tests
    pieces = list(pl.generate(model, prompt, max_new_tokens=NEW, stop=()))
    ids = list(pl.generate(model, model.tokenizer.encode(prompt), max_new_tokens=NEW, stop=()))
    assert all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == model.tokenizer.decode(ids)


def test_generate_rejects_bad_prompts(checkpoints: dict) -> None:
    folder, _, _ = checkpoints["qwen2"]
    model = load(folder, backend="numpy", dtype="float32")
    with pytest.raises(ValueError, match="no tokens"):
        pl.generate(model, [])
    with pytest.raises(ValueError, match="1-D sequence of token ids"):
        pl.generate(model, [[1, 2], [3, 4]])
    for ragged in ([[1, 2], [3]], [1, [2, 3]], [[1], [2, [3]]]):
        with pytest.raises(ValueError, match=r"generate: prompt must be a str.*got a ragged"):
            pl.generate(model, ragged)
    for other in ([1.0, 2.0], ["a", 2], [1, None], 7, None):  # a list of str is a batch
        with pytest.raises(ValueError, match=r"generate: prompt must be a str, a 1-D sequence"):
            pl.generate(model, other)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 300\).*got -1 to 5"):
        pl.generate(model, [5, -1])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 300\).*got 1 to 300"):
        pl.generate(model, [1, 300])
    with pytest.raises(ValueError, match="max_new_tokens"):
        pl.generate(model, [1, 2], max_new_tokens=-1)
    model.tokenizer = None
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        pl.generate(model, "hello")


def test_generate_stops_with_an_error_on_nan_logits(checkpoints: dict) -> None:
    """NaN logits (here: a NaN final-norm weight) are a clear error, not a token id of -1."""
    folder, _, _ = checkpoints["qwen2"]
    model = load(folder, backend="numpy", dtype="float32")
    model.norm = np.full_like(model.norm, np.nan)
    with pytest.raises(
        ValueError, match=r"generate: the logits of step 0 \(after 2 tokens\) are NaN"
    ):
        list(pl.generate(model, [1, 2], max_new_tokens=3, stop=()))


def test_sharded_checkpoint_equals_single_file(
    checkpoints: dict, tmp_path: Path, backend: str
) -> None:
    folder, cfg, tensors = checkpoints["qwen2_moe"]
    write_checkpoint(tmp_path, cfg, tensors=tensors, shards=3)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = pl.asarray(_ids(8, L)[None], backend=backend)
    one = load(folder, backend=backend, dtype="float32")(ids)
    sharded = load(tmp_path, backend=backend, dtype="float32")(ids)
    assert_close(sharded, one, rtol=0.0, atol=0.0)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.parametrize(
    ("b", "spec"),
    [
        pytest.param("array_api_strict", "device1", id="array_api_strict-device1"),
        pytest.param(
            "torch",
            "cuda:0",
            id="torch-cuda",
            marks=pytest.mark.skipif(not _has_cuda(), reason="no CUDA GPU here"),
        ),
    ],
)
def test_load_on_a_device(checkpoints: dict, b: str, spec: str) -> None:
    """``load(device=...)``: every weight, the inputs and the logits on that device
    (array-api-strict's second device needs no GPU), with the default device's values."""
    pytest.importorskip(b)
    device = pl.get_backend(b).device(spec)
    folder, _, _ = checkpoints["qwen2_moe"]
    model = load(folder, backend=b, dtype="float32", device=spec)
    on_cpu = load(folder, backend=b, dtype="float32")
    assert model.device == device and on_cpu.device != device
    arrays = [model.embed, model.norm]
    for block in model.layers:
        arrays += [block.input_norm, block.post_norm]
        attn = vars(block.attn).values()
        arrays += [v for v in attn if isinstance(v, type(model.embed))]
        assert block.moe is not None
        arrays += [*block.moe.arrays, *block.moe.shared]
        arrays.append(block.moe.shared_gate)
    assert len(arrays) > 20 and all(pl.device_of(a) == device for a in arrays)
    ids = _ids(8, L)[None]
    for given in (ids, pl.asarray(ids, backend=b)):  # a host array, a CPU array: moved
        assert_close(model(given), on_cpu(ids), device=device)
    prompt = _ids(6, PROMPT)
    assert list(pl.generate(model, prompt, max_new_tokens=NEW, stop=())) == list(
        pl.generate(on_cpu, prompt, max_new_tokens=NEW, stop=())
    )


def test_load_on_a_device_the_backend_lacks(checkpoints: dict) -> None:
    folder, _, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match=r"load: backend 'numpy' has no device 'gpu'"):
        load(folder, device="gpu")
    assert load(folder, device="cpu").device == "cpu"


# -- caches the model makes, and arguments checked before any forward --------------------------


def test_make_cache_asks_for_fixed_size_views_where_shapes_compile(
    checkpoints: dict, backend: str
) -> None:
    """``KVCache()`` returns exactly ``offset`` keys on every backend; the model asks for the
    fixed-size views on a backend that compiles per shape (JAX) and where it has a compiled
    decode step (MLX), and its decode is still the full forward there
    (``test_cached_decode_equals_full_forward``)."""
    folder, _, _ = checkpoints["qwen2"]
    model = load(folder, backend=backend, dtype="float32")
    assert pl.get_backend(backend).static_shapes is (backend == "jax")
    static = backend in ("jax", "mlx")
    assert (model.compiled is not None) is static
    caches = model.make_cache(step=8)
    assert caches and all(isinstance(c, pl.KVCache) for c in caches)
    assert all(c.static_shapes is static for c in caches)
    model(pl.asarray(_ids(2, PROMPT)[None], backend=backend), cache=caches)
    assert caches[0].offset == PROMPT


def test_model_refuses_left_padding_out_of_range(checkpoints: dict, backend: str) -> None:
    """A pad count < 0 shifted RoPE's positions, one > L gave a row of zeros: both refused."""
    folder, _, _ = checkpoints["qwen2"]
    model = load(folder, backend=backend, dtype="float32")
    ids = pl.asarray(np.stack([_ids(3, 5), _ids(4, 5)]), backend=backend)  # (2, 5)
    for pad, bad in (([-2, 0], "left_padding\\[0\\] .* >= 0 and <= 5, got -2"),
                     ([0, 9], "left_padding\\[1\\] .* >= 0 and <= 5, got 9")):  # fmt: skip
        for given in (pad, np.array(pad), pl.asarray(np.array(pad), backend=backend)):
            with pytest.raises(ValueError, match=f"model: {bad}"):
                model(ids, left_padding=given)
    with pytest.raises(ValueError, match=r"left_padding must be an integer array of shape \(B,\)"):
        model(ids, left_padding=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"shape \(B,\) = \(2,\) .* got int64 with shape \(3,\)"):
        model(ids, left_padding=np.array([0, 1, 2]))
    listed = model(ids, left_padding=[np.int64(0), 2])
    assert_close(listed, model(ids, left_padding=pl.asarray(np.array([0, 2]), backend=backend)))


BAD_GENERATE_ARGUMENTS = [
    ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be >= 0"),
    ({"max_new_tokens": 4.0}, TypeError, "max_new_tokens must be an int"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens must be an int"),
    ({"temperature": -0.5}, ValueError, "temperature must be"),
    ({"temperature": float("nan")}, ValueError, "temperature must be"),
    ({"temperature": "hot"}, TypeError, "temperature must be a real number"),
    ({"top_k": 0}, ValueError, "top_k must be >= 1 and <= 300"),
    ({"top_k": 301}, ValueError, "top_k must be >= 1 and <= 300"),
    ({"top_k": 2.5}, TypeError, "top_k must be an int"),
    ({"top_p": 0.0}, ValueError, "top_p must be"),
    ({"top_p": 1.5}, ValueError, "top_p must be"),
    ({"min_p": -0.1}, ValueError, "min_p must be"),
    ({"min_p": "0.1"}, TypeError, "min_p must be a real number"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"stop": "ab"}, TypeError, "stop must be an iterable of token ids"),
    ({"stop": 5}, TypeError, "stop must be an iterable of token ids"),
    ({"stop": [1, 2.5]}, TypeError, r"stop\[1\] must be an int"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    BAD_GENERATE_ARGUMENTS,
    ids=[f"{next(iter(k))}={next(iter(k.values()))!r}" for k, _, _ in BAD_GENERATE_ARGUMENTS],
)
def test_generate_checks_its_arguments_before_the_prefill(
    checkpoints: dict, monkeypatch: pytest.MonkeyPatch, kwargs: dict, error: type, match: str
) -> None:
    """A bad argument raises when ``generate`` is called, before the model runs once (it used
    to surface from ``sample`` after the prefill, or never for an unused seed)."""
    folder, _, _ = checkpoints["qwen2"]
    model = load(folder, dtype="float32")
    calls = []
    forward = pl.Model.__call__
    monkeypatch.setattr(pl.Model, "__call__", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    with pytest.raises(error, match=f"generate: {match}"):
        pl.generate(model, [1, 2, 3], **{"temperature": 1.0, **kwargs})
    assert calls == []
    list(pl.generate(model, [1, 2, 3], max_new_tokens=1))  # the stub counts real calls
    assert calls == [1]


def test_generate_accepts_numpy_integers(checkpoints: dict, backend: str) -> None:
    folder, _, _ = checkpoints["qwen2"]
    model = load(folder, dtype="float32")
    prompt = _ids(6, PROMPT)
    opts = {"temperature": 1.0, "top_k": 5}
    free = list(pl.generate(model, prompt, max_new_tokens=NEW, seed=3, stop=(), **opts))
    as_numpy = pl.generate(
        model, prompt, max_new_tokens=np.int64(NEW), seed=np.int64(3), stop=[np.int64(free[2])],
        temperature=np.float32(1.0), top_k=np.int32(5),
    )  # fmt: skip
    assert list(as_numpy) == free[: free.index(free[2])]
    stops = pl.asarray(np.array([free[2], free[4]]), backend=backend)  # an array of stop ids
    with_array = pl.generate(model, prompt, max_new_tokens=NEW, seed=3, stop=stops, **opts)
    assert list(with_array) == free[: min(free.index(free[2]), free.index(free[4]))]
    with pytest.raises(TypeError, match=r"generate: stop\[0\] must be an int"):
        pl.generate(model, prompt, stop=pl.asarray(np.array([1.0]), backend=backend))


@numpy_only
def test_model_bench_on_a_checkpoint_folder(checkpoints: dict) -> None:
    """``bench --model PATH``: any checkpoint folder, one row per engine with positive speeds
    and the machine's load average; a folder without config.json is a usage error."""
    import io

    from portable_llm.cli.cli import main
    from portable_llm.cli.model_bench import run_model_bench
    from portable_llm.cli.report import UsageError

    folder, _, _ = checkpoints["llama"]
    out = io.StringIO()
    assert run_model_bench(["numpy"], quick=True, folder=folder, file=out) == 0
    text = out.getvalue()
    assert f"checkpoint: {folder}" in text and "load avg" in text
    row = next(line.split() for line in text.splitlines() if line.startswith("portable"))
    assert row[:3] == ["portable_llm", "numpy", "float32"]
    assert float(row[5]) > 0 and float(row[6]) > 0 and float(row[-1]) >= 0
    with pytest.raises(UsageError, match=r"--model: no such file or folder"):
        run_model_bench(["numpy"], quick=True, folder=folder / "nowhere", file=out)
    with pytest.raises(SystemExit):  # the CLI turns the usage error into exit 2
        main(["bench", "--model", str(folder / "nowhere"), "--backend", "numpy", "--quick"])
