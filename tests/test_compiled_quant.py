"""The compiled decode step with quantized weights (``models/compiled.py`` on JAX and MLX): the
packed codes, scales and biases of every projection, the embedding and the LM head are arguments
of the one ``jax.jit`` / ``mx.compile`` and ``quantized_linear`` runs traced inside it. It
equals the eager prepared step: logits within the dtype's whole-model tolerance, identical
greedy tokens, one trace per cache capacity; float32 and bfloat16, 4 and 8 bits, tied and
untied heads.

The eager model is the same model with ``compiled = None``. Backends without a compiled step
for quantized weights (NumPy, array-api-strict; torch's is opt-in) skip.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.core.dispatch import dispatcher
from portable_llm.decoder.prepared import QLinear
from portable_llm.models import load
from portable_llm.testing import MODEL_TOLERANCES, assert_close, tolerance
from portable_llm.testing.checkpoints import quantized_weights, tiny_config, write_checkpoint

STEPS = 7  # decode steps: with step=4 the caches grow twice (capacities 8, 12, 16)
GROUP = 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, object]:
    """Checkpoints whose every K is a multiple of the group size: tied (qwen3: q/k norms) and
    untied (qwen2: projection biases) heads."""
    out: dict[bool, object] = {}
    for tied, family in ((True, "qwen3"), (False, "qwen2")):
        folder = tmp_path_factory.mktemp(f"compiled_q_{family}")
        cfg = tiny_config(family, intermediate_size=64, tie_word_embeddings=tied)
        write_checkpoint(folder, cfg, seed=50 + tied)
        out[tied] = folder
    return out


def _models(folder: object, backend: str, dtype: str, bits: int) -> tuple[pl.Model, pl.Model]:
    """(compiled, eager): the checkpoint with its projections, embedding and LM head quantized
    (MLX's format), the eager copy without the compiled step."""
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    config = load(folder, backend="numpy", dtype="float32").config
    weights = quantized_weights(folder, backend=backend, dtype=dtype, bits=bits, group_size=GROUP)
    model = pl.Model(config, weights, pl.get_backend(backend))
    assert model.prepared is not None and model.prepared.quantized
    if model.compiled is None:
        pytest.skip(f"{backend}: no compiled step for quantized weights (eager prepared forward)")
    eager = copy.copy(model)
    eager.compiled = None
    return model, eager


def _prompt(seed: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 300, size=n)]


def _check(folders: dict[bool, object], backend: str, dtype: str, bits: int, tied: bool) -> None:
    """Greedy decoding, each model feeding back its own tokens: every step's logits agree
    within the dtype's whole-model tolerance and the tokens are identical; one compilation per
    capacity; the kernels chosen inside the trace are those a concrete activation picks."""
    model, eager = _models(folders[tied], backend, dtype, bits)
    tol = MODEL_TOLERANCES.get(dtype, tolerance(dtype))
    fast, slow = model.make_cache(step=4), eager.make_cache(step=4)
    prompt = pl.asarray([_prompt(1, 5)], backend=backend)  # (1, 5)
    got = model(prompt, cache=fast, last_only=True)
    want = eager(prompt, cache=slow, last_only=True)
    assert model.compiled is not None and model.compiled.traces == 0  # the prefill is eager
    tokens: list[tuple[int, int]] = []
    for t in range(STEPS):
        assert_close(got, want, dtype=dtype, rtol=tol.rtol, atol=tol.atol, err_msg=f"step {t}")
        a, b = pl.greedy(got[:, -1, :]), pl.greedy(want[:, -1, :])  # (1,)
        tokens.append((int(pl.to_numpy(a)[0]), int(pl.to_numpy(b)[0])))
        got = model.decode_step(a[:, None], cache=fast)  # (1, 1, V): compiled first
        want = eager.decode_step(b[:, None], cache=slow)
    assert [x for x, _ in tokens] == [y for _, y in tokens]
    assert fast[0].offset == slow[0].offset == 5 + STEPS
    assert model.compiled.traces == 3  # capacities 8, 12, 16: not one per token
    assert len({x for x, _ in tokens}) > 1  # the path is no constant token
    # The traced step chose its kernels apart (on traced activations, see the test below): the
    # eager forward's, chosen after the compiled step ran, are auto's on concrete activations.
    d = dispatcher(pl.get_backend(backend))
    attn = model.prepared.layers[0].attn
    fmt = {"bits": bits, "group_size": GROUP}
    for w, bias in ((attn.wq, attn.bq), (model.prepared._head, None)):
        assert isinstance(w, QLinear)
        x = pl.asarray(np.ones((1, 1, w.packed.shape[1] * 32 // bits)), backend=backend)
        x = pl.asarray(x, backend=backend, dtype=dtype)  # (1, 1, K), concrete
        want_fn = d.pick("quantized_linear", "auto", x, w.packed, w.scales, w.biases, bias, **fmt)
        chosen = [fn for key, (fn, _) in w.fns.items() if math.prod(key[:-2]) == 1]
        assert chosen == [want_fn]  # keys: (leading axes, dtype, no bias)


def test_compiled_quantized_step_equals_eager_step(folders: dict, backend: str) -> None:
    """The fast case of the default run: float32, 4 bits, untied head."""
    _check(folders, backend, "float32", 4, tied=False)


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize(
    ("dtype", "bits", "tied"),
    [("float32", 8, True), ("bfloat16", 4, True), ("bfloat16", 8, False)],
)
def test_compiled_quantized_step_sweep(
    folders: dict, backend: str, dtype: str, bits: int, tied: bool
) -> None:
    _check(folders, backend, dtype, bits, tied)


def test_auto_takes_the_jitted_kernel_traced_and_eager(backend: str) -> None:
    """On JAX, ``auto`` takes the native jitted dequantize-and-matmul both traced (the compiled
    step, where XLA fuses the dequantize into the product) and on concrete rows of a decode step
    (one jitted program per shape, no longer the grouped sums, which ran 0.06-0.6x the dense
    product); both equal the portable path. The choice never reads the activation's values."""
    if backend != "jax":
        pytest.skip("only JAX traces the quantized step")
    import jax

    bk = pl.get_backend(backend)
    d = dispatcher(bk)
    w = pl.asarray(np.random.default_rng(3).standard_normal((64, 64)), backend=backend)
    qw = pl.quantize(pl.asarray(w, backend=backend, dtype="float32"), bits=4, group_size=GROUP)
    fmt = {"bits": 4, "group_size": GROUP}
    x = pl.asarray(np.ones((1, 1, 64)), backend=backend, dtype="float32")  # (1, 1, K)
    chosen = []

    def step(x: object) -> object:
        fn = d.pick("quantized_linear", "auto", x, *qw.arrays, None, **fmt)
        chosen.append(fn)
        return fn(bk.xp, x, *qw.arrays, None, **fmt)

    traced = jax.jit(step)(x)
    concrete = step(x)
    assert chosen == [d.native["quantized_linear"].fn] * 2
    portable = d.pick("quantized_linear", "portable", x, *qw.arrays, None, **fmt)
    tol = tolerance("float32")
    assert_close(traced, concrete, rtol=tol.rtol, atol=tol.atol)
    assert_close(concrete, portable(bk.xp, x, *qw.arrays, None, **fmt), rtol=tol.rtol,
                 atol=tol.atol)  # fmt: skip
