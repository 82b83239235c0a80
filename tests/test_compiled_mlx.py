"""The compiled decode step (``models/compiled.py``: ``mx.compile`` on MLX, ``jax.jit`` on JAX)
equals the eager prepared step: logits within the dtype's tolerance, identical greedy tokens,
float32 and bfloat16; and ``generate`` gives the same tokens through either.

The eager model is the same model with ``compiled = None`` (its caches then return exactly
``offset`` keys, where the compiled step attends over fixed-size views with the caches' mask).
Backends without a compiled step (NumPy, torch, array-api-strict) skip.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.models import load
from portable_llm.testing import MODEL_TOLERANCES, assert_close, tolerance
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint

STEPS = 7  # decode steps: with step=4 the caches grow twice (capacities 8, 12, 16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> object:
    out = tmp_path_factory.mktemp("compiled_llama")
    write_checkpoint(out, tiny_config("llama"), seed=31)
    return out


def _models(folder: object, backend: str, dtype: str) -> tuple[pl.Model, pl.Model]:
    """(compiled, eager): one load, the eager copy without the compiled step."""
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    model = load(folder, backend=backend, dtype=dtype)
    if model.compiled is None:
        pytest.skip(f"{backend}: no compiled decode step (the eager prepared forward runs)")
    eager = copy.copy(model)
    eager.compiled = None
    return model, eager


def _prompt(seed: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 300, size=n)]


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_step_equals_eager_step(folder: object, backend: str, dtype: str) -> None:
    """Greedy decoding, each model feeding back its own tokens: every step's logits agree
    within the dtype's whole-model tolerance (a compiler may fuse and round differently in
    half precision) and the tokens are identical; one compilation per capacity."""
    model, eager = _models(folder, backend, dtype)
    tol = MODEL_TOLERANCES.get(dtype, tolerance(dtype))
    fast, slow = model.make_cache(step=4), eager.make_cache(step=4)
    assert all(c.static_shapes for c in fast)
    assert all(c.static_shapes is pl.get_backend(backend).static_shapes for c in slow)
    prompt = pl.asarray([_prompt(1, 5)], backend=backend)  # (1, 5)
    got = model(prompt, cache=fast, last_only=True)
    want = eager(prompt, cache=slow, last_only=True)
    assert model.compiled is not None and model.compiled.traces == 0  # the prefill is eager
    tokens: list[tuple[int, int]] = []
    for t in range(STEPS):
        assert_close(got, want, dtype=dtype, rtol=tol.rtol, atol=tol.atol, err_msg=f"step {t}")
        a, b = pl.greedy(got[:, -1, :]), pl.greedy(want[:, -1, :])  # (1,)
        tokens.append((int(pl.to_numpy(a)[0]), int(pl.to_numpy(b)[0])))
        got = model.decode_step(a[:, None], cache=fast)  # (1, 1, V)
        want = eager.decode_step(b[:, None], cache=slow)
    assert [x for x, _ in tokens] == [y for _, y in tokens]
    assert fast[0].offset == slow[0].offset == 5 + STEPS
    assert model.compiled.traces == 3  # capacities 8, 12, 16: not one per token
    assert len({x for x, _ in tokens}) > 1  # the path is no constant token


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_gives_the_same_tokens_compiled_or_eager(
    folder: object, backend: str, dtype: str
) -> None:
    model, eager = _models(folder, backend, dtype)
    prompt = _prompt(2, 6)
    fast = pl.generate(model, prompt, max_new_tokens=12, stop=())
    got = list(fast)
    assert got == list(pl.generate(eager, prompt, max_new_tokens=12, stop=()))
    assert fast.stats.finish_reason == "length" and len(got) == 12


def test_the_compiled_step_leaves_the_caches_as_the_eager_step(
    folder: object, backend: str
) -> None:
    """After compiled steps the caches hold the eager keys, and an eager forward (a chunk of
    two tokens, which the compiled step does not take) continues from them."""
    model, eager = _models(folder, backend, "float32")
    fast, slow = model.make_cache(), eager.make_cache()
    prompt = pl.asarray([_prompt(3, 4)], backend=backend)
    model(prompt, cache=fast)
    eager(prompt, cache=slow)
    for t in (7, 9, 11):
        token = pl.asarray([[t]], backend=backend)
        model.decode_step(token, cache=fast)
        eager.decode_step(token, cache=slow)
    chunk = pl.asarray([[20, 21]], backend=backend)
    assert_close(model(chunk, cache=fast), eager(chunk, cache=slow))
    assert fast[0].offset == slow[0].offset == 9
