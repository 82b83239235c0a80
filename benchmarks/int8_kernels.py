"""Per-projection kernel times of the 8-bit activation mode (issue 30) against the exact mode,
the dense floats and torch's own integer kernels, at SmolLM2-135M's projection shapes, for one
row of x (decode) and 128 rows (a prompt).

Every case runs once per round, rounds interleaved, and the table gives the median over the
rounds of each round's mean call time; one thread (``OMP_NUM_THREADS=1`` and the others set
below before NumPy loads, ``torch.set_num_threads(1)``). The CPU flags and the load average are
printed with the table. Not part of CI.

    python benchmarks/int8_kernels.py --rounds 5

Rows (``impl``):

- ``int8``: ``quantized_linear(..., activations="int8")`` as a bound model runs it (the
  dispatcher's choice, specialized for the weight: numba's repacked kernel for a few rows, the
  Q8_0 blocks' values times the dequantized weight for a prompt);
- ``exact``: ``quantized_linear`` (``auto``) in the same dtype; ``dense``: the dequantized
  floats' product (``linear``);
- torch only, for the record (none keeps the mode's meaning as it is): ``_int_mm``: one int8 x
  int8 -> int32 product over the whole of K (no per-block scales: the weight's groups would
  need one call per block); ``_int_mm/block``: one call per block of 32, the integer part alone;
  ``linear_dynamic``: fbgemm's dynamic int8 linear (per-tensor activations, per-channel
  weights); ``int8pack``: ``_weight_int8pack_mm`` (float activations, int8 per-channel weights).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import portable_llm as pl  # noqa: E402
from portable_llm.core.dispatch import dispatcher  # noqa: E402

#: SmolLM2-135M's projections (N, K, bits): q/o, k/v, gate/up, down (Q4_1: 4 bits), and the
#: tied LM head (the file's Q8_0 embedding: 8 bits; decode only).
SHAPES = ((576, 576, 4), (192, 576, 4), (1536, 576, 4), (576, 1536, 4), (49152, 576, 8))


def _bound(backend: str, x: Any, qw: pl.QuantizedWeight) -> Callable[[], Any]:
    """``quantized_linear(x, qw, activations="int8")`` as a bound model calls it."""
    d = dispatcher(pl.get_backend(backend))
    fmt = {"bits": qw.bits, "group_size": qw.group_size}
    fn = d.pick("quantized_linear_int8", "auto", x, *qw.arrays, None, **fmt)
    fast = d.specialized("quantized_linear_int8", fn, x, *qw.arrays, None, **fmt)
    xp = d.backend.xp
    if fast is not None:
        return lambda: fast(xp, x, None)
    return lambda: fn(xp, x, *qw.arrays, None, **fmt)


def _torch_cases(n: int, k: int, m: int, w: np.ndarray, qw: pl.QuantizedWeight) -> dict:
    import torch

    xt = torch.from_numpy(np.random.default_rng(1).uniform(-1, 1, (m, k)).astype(np.float32))
    qt = qw.to("torch")
    wd = torch.from_numpy(w)
    xb, qb, wb = xt.bfloat16(), qw.to("torch"), wd.bfloat16()
    qb = pl.QuantizedWeight(qb.packed, qb.scales.bfloat16(), qb.biases.bfloat16(),
                            bits=qw.bits, group_size=qw.group_size)  # fmt: skip
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    wq = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    wq_t = wq.t()  # (K, N), column-major: the layout _int_mm reads fastest (measured)
    blocks = [(xq[:, j : j + 32].contiguous(), wq[:, j : j + 32].t()) for j in range(0, k, 32)]
    sc = torch.rand(n) * 0.01 + 1e-3
    packed = torch.ops.quantized.linear_prepack(
        torch.quantize_per_channel(wd, sc.double(), torch.zeros(n, dtype=torch.long), 0,
                                   torch.qint8), None,
    )  # fmt: skip
    return {
        ("torch", "float32", "int8"): _bound("torch", xt, qt),
        ("torch", "float32", "exact"): lambda: pl.quantized_linear(xt, qt),
        ("torch", "float32", "dense"): lambda: torch.nn.functional.linear(xt, wd),
        ("torch", "bfloat16", "exact"): lambda: pl.quantized_linear(xb, qb),
        ("torch", "bfloat16", "dense"): lambda: torch.nn.functional.linear(xb, wb),
        ("torch", "int8", "_int_mm"): lambda: torch._int_mm(xq, wq_t),
        ("torch", "int8", "_int_mm/block"): lambda: [torch._int_mm(a, b) for a, b in blocks],
        ("torch", "float32", "linear_dynamic"): lambda: torch.ops.quantized.linear_dynamic(
            xt, packed
        ),
        ("torch", "bfloat16", "int8pack"): lambda: torch.ops.aten._weight_int8pack_mm(
            xb, wq, sc.bfloat16()
        ),
    }


def _cases(backends: list[str], m: int) -> dict[tuple[Any, ...], Callable[[], Any]]:
    rng = np.random.default_rng(0)
    out: dict[tuple[Any, ...], Callable[[], Any]] = {}
    for n, k, bits in SHAPES:
        if m > 1 and n > 4096:
            continue  # a prompt's LM head runs on its last row only
        w = rng.uniform(-0.05, 0.05, (n, k)).astype(np.float32)
        qw = pl.quantize(w, bits=bits, group_size=32)
        wd = pl.dequantize(qw)  # the dense rows multiply the same floats
        x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
        shape = f"{n}x{k} {bits}-bit"
        if "numpy" in backends:
            out[shape, "numpy", "float32", "int8"] = _bound("numpy", x, qw)
            out[shape, "numpy", "float32", "exact"] = lambda x=x, qw=qw: pl.quantized_linear(x, qw)
            out[shape, "numpy", "float32", "dense"] = lambda x=x, wd=wd: x @ wd.T
        if "torch" in backends:
            for key, fn in _torch_cases(n, k, m, wd, qw).items():
                out[(shape, *key)] = fn
    return out


def _time(fn: Callable[[], Any], budget: float) -> float:
    """Mean seconds of one call over about ``budget`` seconds (at least 3 calls)."""
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(3, int(budget / one))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":")[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    keep = [f for f in flags if f.startswith(("avx2", "avx512", "amx"))]
    return " ".join(sorted(keep)) or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", action="append", default=None, help="numpy, torch")
    ap.add_argument("--rows", type=int, action="append", default=None, help="default 1 and 128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per case per round")
    args = ap.parse_args()
    backends = args.backend or ["numpy", "torch"]
    if "torch" in backends:
        import torch

        torch.set_num_threads(1)
    print(f"CPU flags: {_flags()}")
    for m in args.rows or [1, 128]:
        cases = _cases(backends, m)
        for fn in cases.values():  # warm-up: numba's compiles, the repacks, allocators
            fn()
        times: dict[tuple[Any, ...], list[float]] = {key: [] for key in cases}
        loads = [os.getloadavg()[0]]
        for _ in range(args.rounds):
            for key, fn in cases.items():
                times[key].append(_time(fn, args.budget))
            loads.append(os.getloadavg()[0])
        print(f"\nrows of x: {m}; {args.rounds} rounds, load average {min(loads):.1f}-"
              f"{max(loads):.1f}")  # fmt: skip
        print("| shape | backend | dtype | impl | us per call |")
        print("|---|---|---|---|---|")
        for key, ts in times.items():
            print(f"| {' | '.join(map(str, key))} | {statistics.median(ts) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
