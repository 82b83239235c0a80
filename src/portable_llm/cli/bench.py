"""``portable-llm bench``: ``impl="auto"``, ``impl="portable"`` and the native kernel called
directly, timed in one run, as times and as ratios to the native kernel.

Each variant is timed as a zero-argument call (timeit style: warm-up, calls per sample chosen so
a sample lasts at least a millisecond, median over many samples). The samples of the three
variants are interleaved, so load from other processes falls on all three alike; a ratio is the
median of per-round ratios. Where the library runs asynchronously (MLX, JAX, torch on CUDA or
MPS), each result is waited for inside the timed region (``Backend.synchronize``).

A new op adds one :class:`BenchCase` to :data:`BENCH_CASES`, with its native kernels in
:data:`DIRECT`.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from portable_llm.attn.block import attention
from portable_llm.attn.sdpa import scaled_dot_product_attention
from portable_llm.backends import Backend, backend_of
from portable_llm.caches.kv import KVCache
from portable_llm.cli.output import Phases, Table, UsageError, wrap
from portable_llm.cli.report import backend_names, load_for_dtype
from portable_llm.ops.activations import softmax
from portable_llm.ops.linear import linear, mlp
from portable_llm.ops.moe import moe
from portable_llm.ops.norm import layer_norm, rms_norm
from portable_llm.ops.quant import quantize, quantized_linear
from portable_llm.rotary.rope import rope
from portable_llm.testing import random_array, random_weight

__all__ = ["BENCH_CASES", "DIRECT", "BenchCase", "Timing", "measure", "run_bench"]

Thunk = Callable[[], Any]
EPS = 1e-6
E, I = 896, 4864  # noqa: E741  # Qwen2-0.5B hidden and intermediate sizes (the doc letters)


@dataclass(frozen=True)
class BenchCase:
    """One timed line: ``op`` on arrays of ``shapes`` (the first is x, the rest weights).

    ``run(*arrays, impl=...)`` returns the thunk that calls the public op; ``DIRECT[backend]
    [op]`` builds the thunk that calls the backend's kernel itself. ``gate``: the largest
    allowed auto/native ratio, checked and printed as PASS/FAIL; a FAIL makes the run exit 1.
    """

    op: str
    shapes: tuple[tuple[int, ...], ...]
    run: Callable[..., Thunk]
    gate: float | None = None
    #: Shown in the shapes column; default: the shapes joined by " x ".
    name: str = ""

    def label(self) -> str:
        """The shapes column, Qwen2-0.5B's widths written as their letters ``E`` and ``I``."""
        return self.name or " x ".join(_dims(s) for s in self.shapes)


def _dims(shape: tuple[int, ...]) -> str:
    """A shape with E = 896 and I = 4864 written as letters: ``(1, 128, E)``."""
    names = {E: "E", I: "I"}
    parts = [names.get(n, str(n)) for n in shape]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _rms_norm(x: Any, w: Any, *, impl: str) -> Thunk:
    return lambda: rms_norm(x, w, eps=EPS, impl=impl)


def _layer_norm(x: Any, w: Any, b: Any, *, impl: str) -> Thunk:
    return lambda: layer_norm(x, w, b, eps=EPS, impl=impl)


def _softmax(x: Any, *, impl: str) -> Thunk:
    return lambda: softmax(x, impl=impl)


def _linear(x: Any, w: Any, *, impl: str) -> Thunk:
    return lambda: linear(x, w, impl=impl)


def _mlp(x: Any, wg: Any, wu: Any, wd: Any, *, impl: str) -> Thunk:
    return lambda: mlp(x, wg, wu, wd, impl=impl)


ROPE_THETA = 1e6  # Qwen2's rope_theta


def _rope(x: Any, *, impl: str) -> Thunk:
    return lambda: rope(x, base=ROPE_THETA, impl=impl)


#: The timed cases. The first is the dispatch-overhead gate: a tiny input, so the time is the
#: Python cost of validate + resolve + pick, next to the native kernel called directly.
BENCH_CASES: list[BenchCase] = [
    BenchCase("rms_norm", ((1, E), (E,)), _rms_norm, gate=1.3),
    BenchCase("rms_norm", ((1, 128, E), (E,)), _rms_norm),
    BenchCase("layer_norm", ((1, 128, E), (E,), (E,)), _layer_norm),
    BenchCase("softmax", ((1, 14, 128, 128),), _softmax),
    BenchCase("linear", ((1, 128, E), (I, E)), _linear),
    BenchCase("mlp", ((1, 16, E), (I, E), (I, E), (E, I)), _mlp, name="(1, 16, E), I"),
    BenchCase("rope", ((1, 14, 1, 64),), _rope),  # decode: Qwen2-0.5B heads (H=14, D=64)
    BenchCase("rope", ((1, 14, 128, 64),), _rope),  # prefill
]


# Quantized weights (MLX's affine layout, 4-bit, groups of 64): a decode token and a prefill
# through Qwen2-0.5B's up projection. Quantizing is setup, outside the timed region.
_QBITS, _QGROUP = 4, 64


def _quantized_linear(x: Any, w: Any, *, impl: str) -> Thunk:
    qw = quantize(w, bits=_QBITS, group_size=_QGROUP)
    return lambda: quantized_linear(x, qw, impl=impl)


def _quantized_linear_grouped(x: Any, w: Any, *, impl: str) -> Thunk:
    # the portable column runs the grouped formulation (auto's portable choice for few rows)
    return _quantized_linear(x, w, impl="grouped" if impl == "portable" else impl)


def _quantized_linear_8bit(x: Any, w: Any, *, impl: str) -> Thunk:
    qw = quantize(w, bits=8, group_size=32)  # the layout of llama.cpp's Q8_0
    return lambda: quantized_linear(x, qw, impl=impl)


BENCH_CASES.extend([
    BenchCase("quantized_linear", ((1, 1, E), (I, E)), _quantized_linear,
              name="(1, 1, E) x (I, E) 4-bit"),
    BenchCase("quantized_linear", ((1, 1, E), (I, E)), _quantized_linear_grouped,
              name="4-bit, portable column: grouped"),
    BenchCase("quantized_linear", ((1, 1, E), (I, E)), _quantized_linear_8bit,
              name="(1, 1, E) x (I, E) 8-bit, group 32"),
    BenchCase("quantized_linear", ((1, 128, E), (I, E)), _quantized_linear,
              name="(1, 128, E) x (I, E) 4-bit"),
])  # fmt: skip


# MoE, 8 experts top-2 (Mixtral's routing) on a 64-token prefill: the gather (cost ~ top_k) next
# to the dense equivalent that runs all 8 experts on every token (impl="dense", both columns).
_X_MOE, _I_MOE = 8, 1024
_MOE_SHAPES = ((1, 64, E), (_X_MOE, E), (_X_MOE, _I_MOE, E), (_X_MOE, _I_MOE, E),
               (_X_MOE, E, _I_MOE))  # fmt: skip


def _moe(x: Any, w: Any, g: Any, u: Any, d: Any, *, impl: str) -> Thunk:
    return lambda: moe(x, w, g, u, d, top_k=2, norm_topk_prob=True, impl=impl)


def _moe_dense(x: Any, w: Any, g: Any, u: Any, d: Any, *, impl: str) -> Thunk:
    return _moe(x, w, g, u, d, impl="dense")


BENCH_CASES.extend([
    BenchCase("moe", _MOE_SHAPES, _moe, name=f"(1, 64, E), X=8, top-2, I={_I_MOE}"),
    BenchCase("moe", _MOE_SHAPES, _moe_dense, name=f"dense: all 8 experts, I={_I_MOE}"),
])  # fmt: skip


# Attention with Qwen2-0.5B's heads (H=14, H_kv=2, D=64), causal: a decode step over 2048 cached
# keys and a 512-token prefill. The "tiled" lines run impl="tiled" in the portable column.
_H, _H_KV, _D = 14, 2, 64
_DECODE = ((1, _H, 1, _D), (1, _H_KV, 2048, _D), (1, _H_KV, 2048, _D))
_PREFILL = ((1, _H, 512, _D), (1, _H_KV, 512, _D), (1, _H_KV, 512, _D))
SDPA = "scaled_dot_product_attention"


def _sdpa(q: Any, k: Any, v: Any, *, impl: str) -> Thunk:
    return lambda: scaled_dot_product_attention(q, k, v, mask="causal", impl=impl)


def _sdpa_tiled(q: Any, k: Any, v: Any, *, impl: str) -> Thunk:
    return _sdpa(q, k, v, impl="tiled" if impl == "portable" else impl)


BENCH_CASES.extend([
    BenchCase(SDPA, _DECODE, _sdpa, name="decode L=1, S=2048 (H=14, H_kv=2)"),
    BenchCase(SDPA, _DECODE, _sdpa_tiled, name="decode, portable column: tiled"),
    BenchCase(SDPA, _PREFILL, _sdpa, name="prefill L=S=512 (H=14, H_kv=2)"),
    BenchCase(SDPA, _PREFILL, _sdpa_tiled, name="prefill, portable column: tiled"),
])  # fmt: skip


# A decode step against a KVCache holding S tokens, S = 128, 1024, 4096: the cache alone
# (update_and_fetch of one token; flat in S where the write is in place) and the attention
# block (whose attention reads all S keys: linear in S). Each call is trimmed back to S tokens.
_KV_SIZES = (128, 1024, 4096)
_BLOCK = ((1, 1, E), (_H * _D, E), (_H_KV * _D, E), (_H_KV * _D, E), (E, _H * _D))


def _filled_cache(x: Any, S: int) -> KVCache:
    bk = backend_of(x)
    assert bk is not None
    k = random_array(3, (1, _H_KV, S, _D), bk.dtype_name(x.dtype), backend=bk.name)[0]
    cache = KVCache(static_shapes=bk.static_shapes)  # as Model.make_cache
    cache.update_and_fetch(k, k)
    cache.make_mask()  # fixed-size views need their mask, or the next update refuses to run
    return cache


def _kv_cache(S: int) -> Callable[..., Thunk]:
    def run(k: Any, *, impl: str) -> Thunk:
        cache = _filled_cache(k, S)

        def step() -> Any:
            k_all, _ = cache.update_and_fetch(k, k)
            cache.trim(1)
            return k_all

        return step

    return run


def _decode_step(S: int) -> Callable[..., Thunk]:
    def run(x: Any, wq: Any, wk: Any, wv: Any, wo: Any, *, impl: str) -> Thunk:
        cache = _filled_cache(x, S)
        kw = {"wq": wq, "wk": wk, "wv": wv, "wo": wo, "num_heads": _H, "num_kv_heads": _H_KV}

        def step() -> Any:
            out = attention(x, cache=cache, rope={"base": ROPE_THETA}, impl=impl, **kw)
            cache.trim(1)
            return out

        return step

    return run


BENCH_CASES.extend(
    BenchCase("kv_cache", ((1, _H_KV, 1, _D),), _kv_cache(S), name=f"1 token at S={S}")
    for S in _KV_SIZES
)
BENCH_CASES.extend(
    BenchCase("decode", _BLOCK, _decode_step(S), name=f"attention block + KVCache, S={S}")
    for S in _KV_SIZES
)


def _torch() -> dict[str, tuple[str, Callable[..., Thunk]]]:
    import torch
    import torch.nn.functional as F

    def norm(x: Any, w: Any) -> Thunk:
        shape = (x.shape[-1],)
        return lambda: F.rms_norm(x, shape, w, EPS)

    def ffn(x: Any, wg: Any, wu: Any, wd: Any) -> Thunk:
        return lambda: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def sdpa(q: Any, k: Any, v: Any) -> Thunk:
        causal = q.shape[-2] == k.shape[-2]  # L = 1 sees every key: no mask
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return {
        "rms_norm": ("torch.nn.functional.rms_norm", norm),
        "layer_norm": (
            "torch.nn.functional.layer_norm",
            lambda x, w, b: lambda: F.layer_norm(x, (x.shape[-1],), w, b, EPS),
        ),
        "softmax": ("torch.softmax", lambda x: lambda: torch.softmax(x, -1)),
        "linear": ("torch.nn.functional.linear", lambda x, w: lambda: F.linear(x, w)),
        "mlp": ("F.linear, F.silu", ffn),
        SDPA: ("torch.nn.functional.scaled_dot_product_attention", sdpa),
    }


def _mlx() -> dict[str, tuple[str, Callable[..., Thunk]]]:
    import mlx.core as mx
    import mlx.nn

    def ffn(x: Any, wg: Any, wu: Any, wd: Any) -> Thunk:
        return lambda: mx.matmul(mlx.nn.silu(mx.matmul(x, wg.T)) * mx.matmul(x, wu.T), wd.T)

    def sdpa(q: Any, k: Any, v: Any) -> Thunk:
        scale = q.shape[-1] ** -0.5
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def qmm(x: Any, w: Any) -> Thunk:
        wq, s, b = mx.quantize(w, group_size=_QGROUP, bits=_QBITS)
        return lambda: mx.quantized_matmul(
            x, wq, s, b, transpose=True, group_size=_QGROUP, bits=_QBITS
        )

    def rope(x: Any) -> Thunk:
        d = x.shape[-1]
        return lambda: mx.fast.rope(x, d, traditional=False, base=ROPE_THETA, scale=1.0, offset=0)

    return {
        "rms_norm": ("mx.fast.rms_norm", lambda x, w: lambda: mx.fast.rms_norm(x, w, EPS)),
        "layer_norm": (
            "mx.fast.layer_norm",
            lambda x, w, b: lambda: mx.fast.layer_norm(x, w, b, EPS),
        ),
        "softmax": ("mx.softmax(precise=True)", lambda x: lambda: mx.softmax(x, -1, precise=True)),
        "linear": ("mx.matmul", lambda x, w: lambda: mx.matmul(x, w.T)),
        "rope": ("mx.fast.rope", rope),
        "quantized_linear": ("mx.quantized_matmul", qmm),
        "mlp": ("mx.matmul, mlx.nn.silu", ffn),
        SDPA: ("mx.fast.scaled_dot_product_attention", sdpa),
    }


def _jax() -> dict[str, tuple[str, Callable[..., Thunk]]]:
    import jax
    import jax.numpy as jnp

    def ffn(x: Any, wg: Any, wu: Any, wd: Any) -> Thunk:
        return lambda: jnp.matmul(jax.nn.silu(jnp.matmul(x, wg.T)) * jnp.matmul(x, wu.T), wd.T)

    def sdpa(q: Any, k: Any, v: Any) -> Thunk:
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # its layout: (B, L, H, D)
        attend = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal",))
        causal = q.shape[1] == k.shape[1]
        return lambda: attend(q, k, v, is_causal=causal)

    return {
        "softmax": ("jax.nn.softmax", lambda x: lambda: jax.nn.softmax(x, axis=-1)),
        "linear": ("jnp.matmul", lambda x, w: lambda: jnp.matmul(x, w.T)),
        "mlp": ("jnp.matmul, jax.nn.silu", ffn),
        SDPA: ("jax.nn.dot_product_attention (jit)", sdpa),
    }


#: backend -> () -> {op: (kernel name, (*arrays) -> thunk calling the kernel directly)}.
#: Only ops with a native kernel in ``portable_llm.native.<backend>`` have an entry.
DIRECT: dict[str, Callable[[], dict[str, tuple[str, Callable[..., Thunk]]]]] = {
    "torch": _torch,
    "mlx": _mlx,
    "jax": _jax,
}


def _sync(bk: Backend) -> Callable[[Any], Any] | None:
    """What makes a result ready inside the timed region (``None``: the call is synchronous)."""
    return bk.synchronize if bk.asynchronous() else None


def _per_call(fn: Thunk, sync: Callable[[Any], Any] | None, number: int) -> float:
    t0 = time.perf_counter()
    if sync is None:
        for _ in range(number):
            fn()
    else:
        for _ in range(number):
            sync(fn())
    return (time.perf_counter() - t0) / number


def _calls_per_sample(fn: Thunk, sync: Callable[[Any], Any] | None, target: float) -> int:
    """As ``timeit.Timer.autorange``: 1, 2, 5, 10, 20, ... calls until a sample lasts ``target``."""
    number = 1
    while True:
        for k in (1, 2, 5):
            if _per_call(fn, sync, number * k) * number * k >= target:
                return number * k
        number *= 10
        if number >= 10**6:
            return number


@dataclass(frozen=True)
class Timing:
    """Median seconds per call of each variant, and each variant's ratio to ``native``.

    A ratio is the median over rounds of (variant's sample / native's sample of the same round):
    the two samples ran back to back, so a slow spell of the machine cancels out.
    """

    median: dict[str, float]
    ratio: dict[str, float]


def measure(
    variants: dict[str, Thunk],
    sync: Callable[[Any], Any] | None,
    repeat: int,
    target: float,
    budget: float = 0.0,
) -> Timing:
    """Time the variants in rounds of one sample each, interleaved.

    At least ``repeat`` rounds, more while the rounds so far took less than ``budget`` seconds
    (up to 1000): many short samples make the median robust to a loaded machine.
    """
    for fn in variants.values():  # warm-up: first-call compilation, caches, allocator
        for _ in range(3):
            _per_call(fn, sync, 1)
    numbers = {k: _calls_per_sample(fn, sync, target) for k, fn in variants.items()}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    start = time.perf_counter()
    rounds = 0
    while rounds < repeat or (time.perf_counter() - start < budget and rounds < 1000):
        for k, fn in variants.items():
            samples[k].append(_per_call(fn, sync, numbers[k]))
        rounds += 1
    base = samples.get("native")
    ratio = {
        k: statistics.median(a / b for a, b in zip(v, base, strict=True))
        for k, v in samples.items()
        if base is not None and k != "native"
    }
    return Timing({k: statistics.median(v) for k, v in samples.items()}, ratio)


def _time(t: float | None) -> str:
    if t is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


_HEADERS = ("op", "shapes", "auto", "portable", "native", "auto/nat", "port/nat")
#: The widths the rows are printed at as they come (100 columns in all); op names shown short.
_WIDTHS = (16, 34, 7, 8, 7)
_SHORT = {SDPA: "sdpa"}


def run_bench(
    backends: Sequence[str] | None = None,
    ops: Sequence[str] | None = None,
    *,
    repeat: int | None = None,
    quick: bool = False,
    dtype: str = "float32",
    file: TextIO | None = None,
) -> int:
    """Time every selected case on every selected, installed backend; print one table per
    backend, each row as soon as its case is timed.

    Return 1 if a gate (:attr:`BenchCase.gate`) FAILs, 0 otherwise.
    """
    out = file if file is not None else sys.stdout
    known = {c.op for c in BENCH_CASES}
    if ops and set(ops) - known:
        bad = ", ".join(sorted(set(ops) - known))
        raise UsageError(f"--op: unknown op(s) {bad}; known: {', '.join(sorted(known))}")
    cases = [c for c in BENCH_CASES if not ops or c.op in ops]
    names = backend_names(backends)
    repeat = repeat or (5 if quick else 15)
    target = 0.0005 if quick else 0.001  # seconds per sample, at least
    budget = 0.02 if quick else 1.0  # seconds of rounds per case, at least
    gates: list[tuple[str, str]] = []  # (line, why it failed or "")
    table = Table(_HEADERS, _WIDTHS)
    for name in names:
        bk = load_for_dtype(name, dtype, out)
        if bk is None:
            continue
        direct = DIRECT[name]() if name in DIRECT else {}
        sync = _sync(bk)
        print(table.header(), file=out, flush=True)
        kernels: dict[str, str] = {}
        for case in cases:
            x = random_array(1, case.shapes[0], dtype, backend=name)[0]
            weights = [
                random_weight(2 + i, shape, dtype, backend=name)[0]
                for i, shape in enumerate(case.shapes[1:])
            ]
            arrays = [x, *weights]
            variants = {impl: case.run(*arrays, impl=impl) for impl in ("auto", "portable")}
            kernel, make = direct.get(case.op, ("-", None))
            if make is not None:
                variants["native"] = make(*arrays)
                kernels[_SHORT.get(case.op, case.op)] = kernel
            with Phases("bench")(f"timing {case.op} {case.label()} on {name}", announce=False):
                t = measure(variants, sync, repeat, target, budget)
            times = [_time(t.median.get(k)) for k in ("auto", "portable", "native")]
            ratios = [_ratio(t.ratio.get(k)) for k in ("auto", "portable")]
            op = _SHORT.get(case.op, case.op)
            print(table.row([op, case.label(), *times, *ratios]), file=out, flush=True)
            if case.gate is not None:
                gates.append(_gate(name, case, t.ratio.get("auto")))
        listed = "; ".join(f"{op}: {k}" for op, k in kernels.items()) or "none"
        print(file=out)
        print(wrap(f"native kernels on {name} ({dtype}): {listed}", "   ", "     "), file=out)
        print(file=out, flush=True)
    notes = (
        f"times: median per call over >= {repeat} samples per variant (more within {budget:g} "
        "s), interleaved; auto/nat, port/nat: median of the per-round ratios of auto and "
        f"portable to native. E = {E}, I = {I} (Qwen2-0.5B's widths); sdpa = {SDPA}"
    )
    print(wrap(notes, "", ""), file=out)
    for line, _ in gates:
        print(wrap(line), file=out)
    failed = [why for _, why in gates if why]
    if failed:
        message = (
            f"FAIL: {'; '.join(failed)}. Timings are noisy: rerun on an idle machine before "
            "reading this as a regression."
        )
        print(wrap(message), file=out)
    return 1 if failed else 0


def _gate(name: str, case: BenchCase, ratio: float | None) -> tuple[str, str]:
    """The gate's line, and why it FAILed (``""``: PASS, or ``n/a`` without a native kernel)."""
    gate = f"gate {case.op} {case.label()} on {name}"
    what = f"{gate}: impl='auto' within {case.gate}x of native:"
    if ratio is None:
        return f"{what} n/a (no native {case.op} kernel)", ""
    if case.gate is not None and ratio <= case.gate:
        return f"{what} {ratio:.2f} PASS", ""
    return f"{what} {ratio:.2f} FAIL", f"{gate}: auto/native {ratio:.2f} > {case.gate}"
