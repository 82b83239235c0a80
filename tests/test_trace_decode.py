"""``pl.trace()`` around one decode step of the default (prepared) forward lists every kernel
that ran: per layer the norms, the projections (quantized ones for a quantized model), RoPE,
the attention and the activation, then the final norm, the LM head and the sampler. On JAX and
MLX the step is the compiled one, whose kernels the trace gets as they were recorded when the
program was traced."""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.attn.sdpa import OP as SDPA
from portable_llm.testing.checkpoints import quantized_weights, tiny_config, write_checkpoint

LAYERS = 2  # tiny_config's


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = tmp_path_factory.mktemp("trace_qwen3")
    # q/k norms, an untied head; I = 64: every projection quantizes in groups of 32
    write_checkpoint(path, tiny_config("qwen3", intermediate_size=64), seed=5)
    return path


def _model(folder: object, backend: str, quantized: bool) -> pl.Model:
    if not quantized:
        return pl.load(folder, backend=backend)
    weights = quantized_weights(folder, backend=backend, bits=4, group_size=32)
    config = pl.load(folder, backend="numpy").config
    return pl.Model(config, weights, pl.get_backend(backend))


def _one_step(model: pl.Model) -> tuple[pl.Trace, object]:
    """Prefill a prompt, then one decode step and its greedy choice inside a trace."""
    cache = model.make_cache()
    logits = model(np.array([[5, 9, 17, 33]]), cache=cache, last_only=True)
    ids = pl.asarray(np.array([[int(np.argmax(pl.to_numpy(logits)[0, -1]))]]),
                     backend=model.backend.name)  # fmt: skip
    model.decode_step(ids, cache=cache)  # a first step: compiled backends trace it here
    with pl.trace() as t:
        logits = model.decode_step(ids, cache=cache)
        token = pl.greedy(logits[:, -1, :])
    return t, token


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantized"])
def test_one_prepared_decode_step_traces_every_kernel(folder, backend, quantized) -> None:
    model = _model(folder, backend, quantized)
    assert model.prepared is not None  # the default path
    t, token = _one_step(model)
    assert all(e.backend == model.backend.name for e in t)
    ops = [e.op for e in t if "." not in e.op]  # a kernel's own pieces carry a suffix
    proj = "quantized_linear" if quantized else "model_linear"  # a model's float products
    # The embedding, then per layer: norm, q/k/v projections, q/k norms, RoPE on q and k,
    # attention, output projection, norm, gate and up projections, activation, down projection.
    layer = ["rms_norm", proj, proj, proj, "rms_norm", "rms_norm", "rope", "rope", SDPA, proj]
    layer += ["rms_norm", proj, proj, "silu", proj]
    embed = "quantized_embedding" if quantized else "embedding"
    want = [embed, *layer * LAYERS, "rms_norm", proj, "greedy"]  # the head, the sampler
    if model.compiled is not None:  # JAX, MLX: the compiled step ran, traced once before
        assert model.compiled.kernels
    assert ops == want
    assert int(pl.to_numpy(token)[0]) >= 0


def test_a_generate_step_traces_its_forward_and_its_sampling(folder, backend) -> None:
    """The decode loop's greedy choice and log-probabilities are the ops' kernels, asked of the
    dispatcher: a step of generate_step records them after the model's."""
    model = pl.load(folder, backend=backend)
    steps = pl.generate_step(model, [5, 9, 17, 33])
    next(steps)  # the prefill and the first token
    with pl.trace() as t:
        next(steps)
        next(steps)
    ops = [e.op for e in t]
    assert SDPA in ops and "rope" in ops
    assert ops.count("greedy") >= 1 and ops.count("greedy") == ops.count("log_softmax")
