"""Decode tokens/s of portable_llm next to transformers and mlx-lm: medians of interleaved rounds.

``portable-llm bench --model`` times each engine once after a warm-up, one engine after the
other; on a shared machine the load moves between them. Here every engine is loaded first,
warmed up once, then each round runs every engine once in turn (greedy, a 128-token prompt,
``--new`` tokens, ``stop=()``), and the table gives each engine's median decode tokens/s and
its ratio to the peer beside it. The runners are ``portable_llm.cli.model_bench``'s, plus
mlx-lm's own pipelined ``generate_step`` and, on MLX, portable_llm without its compiled step.

    python benchmarks/decode_rounds.py --model FOLDER --backend torch --backend mlx --rounds 7
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from portable_llm.cli import model_bench as mb

Run = Callable[[], float]  # one generation -> decode tokens/s


def _decode_rate(runner: mb.Runner, ids: np.ndarray, n: int) -> Run:
    def run() -> float:
        _, seconds = runner(ids, n)
        return (n - 1) / seconds

    return run


def _ours_eager(folder: Path, backend: str, dtype: str, ids: np.ndarray, n: int) -> Run:
    """portable_llm with the compiled step switched off (the eager prepared forward)."""
    from portable_llm.checkpoint.loader import load
    from portable_llm.generation.generate import generate

    model = copy.copy(load(folder, backend=backend, dtype=dtype))
    model.compiled = None

    def run() -> float:
        gen = generate(model, ids[0], max_new_tokens=n, stop=())
        for _ in gen:
            pass
        return (n - 1) / gen.stats.decode_seconds

    return run


def _mlx_lm_generate_step(folder: Path, dtype: str, ids: np.ndarray, n: int) -> Run:
    """mlx-lm's own loop: ``generate_step`` (``mx.async_eval`` pipelining)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())

    def run() -> float:
        steps = generate_step(mx.array(ids[0]), model, max_tokens=n)
        next(steps)  # the prefill and the first token
        start = time.perf_counter()
        for _ in steps:
            pass
        return (n - 1) / (time.perf_counter() - start)

    return run


def engines(folder: Path, backend: str, dtype: str, ids: np.ndarray, n: int) -> dict[str, Run]:
    out = {f"portable_llm {backend}": _decode_rate(mb._ours(folder, backend, dtype)[1], ids, n)}
    if backend == "mlx":
        out["portable_llm mlx, eager step"] = _ours_eager(folder, backend, dtype, ids, n)
        out["mlx-lm generate_step"] = _mlx_lm_generate_step(folder, dtype, ids, n)
        out["mlx-lm plain loop"] = _decode_rate(mb._mlx_lm(folder, dtype)[1], ids, n)
    if backend == "torch":
        out["transformers"] = _decode_rate(mb._transformers(folder, dtype)[1], ids, n)
    return out


def interleaved(
    folder: Path, backends: list[str], dtype: str, rounds: int, new: int
) -> tuple[dict[str, list[float]], list[float]]:
    """Every engine's decode tokens/s per round (each round runs every engine once, in turn,
    after one warm-up run each) and the load average after each round."""
    # Ids below 1000, as the bench's: the tiny model's vocabulary is 1024.
    ids = np.random.default_rng(0).integers(0, 1000, size=(1, mb.PREFILL))
    runs: dict[str, Run] = {}
    for backend in backends:
        runs.update(engines(folder, backend, dtype, ids, new))
    for run in runs.values():  # warm-up: compilation, allocators
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    loads = []
    for _ in range(rounds):
        for name, run in runs.items():
            rates[name].append(run())
        loads.append(os.getloadavg()[0])
    return rates, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: the tiny one)")
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new", type=int, default=mb.DECODE, help="new tokens per run")
    args = parser.parse_args()
    folder = args.model or mb.write_bench_checkpoint(config=mb.TINY)
    backends = args.backend or ["torch", "mlx"]
    rates, loads = interleaved(folder, backends, args.dtype, args.rounds, args.new)
    print(
        f"{folder.name}, {args.dtype}, {args.new} new tokens after {mb.PREFILL}, "
        f"{args.rounds} interleaved rounds, load average {min(loads):.1f}-{max(loads):.1f}"
    )
    for name, values in rates.items():
        print(
            f"{name:32s} median {np.median(values):8.1f} tok/s   "
            f"(rounds: {', '.join(f'{v:.0f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
