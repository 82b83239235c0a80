"""The measurements behind ``portable_llm.ops.quant.KEEP_CODES_FROM``: per backend, dtype and code
width, one decode projection (one row of x) kept quantized (``quantized_linear``, ``auto``)
against the dense matmul of its dequantized weight (``linear``), at SmolLM2-135M's shapes.

Interleaved rounds (every case once per round), medians; one thread
(``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``); the load average is printed with the table.

    OMP_NUM_THREADS=1 python benchmarks/quant_rule.py --backend torch --backend numpy --rounds 5

``--group 16 --bits 6`` measures llama.cpp's Q6_K format (groups of 16), which no backend's
kernel takes: the portable paths.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

import portable_llm as pl
from portable_llm.backends import get_backend

#: SmolLM2-135M's projections (N, K): q/o, k/v, gate/up, down, and the tied LM head.
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))


def _sync(bk: object, y: object) -> None:
    name = getattr(bk, "name", "")
    if name == "jax":
        y.block_until_ready()  # type: ignore[attr-defined]
    elif name == "mlx":
        import mlx.core as mx

        mx.eval(y)


def _qlinear(x: object, arrays: tuple[object, ...], *, bits: int, group: int) -> object:
    return pl.quantized_linear(x, pl.QuantizedWeight(*arrays, bits=bits, group_size=group))


def _call(bk: object, fn: Callable[..., object], *args: object) -> None:
    _sync(bk, fn(*args))


def _cases(backend: str, dtype: str, bits: int, group: int) -> list[tuple[str, Callable[[], None]]]:
    bk = get_backend(backend)
    rng = np.random.default_rng(0)
    out = []
    for n, k in SHAPES:
        w = bk.astype(bk.from_numpy(rng.uniform(-0.1, 0.1, (n, k)).astype(np.float32)),
                      bk.dtype(dtype))  # fmt: skip
        qw = pl.quantize(w, bits=bits, group_size=group)
        wd = pl.dequantize(qw)
        x = bk.astype(bk.from_numpy(rng.uniform(-1, 1, (1, k)).astype(np.float32)), wd.dtype)
        if backend == "jax":
            import jax

            # weights as arguments (closed over, XLA would constant-fold them)
            qfn = jax.jit(partial(_qlinear, bits=bits, group=group))
            q_run = partial(_call, bk, qfn, x, qw.arrays)
            d_run = partial(_call, bk, jax.jit(pl.linear), x, wd)
        else:
            q_run = partial(_call, bk, pl.quantized_linear, x, qw)
            d_run = partial(_call, bk, pl.linear, x, wd)
        out += [(f"{n}x{k} quantized", q_run), (f"{n}x{k} dense", d_run)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", action="append", default=None)
    ap.add_argument("--dtype", action="append", default=None)
    ap.add_argument("--bits", action="append", type=int, default=None)
    ap.add_argument("--group", type=int, default=32, help="group_size (16: Q6_K's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="calls per timing (the median of them)")
    args = ap.parse_args()
    if "torch" in (args.backend or []):
        import torch

        torch.set_num_threads(1)
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
          f"load average at start: {os.getloadavg()[0]:.1f}")  # fmt: skip
    for backend in args.backend or ["numpy"]:
        for dtype in args.dtype or ["float32", "bfloat16"]:
            if backend == "numpy" and dtype == "bfloat16":
                continue
            for bits in args.bits or [4, 8]:
                cases = _cases(backend, dtype, bits, args.group)
                times: dict[str, list[float]] = {name: [] for name, _ in cases}
                for _, run in cases:  # warm-up (compiles, repacks)
                    run()
                for _ in range(args.rounds):
                    for name, run in cases:
                        ts = []
                        for _ in range(args.reps):
                            t0 = time.perf_counter()
                            run()
                            ts.append(time.perf_counter() - t0)
                        times[name].append(statistics.median(ts))
                load = os.getloadavg()[0]
                for n, k in SHAPES:
                    q = statistics.median(times[f"{n}x{k} quantized"]) * 1e3
                    d = statistics.median(times[f"{n}x{k} dense"]) * 1e3
                    fmt = f"{bits}, g{args.group}"
                    print(f"| {backend} | {dtype} | {fmt} | {n}x{k} | {q:.3f} | {d:.3f} | "
                          f"{d / q:.2f} | {load:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
