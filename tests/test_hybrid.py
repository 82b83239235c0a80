"""The infrastructure of hybrid models (a layer whose token mixer is not attention, issue 31):
``Layer.mixer`` run by the one forward, ``HybridCache``, ``run_mixer``'s kept states,
``make_cache`` per layer kind, speculative decoding's rewinds of recurrent states, paged
continuous batching with the states in per-request slots, the compiled step (JAX, MLX) with
the states as its arguments, the partition refusal.

The model is a tiny LFM2 (short convolution layers beside attention layers) written with NumPy
alone; its logits against transformers are ``tests/test_oracle_families.py``'s.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.caches.hybrid import HybridCache, attention_cache, recurrent_cache
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.families.lfm2 import ShortConv
from portable_llm.decoder.mixer import run_mixer
from portable_llm.ops.checked_kernels import CheckedKernels
from portable_llm.ops.kernels import MODEL_LINEAR
from portable_llm.testing import assert_close, random_array

CONFIG: dict[str, Any] = {
    "model_type": "lfm2", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 72,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "layer_types": ["conv", "full_attention", "conv"],
    "conv_L_cache": 3, "conv_bias": True, "block_multiple_of": 16, "norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
IDS = np.random.default_rng(3).integers(3, 300, size=(2, 9))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("lfm2"), seed=0)


def _write(path: Path, seed: int) -> Path:
    """A random LFM2 checkpoint under the decoder's names (NumPy and safetensors only)."""
    from safetensors.numpy import save_file

    from portable_llm.checkpoint.weights import expected_shapes

    rng = np.random.default_rng(seed)
    shapes = expected_shapes(DecoderConfig.from_dict(CONFIG))
    tensors = {
        name: (rng.uniform(0.8, 1.2, shape) if name.endswith("norm.weight")
               else rng.standard_normal(shape) * 0.2).astype(np.float32)
        for name, shape in shapes.items()
    }  # fmt: skip
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def _slow(model: Any) -> Any:
    """The op-by-op forward of ``model``."""
    slow = copy.copy(model)
    slow.prepared, slow.compiled = None, None
    return slow


def test_layers_and_caches_by_kind(folder: Path) -> None:
    """Conv layers hold a mixer and no attention; make_cache gives them a RecurrentCache and
    the attention layer a KVCache; the checkpoint holds no attention tensors on conv layers."""
    model = pl.load(folder, backend="numpy", dtype="float32")
    kinds = [(layer.attn is None, type(layer.mixer)) for layer in model.layers]
    assert kinds == [(True, ShortConv), (False, type(None)), (True, ShortConv)]
    caches = model.make_cache()
    assert [type(c) for c in caches] == [pl.RecurrentCache, pl.KVCache, pl.RecurrentCache]
    assert model.recurrent and model.paged  # its conv states in slots (make_state_slots)
    pools = model.make_page_pools(4, 8)
    assert [(p.num_kv_heads, p.head_dim) for p in pools] == [(1, 1), (2, 8), (1, 1)]
    slots = model.make_state_slots(2)
    assert [None if s is None else s.num_slots for s in slots] == [2, None, 2]


@pytest.mark.slow_on("jax", "array_api_strict")  # a decode token by token: seconds there
def test_cached_decode_and_padding_equal_the_full_forward(folder: Path, backend: str) -> None:
    """A prompt of 4, then one token at a time, equals the full forward (the prepared forward,
    its decode steps compiled on JAX and MLX, and the op-by-op forward); each row of a
    left-padded batch equals the row alone (the conv zeroes the pad tokens' inputs: without it,
    the pads' projections would enter its state)."""
    model = pl.load(folder, backend=backend, dtype="float32")
    compiles = backend in ("jax", "mlx")  # the conv states: arguments and results of the step
    assert (model.compiled is not None) == compiles
    want = pl.to_numpy(model(pl.asarray(IDS, backend=backend)))
    for m in (model, _slow(model)):
        cache = m.make_cache()
        parts = [pl.to_numpy(m(pl.asarray(IDS[:, :4], backend=backend), cache=cache))]
        for j in range(4, IDS.shape[1]):
            parts.append(pl.to_numpy(m(pl.asarray(IDS[:, j : j + 1], backend=backend),
                                       cache=cache)))  # fmt: skip
        assert_close(np.concatenate(parts, axis=1), want, backend="numpy")
        if compiles and m is model:
            assert model.compiled is not None and model.compiled.traces >= 1
        short = IDS[1, :6]
        batch = np.stack([IDS[0, :9], np.concatenate([[0, 0, 0], short])])
        pad = pl.asarray(np.array([0, 3]), backend=backend)
        got = pl.to_numpy(m(pl.asarray(batch, backend=backend), left_padding=pad))
        alone = pl.to_numpy(m(pl.asarray(short[None], backend=backend)))
        assert_close(got[1:, 3:], alone, backend="numpy")


def test_compiled_step_takes_the_recurrent_states(folder: Path, backend: str) -> None:
    """JAX and MLX compile a hybrid model's decode step: one program for every token (the conv
    states are its arguments, of fixed shapes), equal to the eager prepared forward, the
    states it leaves in the caches equal to the eager step's."""
    if backend not in ("jax", "mlx"):
        pytest.skip(f"{backend}: the decode step runs eagerly (no compiled step)")
    model = pl.load(folder, backend=backend, dtype="float32")
    assert model.compiled is not None
    eager = copy.copy(model)
    eager.compiled = None
    caches = [model.make_cache(), eager.make_cache()]
    for m, c in zip((model, eager), caches, strict=True):
        m(pl.asarray(IDS[:, :4], backend=backend), cache=c)
    for j in range(4, 7):
        step = [pl.to_numpy(m(pl.asarray(IDS[:, j : j + 1], backend=backend), cache=c))
                for m, c in zip((model, eager), caches, strict=True)]  # fmt: skip
        assert_close(step[0], step[1], backend="numpy")
    assert model.compiled.traces == 1
    assert_close(caches[0][0].state[0], caches[1][0].state[0], backend=backend)
    assert caches[0][0].offset == caches[1][0].offset == 7


def test_padded_prefill_into_caches_then_decode(folder: Path) -> None:
    """Left padding given to make_cache reaches the RecurrentCache: the padded row's decode
    after its prefill equals the row alone."""
    model = pl.load(folder, backend="numpy", dtype="float32")
    short = IDS[1, :5]
    batch = np.stack([IDS[0, :7], np.concatenate([[0, 0], short])])
    cache = model.make_cache(left_padding=np.array([0, 2]))
    assert recurrent_cache(cache[0]).left_padding is not None
    model(batch, cache=cache)
    step = model(np.array([[5], [7]]), cache=cache)[1:, -1]
    alone = model(np.concatenate([short, [7]])[None])[:, -1]
    assert_close(step, alone)


def test_speculative_rewinds_recurrent_states(folder: Path, tmp_path: Path) -> None:
    """Speculative decoding gives the plain greedy tokens. The draft is another random LFM2,
    so proposals are rejected and both models' recurrent states are rewound from the states
    kept for it (max_rewind set to the draft length: without it, the first rejection's trim is
    a ValueError)."""
    model = pl.load(folder, backend="numpy", dtype="float32")
    draft = pl.load(_write(tmp_path, seed=1), backend="numpy", dtype="float32")
    want = list(pl.generate(model, IDS[0, :6], max_new_tokens=10, stop=()))
    for k in (1, 3):
        spec = pl.speculative_generate(model, draft, IDS[0, :6], num_draft_tokens=k,
                                       max_new_tokens=10, stop=())  # fmt: skip
        assert list(spec) == want
        assert spec.stats.accepted_tokens < spec.stats.draft_tokens  # some were rewound


@pytest.mark.slow_on("jax", "array_api_strict")
def test_paged_batches_equal_greedy(folder: Path, backend: str) -> None:
    """Continuous batching over pages: the conv layers' states in per-request slots
    (RecurrentSlots), rows joining and leaving (max_batch below the requests), prompts
    prefilled in chunks of 4 across steps; each request's tokens are its greedy ones alone.
    A request of n = 3 is prefilled once and its siblings start from a copy of its states."""
    from portable_llm.generation.batch import BatchGenerator, Request

    model = pl.load(folder, backend=backend, dtype="float32")
    prompts = [IDS[0, :7], IDS[1, :5], IDS[0, 2:9], IDS[1, :3]]
    want = [list(pl.generate(model, p, max_new_tokens=6, stop=())) for p in prompts]
    got = pl.batch_generate(model, prompts, max_new_tokens=6, stop=(), max_batch=2,
                            prefill_chunk=4)  # fmt: skip
    assert [list(g) for g in got] == want
    gen = BatchGenerator(model, max_batch=2, page_size=4, prefix_cache=True)
    assert gen.state_slots is not None and gen.prefix_cache is None  # no states in pages
    rid = gen.add(Request([int(t) for t in prompts[0]], 6, stop=(), n=3))
    tokens: dict[int, list[int]] = {}
    while gen.has_work:
        for r, token, _ in gen.step():
            tokens.setdefault(r, []).append(token)
    assert [tokens[rid + i] for i in range(3)] == [want[0]] * 3
    assert all(s is None or s.num_free == s.num_slots for s in gen.state_slots)  # released


def test_forward_paged_needs_the_rows_slots(folder: Path) -> None:
    """forward_paged refuses a hybrid model's rows without their slots, and a model that does
    not page (Model.paged false: here the op-by-op forward) by name; BatchGenerator runs such
    a model request by request over make_cache(), with the greedy tokens."""
    model = pl.load(folder, backend="numpy", dtype="float32")
    caches = [[pl.PagedKVCache(p) for p in model.make_page_pools(4, 4)]]
    with pytest.raises(ValueError, match=r"need state_slots .* and slot_ids"):
        model.forward_paged([[3, 4]], caches=caches)
    slow = _slow(model)
    assert not slow.paged  # the op-by-op forward runs rows alone: over make_cache()
    with pytest.raises(ValueError, match="keep their state in no page"):
        slow.forward_paged([[3, 4]], caches=caches)
    from portable_llm.generation.batch import BatchGenerator

    assert BatchGenerator(slow).pools == []  # no pages: request by request, same tokens
    prompts = [IDS[0, :5], IDS[1, :3]]
    want = [list(pl.generate(model, p, max_new_tokens=4, stop=())) for p in prompts]
    assert [list(g) for g in pl.batch_generate(slow, prompts, max_new_tokens=4, stop=())] == want


def test_trace_lists_the_conv_kernel(folder: Path) -> None:
    """The mixer runs through the ops' bodies: inside a trace, the dispatcher's choice of
    short_conv is recorded, as for every other kernel of the forward."""
    model = pl.load(folder, backend="numpy", dtype="float32")
    with pl.trace() as entries:
        model(IDS)
    assert "short_conv" in {e.op for e in entries}


def test_tensor_parallel_is_refused() -> None:
    from portable_llm.partition.plan import plan_partition

    cfg = DecoderConfig.from_dict(CONFIG)
    with pytest.raises(ValueError, match=r"recurrent layers .* use tensor_parallel=1"):
        plan_partition(cfg, tp=(2, 0))
    assert plan_partition(cfg, pp=(3, 1)).layers == range(1, 2)


def _conv_mixer(seed: int) -> ShortConv:
    E = 8
    a = [random_array(seed + j, s, "float32")[0] for j, s in
         enumerate([(3 * E, E), (E, 3), (E, E), (E,)])]  # fmt: skip
    return ShortConv(in_proj=a[0], conv=a[1], out_proj=a[2], conv_bias=a[3])


@pytest.mark.parametrize("max_rewind", [0, 2, 6, 9])
def test_run_mixer_keeps_the_states_a_rewind_needs(max_rewind: int) -> None:
    """run_mixer over a cache equals the stateless run; with ``max_rewind`` it keeps the states
    of the last ``min(L, max_rewind)`` tokens (a longer chunk runs in two calls), so a trim of
    as many tokens restores the state of the shorter prefix (the convolution's inputs, as the
    projection of the prefix gives them: equal within float32's tolerance, the BLAS products of
    another row count may round otherwise)."""
    mixer, xp = _conv_mixer(0), np
    kn = CheckedKernels(pl.get_backend("numpy"), "silu", MODEL_LINEAR)
    x = random_array(9, (2, 6, 8), "float32")[0]
    want = run_mixer(mixer, xp, kn, x, None, None)
    cache = pl.RecurrentCache(max_rewind=max_rewind)
    assert_close(run_mixer(mixer, xp, kn, x, cache, None), want)
    assert cache.offset == 6
    for n in range(1, min(max_rewind, 6) + 1):
        c = copy.deepcopy(cache)
        c.trim(n)
        if n == 6:  # back to the start: no state yet
            assert c.state is None and c.offset == 0
            continue
        prefix = pl.RecurrentCache()
        run_mixer(mixer, xp, kn, x[:, : 6 - n], prefix, None)
        assert_close(c.state[0], prefix.state[0])
    if max_rewind < 6:
        with pytest.raises(ValueError, match="no state kept"):
            cache.trim(max_rewind + 1)


def test_hybrid_cache_moves_both_parts() -> None:
    """HybridCache: one offset, a trim of both, a refused trim (no kept state) changes
    neither; attention_cache and recurrent_cache pick the parts."""
    kv, state = pl.KVCache(), pl.RecurrentCache(max_rewind=2)
    c = HybridCache(kv, state)
    k = np.zeros((1, 2, 5, 4), np.float32)
    kv.update_and_fetch(k, k)
    state.update(np.zeros((1, 5, 3, 4), np.float32), all_states=True)
    assert c.offset == 5 and attention_cache(c) is kv and recurrent_cache(c) is state
    assert attention_cache(state) is None and recurrent_cache(kv) is None
    with pytest.raises(ValueError, match="no state kept"):
        c.trim(3)
    assert (kv.offset, state.offset) == (5, 5)
    assert c.trim(2) == 2 and (kv.offset, state.offset) == (3, 3)
    with pytest.raises(TypeError, match="recurrent must be a RecurrentCache"):
        HybridCache(kv, kv)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="attention must be a KV cache"):
        HybridCache(state, state)


def test_layer_needs_a_token_mixer(folder: Path) -> None:
    model = pl.load(folder, backend="numpy", dtype="float32")
    layer = model.layers[0]
    with pytest.raises(ValueError, match="a layer needs a token mixer"):
        replace(layer, mixer=None)
    with pytest.raises(TypeError, match="mixer must be a RecurrentMixer"):
        replace(layer, mixer=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="left_padding must be a 1-d array"):
        pl.RecurrentCache(left_padding=np.array([[1]]))


def test_slots_grow_copy_and_rows() -> None:
    """RecurrentSlots.grow keeps the states and adds zeroed free slots; copy gives a slot
    another's state; rows() reads and writes a batch's rows (one state each: no all_states)."""
    slots = pl.RecurrentSlots(1, [(2, 3)])
    a = slots.allocate()
    state = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    slots.scatter([a], state)
    slots.grow(3)
    assert (slots.num_slots, slots.num_free) == (3, 2)
    b = slots.allocate()
    slots.copy(a, b)
    rows = slots.rows([b, a])
    np.testing.assert_array_equal(rows.state[0], np.concatenate([state, state]))
    rows.update(np.zeros((2, 2, 3), np.float32) + 7)
    np.testing.assert_array_equal(slots.gather([a])[0], np.full((1, 2, 3), 7, np.float32))
    with pytest.raises(ValueError, match="not all_states"):
        rows.update(np.zeros((2, 1, 2, 3), np.float32), all_states=True)
    with pytest.raises(ValueError, match="num_slots must be >= 3"):
        slots.grow(2)
