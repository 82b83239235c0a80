"""Whole greedy decode of a ``.gguf`` file in the float and the int8 activation modes (issue 30:
the speed half of ``activations="auto"``'s rule), one thread, interleaved rounds, medians.

Each mode loads the file as ``pl.load(file, backend=..., activations=MODE)`` does by default
(``dequantize="auto"``: the float mode keeps the codes only where the measured rule says they
decode faster, the int8 mode keeps every code), reads a 128-token prompt, then decodes
``--new`` tokens; the rounds alternate the modes so that a change in the machine's load reaches
both. Not part of CI.

    python benchmarks/int8_decode.py SmolLM2-135M-Instruct.Q4_1.gguf --backend numpy torch
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import portable_llm as pl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("file", type=Path)
    ap.add_argument("--backend", nargs="+", default=["numpy", "torch"])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    ids = np.random.default_rng(0).integers(100, 1000, size=128).tolist()
    print(f"{args.file.name}; load {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    for backend in args.backend:
        models = {m: pl.load(args.file, backend=backend, activations=m) for m in ("float", "int8")}
        rates: dict[str, list[float]] = {m: [] for m in models}
        prefill: dict[str, list[float]] = {m: [] for m in models}
        for _ in range(args.rounds + 1):  # the first round warms up (numba, allocators)
            for mode, model in models.items():
                gen = pl.generate(model, ids, max_new_tokens=args.new, stop=())
                for _ in gen:
                    pass
                rates[mode].append(gen.stats.decode_tokens_per_second)
                prefill[mode].append(gen.stats.prefill_tokens_per_second)
        for mode in models:
            d, p = statistics.median(rates[mode][1:]), statistics.median(prefill[mode][1:])
            print(f"{backend} float32 {mode}: decode {d:.1f} tok/s, prefill {p:.1f} tok/s "
                  f"(rounds {[round(r, 1) for r in rates[mode][1:]]})", flush=True)  # fmt: skip
    print(f"load after {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
