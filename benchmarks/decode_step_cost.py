"""Where a bound decode step's time goes (issue 30): at batch 1, one thread, the per-token time
of a loaded ``.gguf`` model split into its quantized projections' kernels, torch's other ops
and the interpreter, with the calls per step.

- step: decode seconds per token of a greedy generation (median of 3);
- projection kernels: the time inside numba's compiled kernels (``numba_cpu.run``: the
  activations' blocks and the integer products; the int8 mode), calls per step;
- torch ops: the ``aten::`` ops per step and their self CPU time under ``torch.profiler``
  (the profiler's own cost inflates that time: an upper bound);
- Python calls per step (``cProfile``'s count) and the rest: step minus the two above, the
  interpreter's share (a lower bound, by the same inflation).

Per-step figures are the difference of a 17-token and a 1-token generation, divided by 16.

    python benchmarks/decode_step_cost.py SmolLM2-135M-Instruct.Q4_1.gguf --backend torch
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import portable_llm as pl  # noqa: E402
from portable_llm.native import numba_cpu  # noqa: E402

N = 17


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("file", type=Path)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--activations", default="int8")
    args = ap.parse_args()
    if args.backend == "torch":
        import torch

        torch.set_num_threads(1)
    model = pl.load(args.file, backend=args.backend, activations=args.activations)
    ids = np.random.default_rng(0).integers(100, 1000, size=32).tolist()

    def gen(n: int) -> Any:
        g = pl.generate(model, ids, max_new_tokens=n, stop=())
        for _ in g:
            pass
        return g.stats

    gen(4)
    step = statistics.median(gen(N).decode_seconds / (N - 1) for _ in range(3))
    kernel_s, kernel_n = _kernels(gen)
    calls = (_calls(gen, N) - _calls(gen, 1)) / (N - 1)
    line = (f"{args.file.name} {args.backend} {args.activations}: step {step * 1e6:.0f} us "
            f"({1 / step:.1f} tok/s); projection kernels {kernel_n:.0f} calls "
            f"{kernel_s * 1e6:.0f} us")  # fmt: skip
    ops_s = 0.0
    if args.backend == "torch":
        ops_s, ops_n = _aten(gen)
        line += f"; torch ops {ops_n:.0f} calls {ops_s * 1e6:.0f} us (profiled self CPU)"
    rest = max(step - kernel_s - ops_s, 0.0)
    print(f"{line}; Python calls {calls:.0f}/step; rest (interpreter) {rest * 1e6:.0f} us; "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip


def _kernels(gen: Any) -> tuple[float, float]:
    """Seconds and calls per step inside numba's kernels."""
    acc = [0.0, 0]
    run = numba_cpu.run

    def timed(pre: Any, x: Any) -> Any:
        t0 = time.perf_counter()
        y = run(pre, x)
        acc[0] += time.perf_counter() - t0
        acc[1] += 1
        return y

    numba_cpu.run = timed  # type: ignore[assignment]
    try:
        gen(1)
        one = list(acc)
        acc[:] = [0.0, 0]
        gen(N)
    finally:
        numba_cpu.run = run  # type: ignore[assignment]
    return (acc[0] - one[0]) / (N - 1), (acc[1] - one[1]) / (N - 1)


def _calls(gen: Any, n: int) -> int:
    prof = cProfile.Profile()
    prof.enable()
    gen(n)
    prof.disable()
    return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]


def _aten(gen: Any) -> tuple[float, float]:
    """Self CPU seconds and calls per step of torch's aten ops."""
    from torch.profiler import ProfilerActivity, profile

    def once(n: int) -> tuple[float, int]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            gen(n)
        ev = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        return sum(e.self_cpu_time_total for e in ev) / 1e6, sum(e.count for e in ev)

    (t1, n1), (tn, nn) = once(1), once(N)
    return (tn - t1) / (N - 1), (nn - n1) / (N - 1)


if __name__ == "__main__":
    main()
