"""The prepared forward (models/prepared.py) equals the op-by-op path of the public ops.

The op-by-op path is the same model with ``prepared=None`` (``Model(..., prepared=False)``):
each layer then composes the public ops, each validating its arguments. Both paths hand the same
arrays and options to the same kernels, so their logits are equal bit for bit; the float64
reference checks of ``test_models.py`` cover the values.
"""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

import portable_llm as pl
from conftest import only_on
from portable_llm.attn.padding import left_pad
from portable_llm.core.dispatch import dispatcher
from portable_llm.decoder.prepared import Packed, Prepared, QLinear
from portable_llm.models import load
from portable_llm.testing import assert_close
from portable_llm.testing.checkpoints import quantized_weights, tiny_config, write_checkpoint

FAMILIES = ["qwen2", "qwen3", "llama", "mistral", "mixtral", "qwen2_moe"]
L = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(f"prep_{family}")
        write_checkpoint(folder, tiny_config(family), seed=20 + i)
        out[family] = folder
    return out


def _op_by_op(model: pl.Model) -> pl.Model:
    slow = copy.copy(model)
    slow.prepared = None
    return slow


def _ids(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 300, size=n)


def _same(a: object, b: object, msg: str = "") -> None:
    np.testing.assert_array_equal(pl.to_numpy(a), pl.to_numpy(b), err_msg=msg)


def _loaded(folders: dict, family: str, backend: str, dtype: str) -> pl.Model:
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    model = load(folders[family], backend=backend, dtype=dtype)
    assert isinstance(model.prepared, Prepared)
    return model


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepared_forward_equals_op_by_op(
    folders: dict, family: str, backend: str, dtype: str
) -> None:
    model = _loaded(folders, family, backend, dtype)
    ids = pl.asarray(_ids(0, L)[None], backend=backend)
    _same(model(ids), _op_by_op(model)(ids))


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepared_cached_decode_equals_op_by_op(
    folders: dict, family: str, backend: str, dtype: str
) -> None:
    """Prefill, single tokens and a chunk, with the caches' masks (rotating windows included):
    each step equal to the op-by-op path's step on caches of its own (the eager prepared
    step: JAX's compiled step is checked against it below). In bfloat16 on torch's CPU the
    projections run packed (``pack_linear``): the same bits on one row and on many."""
    model = _eager(_loaded(folders, family, backend, dtype))
    slow = _op_by_op(model)
    ids = _ids(2, L)
    fast_cache, slow_cache = model.make_cache(), slow.make_cache()
    start = 0
    for stop in (5, 6, 7, L):
        chunk = pl.asarray(ids[None, start:stop], backend=backend)
        _same(model(chunk, cache=fast_cache), slow(chunk, cache=slow_cache), f"{start}..{stop}")
        start = stop


@only_on("torch")
def test_torch_float32_decode_takes_numpy_gemv_on_both_paths(folders: dict) -> None:
    """At one torch thread a float32 decode step's products run ``model_linear`` (NumPy's BLAS
    for one row, native/torch.py) on the prepared and the op-by-op path alike, whose logits
    stay equal bit for bit; a prefill's many rows run F.linear on both."""
    import torch

    backend = "torch"
    model = _eager(_loaded(folders, "llama", backend, "float32"))
    slow = _op_by_op(model)
    ids = _ids(5, L)
    caches = model.make_cache(), slow.make_cache()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        prompt = pl.asarray(ids[None, :-1], backend=backend)
        _same(model(prompt, cache=caches[0]), slow(prompt, cache=caches[1]), "prefill")
        step = pl.asarray(ids[None, -1:], backend=backend)
        traces = []
        for m, cache in zip((model, slow), caches, strict=True):
            with pl.trace() as t:
                traces.append(m(step, cache=cache))
            projections = [e for e in t if "linear" in e.op]
            assert projections and {e.op for e in projections} == {"model_linear"}
            assert all(e.kernel.startswith("numpy.matmul") for e in projections)
        _same(*traces, "decode")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("family", ["mistral", "qwen2_moe"])
def test_prepared_left_padded_batch_equals_op_by_op(
    folders: dict, family: str, backend: str
) -> None:
    """Left padding, uncached (the shared padding mask) and cached (the caches' masks)."""
    model = _eager(_loaded(folders, family, backend, "float32"))
    slow = _op_by_op(model)
    ids, pad = left_pad([_ids(3, L - 1), _ids(4, 6)], backend=backend)  # (2, 9), (2,)
    _same(model(ids, left_padding=pad), slow(ids, left_padding=pad), "uncached")
    caches = model.make_cache(left_padding=pad), slow.make_cache(left_padding=pad)
    _same(model(ids, cache=caches[0]), slow(ids, cache=caches[1]), "prefill")
    nxt = pl.asarray(np.array([[7], [9]]), backend=backend)
    _same(model(nxt, cache=caches[0]), slow(nxt, cache=caches[1]), "decode")


def test_projections_packed_where_the_backend_packs(folders: dict, backend: str) -> None:
    """A projection is bound :class:`Packed` exactly where the dispatcher's ``pack_linear``
    packs it (torch's CPU in bfloat16), the plain weight elsewhere; the head likewise."""
    for dtype in pl.get_backend(backend).float_dtypes():
        model = load(folders["llama"], backend=backend, dtype=dtype)
        assert model.prepared is not None
        d = dispatcher(model.backend)
        pack = d.pick("pack_linear", "auto", model.layers[0].attn.wq)
        packs = pack is not d.portable_impl("pack_linear")
        assert packs is _cpu_packs(backend, dtype), dtype
        for got in (model.prepared.layers[0].attn.wq, model.prepared.layers[1].mlp.w_down):
            assert isinstance(got, Packed) is packs, dtype
        assert isinstance(model.prepared._head, Packed) is packs


def _cpu_packs(backend: str, dtype: str) -> bool:
    """Whether torch's oneDNN packs a bfloat16 weight on this CPU, asked of torch directly (the
    query its reorder consults): the only place the dispatcher may choose ``pack_linear``."""
    if backend != "torch" or dtype != "bfloat16":
        return False
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# An AVX2-only CPU (no AVX-512 BW/VL/DQ, no AVX-NE-CONVERT) cannot pack bfloat16 weights for
# oneDNN: its reorder raises. ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN (and torch's capability
# query) see such a CPU on any x86 machine, so the fallback is tested wherever the suite runs.
_AVX2_ONLY = """
import copy
import sys

import numpy as np
import torch
import portable_llm as pl
from portable_llm.decoder.prepared import Packed
from portable_llm.native.torch import packing_supported

assert not packing_supported(torch.bfloat16), "packing claimed on an AVX2-only oneDNN"
try:
    torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 1)
except RuntimeError:
    pass
else:
    raise AssertionError("ONEDNN_MAX_CPU_ISA=AVX2 did not take: the fallback is not exercised")
model = pl.load(sys.argv[1], backend="torch", dtype="bfloat16")
layer = model.prepared.layers[0]
assert not isinstance(layer.attn.wq, Packed) and not isinstance(model.prepared._head, Packed)
ids = np.random.default_rng(1).integers(3, 300, size=(1, 7))
slow = copy.copy(model)
slow.prepared = None
got, want = model(pl.asarray(ids, backend="torch")), slow(pl.asarray(ids, backend="torch"))
np.testing.assert_array_equal(pl.to_numpy(got), pl.to_numpy(want))
print(pl.generate(model, [5, 6, 7], max_new_tokens=3))
"""


@only_on("torch")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 ISA limit")
def test_bfloat16_on_an_avx2_only_cpu_binds_plain_weights(folders: dict) -> None:
    """Where oneDNN cannot pack bfloat16 (AVX2-only x86), a bfloat16 model loads, binds plain
    weights (F.linear), and gives the op-by-op path's logits: never the reorder's raw error."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    run = subprocess.run(
        [sys.executable, "-c", _AVX2_ONLY, str(folders["llama"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_prepared_is_skipped_for_mixed_dtypes(folders: dict) -> None:
    """A weight in another dtype than the embedding: the op-by-op path (which casts it per
    call), with the same logits as a model whose weights were all cast at load."""
    from safetensors.numpy import load_file

    model = load(folders["llama"], backend="numpy", dtype="float32")
    weights = {
        k: v.astype(np.float32)
        for k, v in load_file(folders["llama"] / "model.safetensors").items()
    }
    mixed = {**weights, "model.norm.weight": weights["model.norm.weight"].astype(np.float64)}
    built = pl.Model(model.config, mixed, model.backend)
    assert built.prepared is None
    ids = _ids(5, L)[None]
    _same(built(ids), model(ids))
    assert pl.Model(model.config, weights, model.backend).prepared is not None
    assert pl.Model(model.config, weights, model.backend, prepared=False).prepared is None


# -- the compiled decode step (JAX) ------------------------------------------------------------


def _compiled(folders: dict, family: str, backend: str) -> pl.Model:
    model = _loaded(folders, family, backend, "float32")
    if model.compiled is None:
        assert not pl.get_backend(backend).static_shapes  # the backends that compile have one
        pytest.skip(f"{backend}: the decode step runs eagerly (no compiled step)")
    return model


def _eager(model: pl.Model) -> pl.Model:
    eager = copy.copy(model)
    eager.compiled = None
    return eager


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_compiled_step_equals_eager_step(folders: dict, family: str, backend: str) -> None:
    """Prefill eagerly, then 7 tokens one at a time through the compiled step, on caches that
    grow every 4 slots: each step's logits equal the eager step's (within float32's tolerance),
    the caches end as the eager ones, and the step compiles once per capacity, not per token."""
    model = _compiled(folders, family, backend)
    eager = _eager(model)
    ids = _ids(6, 12)
    fast, slow = model.make_cache(step=4), eager.make_cache(step=4)
    assert_close(model(ids[None, :5], cache=fast), eager(ids[None, :5], cache=slow))
    assert model.compiled is not None and model.compiled.traces == 0  # prefill: eager
    capacities = set()
    for t in range(5, 12):
        token = ids[None, t : t + 1]
        got = model.decode_step(token, cache=fast)
        assert_close(got, eager(token, cache=slow), err_msg=f"token {t}")
        capacities.add(fast[0].capacity)
        assert fast[0].offset == slow[0].offset == t + 1
        assert fast[0].capacity == slow[0].capacity
    assert model.compiled.traces == len(capacities) == 3  # capacities 8, 12, 16
    k_fast, _ = fast[1].update_and_fetch(*_kv(fast[1]))  # the buffers hold the eager keys
    k_slow, _ = slow[1].update_and_fetch(*_kv(slow[1]))
    assert_close(k_fast[:, :, :13], k_slow[:, :, :13])


def _kv(cache: object) -> tuple:
    k = cache._k[:, :, :1, :]  # type: ignore[attr-defined]
    return k, k


def test_compiled_step_left_padded_batch(folders: dict, backend: str) -> None:
    """A left-padded batch decoded through the compiled step equals the eager steps."""
    model = _compiled(folders, "qwen2", backend)
    eager = _eager(model)
    ids, pad = left_pad([_ids(3, L - 1), _ids(4, 6)], backend=backend)  # (2, 9), (2,)
    fast, slow = model.make_cache(left_padding=pad), eager.make_cache(left_padding=pad)
    assert_close(model(ids, cache=fast), eager(ids, cache=slow))
    for t in range(3):
        token = pl.asarray(np.array([[7 + t], [9 + t]]), backend=backend)
        assert_close(model(token, cache=fast), eager(token, cache=slow), err_msg=f"step {t}")
    assert model.compiled is not None and model.compiled.traces == 1


# -- quantized weights -------------------------------------------------------------------------

QUANT_FAMILIES = ["qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def quant_folders(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Checkpoints whose every K (E, H * D, I) is a multiple of the group size 32."""
    out = {}
    for i, family in enumerate(QUANT_FAMILIES):
        folder = tmp_path_factory.mktemp(f"prep_q_{family}")
        cfg = tiny_config(family, intermediate_size=64, tie_word_embeddings=family != "qwen2")
        write_checkpoint(folder, cfg, seed=40 + i)
        out[family] = folder
    return out


def _quantized_model(folder: object, backend: str, dtype: str, bits: int) -> pl.Model:
    """The checkpoint with its projections, embedding and LM head quantized (MLX's format,
    group 32), the other weights in ``dtype``; without the compiled step (JAX's: compared with
    this eager forward in test_compiled_quant.py)."""
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    config = load(folder, backend="numpy", dtype="float32").config
    weights = quantized_weights(folder, backend=backend, dtype=dtype, bits=bits, group_size=32)
    return pl.Model(config, weights, pl.get_backend(backend), compile=False)


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("family", QUANT_FAMILIES)
@pytest.mark.parametrize(("dtype", "bits"), [("float32", 4), ("bfloat16", 4), ("float32", 3)])
def test_prepared_quantized_equals_op_by_op(
    quant_folders: dict, family: str, backend: str, dtype: str, bits: int
) -> None:
    """Quantized projections, embedding and head: the prepared forward binds each weight's
    quantized_linear kernel at load (torch's int4 kernel for 4-bit bfloat16, MLX's
    quantized_matmul for float32, the portable path elsewhere) and gives the op-by-op path's
    logits bit for bit: a full forward, then a prefill and decode steps on caches."""
    model = _quantized_model(quant_folders[family], backend, dtype, bits)
    assert model.prepared is not None and model.prepared.quantized
    assert model.compiled is None  # compile=False: the prepared forward alone
    attn = model.prepared.layers[0].attn
    assert isinstance(attn.wq, QLinear) and isinstance(model.prepared.layers[1].mlp.w_down, QLinear)
    slow = _op_by_op(model)
    ids = _ids(7, L)
    _same(model(ids[None]), slow(ids[None]), "full forward")
    fast_cache, slow_cache = model.make_cache(), slow.make_cache()
    start = 0
    for stop in (6, 7, 8):
        chunk = ids[None, start:stop]
        _same(model(chunk, cache=fast_cache), slow(chunk, cache=slow_cache), f"{start}..{stop}")
        start = stop
