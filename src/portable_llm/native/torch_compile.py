"""torch's compiled decode step: one token's forward traced by running it, compiled by inductor.

:class:`~portable_llm.decoder.compiled.CompiledDecode` hands this module the step as a Python
function of tensors (the token ids, every layer's key and value buffers, the offset, the top
weights), as it hands JAX's to ``jax.jit``. :class:`TorchProgram` traces it the way ``jax.jit``
does, by running it once: ``torch.fx.experimental.proxy_tensor.make_fx`` over the real tensors
records every aten op the forward's kernels call (the dispatcher's choices, the masks, RoPE,
the attention, the cache writes), with none of the Python around them; then inductor
(``torch._inductor.compile``, static shapes) compiles that graph once per shape of its inputs
(a cache capacity), and every later token runs the compiled program. Dynamo never sees the
forward's Python, so nothing in it breaks the graph (the reason an earlier ``torch.compile`` of
the prepared layers ran slower than eager, ``benchmarks/README.md``).

The int8 mode's projections are numba's kernel as a custom op
(``portable_llm::quantized_linear_int8``, ``native/torch.py``), one node each; the kernels that
compute through NumPy elsewhere (``model_linear``'s one-row product) take torch's op while a
trace records (``native.torch.traced``). The cache buffers are written in place
(``index_copy_`` at the traced offset): the program mutates its inputs, as the eager step's
cache does.

Inductor compiles C++ for the CPU at run time: without a C++ compiler (:func:`compiler`) there
is no compiled step and the model runs its prepared forward (:func:`unavailable` says why).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

__all__ = ["TorchProgram", "compile_graph", "compiler", "unavailable", "update"]


def compiler() -> str | None:
    """The C++ compiler inductor would run (``$CXX``, else ``c++``, ``g++`` or ``clang++`` on
    the ``PATH``), or ``None``."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def unavailable(device: Any) -> str | None:
    """Why a model on ``device`` gets no compiled torch step (``None``: it gets one)."""
    if torch.device(device).type != "cpu":
        return f"the compiled torch step runs on the CPU, the model is on {device}"
    if compiler() is None:
        return "no C++ compiler for inductor (set CXX, or install g++ or clang++)"
    return None


def update(buf: Any, value: Any, offset: Any) -> Any:
    """``buf`` ``(B, H_kv, capacity, D)`` with ``value`` ``(B, H_kv, 1, D)`` written at column
    ``offset`` (a 0-d integer tensor), in place: the compiled program mutates the buffer."""
    return buf.index_copy_(2, offset.reshape(1).to(torch.int64), value)


def compile_graph(graph: Any, inputs: list[Any]) -> Callable[..., Any]:
    """``graph`` (make_fx's, returning a flat tuple) compiled by inductor for ``inputs``
    (``torch._inductor.compile``: inductor over a graph captured without dynamo, whose own trace
    of 4,500 nodes took longer than the compilation and checks guards on every call)."""
    with warnings.catch_warnings():  # inductor's own imports (torch 2.13) use torch.jit
        warnings.filterwarnings("ignore", "`torch.jit.script", DeprecationWarning)
        # no size and stride asserts per input (a thousand a SmolLM2 step): the program is keyed
        # on its inputs' shapes, strides and dtypes (TorchProgram)
        options = {"size_asserts": False, "alignment_asserts": False}
        compiled: Callable[..., Any] = torch._inductor.compile(graph, inputs, options=options)
    return compiled


class TorchProgram:
    """``fn`` traced with ``make_fx`` and compiled by inductor (:func:`compile_graph`) once per
    signature of its arguments (the tensors' shapes, strides and dtypes, the other arguments'
    values).

    ``fn``'s arguments are pytrees of tensors and constants (``None``, ints); the tensors are
    the program's inputs, the rest is part of its signature. :attr:`compile_seconds` holds
    each signature's trace and compile time (the first call of a signature pays it).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._programs: dict[tuple[Any, ...], Callable[..., Any]] = {}
        #: make_fx's graph per signature (what inductor compiled).
        self._graphs: dict[tuple[Any, ...], Any] = {}
        #: Seconds spent tracing and compiling, per signature, in the order compiled.
        self.compile_seconds: list[float] = []

    def __call__(self, *args: Any) -> Any:
        leaves, spec = pytree.tree_flatten(args)
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in where]
        statics = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
        key = (spec, statics, *((t.shape, t.stride(), t.dtype) for t in tensors))
        program = self._programs.get(key)
        if program is None:
            start = time.perf_counter()
            program = self._programs[key] = self._compile(key, leaves, spec, where, tensors)
            out = program(*tensors)  # inductor compiles at its first call
            self.compile_seconds.append(time.perf_counter() - start)
            return out
        return program(*tensors)

    def _compile(
        self, key: Any, leaves: list[Any], spec: Any, where: list[int], tensors: list[Any]
    ) -> Callable[..., Any]:
        out_spec: list[Any] = []

        def flat(*ts: Any) -> Any:
            full = list(leaves)
            for i, t in zip(where, ts, strict=True):
                full[i] = t
            out, tree = pytree.tree_flatten(self.fn(*pytree.tree_unflatten(full, spec)))
            out_spec.append(tree)
            return tuple(out)  # inductor's graphs return a flat tuple

        # make_fx runs ``fn`` on the real tensors (its cache writes are the ones the program
        # makes again: the same keys at the same offset) and records the aten ops.
        with torch.no_grad():
            graph = self._graphs[key] = make_fx(flat, tracing_mode="real")(*tensors)
        compiled = compile_graph(graph, tensors)

        def run(*ts: Any) -> Any:
            with torch.no_grad():
                return pytree.tree_unflatten(list(compiled(*ts)), out_spec[0])

        return run
