"""gpt-oss's MoE block over MXFP4 experts: kept quantized (``moe_experts_mxfp4``) against the
same experts as floats and against dequantizing every expert for the call (what ``moe`` did
before the MXFP4 kernel), per backend, one thread.

    python benchmarks/mxfp4_moe.py [--backend numpy --backend torch ...] [--tokens 1]
        [--hidden 1024] [--experts 32] [--top-k 4] [--rounds 5]

Prints the median milliseconds of one ``moe`` call of ``--tokens`` rows (1: a decode step) per
path and the experts' bytes. gpt-oss-20b's layer is hidden = width = 2880, 32 experts, top-4;
the default shape is smaller so that the float experts fit beside the other jobs' memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

import portable_llm as pl


def _experts(
    rng: np.random.Generator, X: int, rows: int, cols: int, backend: str
) -> pl.MXFP4Weight:
    codes = rng.integers(0, 16, (X, rows, cols)).astype(np.uint32)
    shifts = (4 * np.arange(8)).astype(np.uint32)
    packed = (codes.reshape(X, rows, -1, 8) << shifts).sum(-1, dtype=np.uint32)
    scales = rng.integers(118, 122, (X, rows, cols // 32)).astype(np.uint8)
    return pl.MXFP4Weight(pl.asarray(packed, backend=backend), pl.asarray(scales, backend=backend))


def _time(fn, bk, rounds: int) -> float:
    fn()  # warm (JAX compiles, MLX builds)
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        bk.synchronize(pl.to_numpy(fn()) if bk.name == "mlx" else fn())
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", action="append")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    E = I = a.hidden  # noqa: E741
    X, k = a.experts, a.top_k
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"load {load}, tokens={a.tokens}, E=I={E}, X={X}, top_k={k}")
    for name in a.backend or ["numpy", "torch", "mlx", "jax"]:
        bk = pl.get_backend(name)
        rng = np.random.default_rng(0)
        x = pl.asarray(rng.standard_normal((1, a.tokens, E)).astype(np.float32), backend=name)
        w = pl.asarray((rng.standard_normal((X, E)) / np.sqrt(E)).astype(np.float32),
                       backend=name)  # fmt: skip
        q = [_experts(rng, X, r, c, name) for r, c in ((I, E), (I, E), (E, I))]
        floats = [pl.dequantize(qw) for qw in q]
        kw = {"top_k": k, "norm_topk_prob": True, "swiglu_limit": 7.0}

        def call(experts: list, x: object = x, w: object = w, kw: dict = kw) -> object:
            return pl.moe(x, w, *experts, **kw)

        quant_ms = _time(lambda q=q: call(q), bk, a.rounds)
        float_ms = _time(lambda f=floats: call(f), bk, a.rounds)
        whole_ms = _time(lambda q=q: call([pl.dequantize(qw) for qw in q]), bk, a.rounds)
        mb_q = sum(qw.nbytes for qw in q) / 2**20
        mb_f = sum(int(np.prod(f.shape)) * 4 for f in floats) / 2**20
        print(f"{name:6s} MXFP4 kept {quant_ms:8.2f} ms ({mb_q:.0f} MiB) | float32 experts "
              f"{float_ms:8.2f} ms ({mb_f:.0f} MiB) | dequantize all, then moe {whole_ms:8.2f} ms",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
