"""The KL divergence of the 8-bit-activation mode on real text, beside the exact mode's and
llama.cpp's own (issue 30; the table in benchmarks/README.md, the decision in docs/gguf.md).

For one ``.gguf`` file: the base is the same file dequantized to float64 (``--base-dtype``) on
NumPy (``dequantize=True``); then ``pl.load(file, activations=MODE, dequantize=False)`` for the
exact (``float``) and the ``int8`` mode, and llama.cpp (``llama-cpp-python``, when importable:
its logits of every position, ``logits_all=True``, over the same token ids) are each scored
by :func:`portable_llm.perplexity` against the base's log-probabilities: perplexity, KL mean
and 99th percentile, top-1 agreement. Every engine runs one thread. Not part of CI.

    python benchmarks/int8_kl.py SmolLM2-135M-Instruct.Q4_1.gguf --chunks 3
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import portable_llm as pl  # noqa: E402
from portable_llm.cli.model_bench import LlamaCppLogits  # noqa: E402
from portable_llm.generation.perplexity import adds_bos  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"


def _row(name: str, r: Any) -> str:
    return (
        f"| {name} | {r.perplexity:.4f} +/- {r.perplexity_error:.4f} | {r.kl_mean:.6f} | "
        f"{r.kl_quantile(0.99):.6f} | {100 * r.top1_agreement:.2f} % | "
        f"{r.tokens_per_second:.1f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("file", type=Path)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--backend", default="numpy", help="of the two modes (the base: NumPy)")
    ap.add_argument(
        "--base-dtype",
        default="float64",
        help="of the dequantized base (float32 for a large vocabulary: Gemma's 262k rows of "
        "float64 logits and weights ran out of memory)",
    )
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument(
        "--llama-site",
        default=None,
        help="a site-packages folder holding llama_cpp (another venv's), appended to sys.path",
    )
    args = ap.parse_args()
    if args.llama_site:
        sys.path.append(args.llama_site)
    opts = {"ctx": args.ctx, "chunks": args.chunks}
    print(f"{args.file.name}, {args.text}, ctx {args.ctx}, {args.chunks} chunks", flush=True)
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    base = pl.load(args.file, backend="numpy", dtype=args.base_dtype, dequantize=True)
    tok = base.tokenizer
    ids = tok.encode(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False)
    bos = adds_bos(tok)
    kept: list[np.ndarray] = []
    start = time.perf_counter()
    pl.perplexity(base, ids, **opts, bos=bos, keep=kept.append)
    rows = sum(k.shape[0] for k in kept)
    big = rows * base.vocab_size * 8 > 2**30  # over 1 GiB: keep float32 (Gemma's 262k vocab)
    saved = np.concatenate([k.astype(np.float32) if big else k for k in kept])
    del kept
    took = time.perf_counter() - start
    print(f"base ({args.base_dtype} dequantized, numpy): {took:.1f} s", flush=True)
    print("| engine | perplexity | KL mean | KL p99 | top-1 | tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    del base
    for mode in ("float", "int8"):
        model = pl.load(args.file, backend=args.backend, activations=mode, dequantize=False)
        r = pl.perplexity(model, ids, **opts, bos=bos, base=saved)
        print(_row(f"portable_llm {args.backend} {mode}", r), flush=True)
        del model
    if not args.no_llama:
        try:
            peer = LlamaCppLogits(args.file, args.ctx)
        except ImportError as exc:
            print(f"llama.cpp: not importable ({exc})")
        else:
            print(_row("llama.cpp", pl.perplexity(peer, ids, **opts, bos=bos, base=saved)))
    print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)


if __name__ == "__main__":
    main()
