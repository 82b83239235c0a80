"""The compiled torch decode step (``Model(..., compile=True)``, ``native/torch_compile.py``):
one token's prepared forward traced by running it (``make_fx``) and compiled by inductor, the
int8 mode's projections as the custom op ``portable_llm::quantized_linear_int8`` (numba's
kernel). Greedy decoding with it gives the eager prepared step's tokens, its logits within the
whole-model tolerance, one trace per cache capacity, the caches as an eager step leaves them.

The default run checks the traced graph itself (run as ``make_fx`` recorded it: what inductor
is given; a few seconds); inductor's compilation of the tiny model (11 s with a warm cache,
50 s cold, on the 2-core CPU) is in the ``slow`` sweep. Torch only: the other backends' compiled
steps are tests/test_compiled_quant.py's and tests/test_compiled_mlx.py's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

import portable_llm as pl
from conftest import only_on
from portable_llm.models import load
from portable_llm.testing import MODEL_TOLERANCES, assert_close, tolerance
from portable_llm.testing.checkpoints import quantized_weights, tiny_config, write_checkpoint

torch = pytest.importorskip("torch")
pytestmark = only_on("torch")

STEPS = 6  # decode steps: with step=4 the caches grow once (capacities 12, 16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compiled_torch")
    write_checkpoint(out, tiny_config("llama", intermediate_size=64), seed=21)
    return out


@pytest.fixture
def graph_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The traced graph run as ``make_fx`` recorded it, without inductor's compilation."""
    from portable_llm.native import torch_compile

    monkeypatch.setattr(torch_compile, "compile_graph", lambda graph, inputs: graph)


def _models(folder: Path, activations: str, quantized: bool) -> tuple[pl.Model, pl.Model]:
    """(compiled, eager): the tiny checkpoint on torch float32, quantized (4 bits, group 32)
    or not; the eager copy without the compiled step."""
    if quantized:
        config = load(folder, backend="numpy", dtype="float32").config
        weights = quantized_weights(folder, backend="torch")
        bk = pl.get_backend("torch")
        model = pl.Model(config, weights, bk, activations=activations, compile=True)
    else:
        model = load(folder, backend="torch", dtype="float32", compile=True)
    assert model.compiled is not None, model.compile_note
    eager = copy.copy(model)
    eager.compiled = None
    return model, eager


def _greedy(model: pl.Model, eager: pl.Model) -> list[int]:
    """Greedy decoding, each model feeding back its own tokens: the steps' logits agree within
    float32's whole-model tolerance and the tokens are the same; returns them."""
    tol = MODEL_TOLERANCES.get("float32", tolerance("float32"))
    fast, slow = model.make_cache(step=4), eager.make_cache(step=4)
    assert all(c.static_shapes for c in fast)
    prompt = pl.asarray([[5, 17, 3, 250, 9, 41, 77]], backend="torch")  # (1, 7)
    got = model(prompt, cache=fast, last_only=True)
    want = eager(prompt, cache=slow, last_only=True)
    assert model.compiled is not None and model.compiled.traces == 0  # the prefill is eager
    tokens = []
    for t in range(STEPS):
        assert_close(got, want, dtype="float32", rtol=tol.rtol, atol=tol.atol, err_msg=f"{t}")
        a, b = pl.greedy(got[:, -1, :]), pl.greedy(want[:, -1, :])  # (1,)
        assert int(a[0]) == int(b[0]), f"step {t}"
        tokens.append(int(a[0]))
        got = model.decode_step(a[:, None], cache=fast)  # (1, 1, V): compiled
        want = eager.decode_step(b[:, None], cache=slow)
    assert fast[0].offset == slow[0].offset == 7 + STEPS
    for c, d in zip(fast, slow, strict=True):  # the caches hold what the eager step wrote
        k, v = c.state
        k2, v2 = d.state
        n = c.offset
        assert_close(k[:, :, :n], k2[:, :, :n], dtype="float32", rtol=tol.rtol, atol=tol.atol)
        assert_close(v[:, :, :n], v2[:, :, :n], dtype="float32", rtol=tol.rtol, atol=tol.atol)
    assert model.compiled.traces == 2  # capacities 12 and 16: not one per token
    assert len(set(tokens)) > 1  # no constant token
    return tokens


@pytest.mark.parametrize(
    ("activations", "quantized"),
    [("int8", True), pytest.param("float", False, marks=pytest.mark.slow)],
)
def test_traced_graph_equals_the_eager_step(
    folder: Path, graph_only: None, activations: str, quantized: bool
) -> None:
    """What inductor is given: make_fx's graph of the step, run as it is. In the int8 mode
    every projection is one custom-op node (the weight prepacked at the trace), and the
    attention of one query row is the portable path's ops (inductor compiles them)."""
    model, eager = _models(folder, activations, quantized)
    _greedy(model, eager)
    programs = list(model.compiled._fns.values())  # type: ignore[union-attr]
    assert len(programs) == 1  # one layout of the top weights
    if activations == "int8":
        graph = next(iter(programs[0]._graphs.values()))
        ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        # the 2 layers' 7 projections and the (untied, quantized) LM head
        assert ops.count("portable_llm.quantized_linear_int8.default") == 2 * 7 + 1
        # one query row's attention: the portable matmuls and softmax, no fused SDPA kernel
        assert not [op for op in ops if "scaled_dot_product" in op]


@pytest.mark.slow
def test_inductor_step_equals_the_eager_step(folder: Path) -> None:
    """The compiled program itself (inductor's C++ kernels and the custom op)."""
    model, eager = _models(folder, "int8", True)
    _greedy(model, eager)


def test_int8_op_equals_the_kernel(folder: Path) -> None:
    """The custom op is numba's kernel, bit for bit (its fake gives the same shape)."""
    from portable_llm.native import numba_cpu
    from portable_llm.native.torch import int8_op

    w = quantized_weights(folder, backend="torch")["model.layers.0.mlp.down_proj.weight"]
    packed, scales, biases = w.arrays
    pre = numba_cpu.prepack(
        packed.numpy(), scales.numpy(), biases.numpy(), bits=w.bits, group_size=w.group_size
    )
    x = np.random.default_rng(3).standard_normal((3, pre.w.shape[1] * pre.block), np.float32)
    tensors = (torch.from_numpy(pre.w), torch.from_numpy(pre.s), torch.from_numpy(pre.b))
    got = int8_op(torch.from_numpy(x), *tensors, pre.block, pre.n)
    np.testing.assert_array_equal(got.numpy(), numba_cpu.run(pre, x))
    torch.library.opcheck(int8_op, (torch.from_numpy(x), *tensors, pre.block, pre.n))


def test_no_compiler_runs_the_prepared_forward(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a C++ compiler for inductor the model runs its prepared forward and says why;
    a bad ``compile`` is named."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    config = load(folder, backend="numpy", dtype="float32").config
    weights = quantized_weights(folder, backend="torch")
    model = pl.Model(config, weights, pl.get_backend("torch"), activations="int8", compile=True)
    assert model.compiled is None
    assert model.compile_note is not None and "C++ compiler" in model.compile_note
    default = pl.Model(config, weights, pl.get_backend("torch"), activations="int8")
    assert default.compiled is None and default.compile_note is None  # opt-in: not asked
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        pl.Model(config, weights, pl.get_backend("torch"), compile="yes")


def test_generate_says_why_the_step_is_off(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``portable-llm generate --compile`` on a machine without a C++ compiler decodes with the
    prepared forward and ends its decode line with the reason."""
    from portable_llm.cli.cli import main

    monkeypatch.setenv("CXX", "/nonexistent/c++")
    args = ["generate", str(folder), "--backend", "torch", "--ids", "5,17,3"]
    assert main([*args, "--max-new-tokens", "3", "--compile"]) == 0
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())  # the lines wrapped to the terminal's width
    assert "tokens/s; compiled step off: " + _NO_CXX in text, text


_NO_CXX = "no C++ compiler for inductor (set CXX, or install g++ or clang++)"
