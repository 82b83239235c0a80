"""Decode tokens/s of portable_llm on torch next to HF transformers, token by token.

    python benchmarks/torch_decode.py [--model PATH | --tiny] [--dtype float32] [--new 32]
                                      [--passes 3]

One process, one thread (``torch.set_num_threads(1)``: on a shared 2-core machine two spinning
threads per library fight each other). After the same 128-token prompt, each engine decodes
its next token right after the other engines' same token, so that all of them see the same
machine load; the rates are ``1 / median`` of the per-token times (after one warm-up pass):

- ``loop``: ``model.decode_step`` and an argmax read back (the model alone);
- ``generate``: one step of ``portable_llm.generate`` (greedy, no stop tokens);
- ``transformers``: the HF model with its KV cache, under ``torch.no_grad``, argmax read back.

``--model``: a checkpoint folder (default: the float32 SmolLM2-135M folder of
``benchmarks/batch.py``); ``--tiny``: the 2-layer, E=64 model of ``portable-llm bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from portable_llm.checkpoint.loader import load
from portable_llm.cli.model_bench import TINY, write_bench_checkpoint
from portable_llm.generation.generate import generate


def measure(folder: Path, dtype: str, new: int, passes: int) -> dict[str, float]:
    """Tokens/s of each engine (``1 / median`` per-token seconds) and the load averages."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(0).integers(0, min(vocab, 1000), size=(1, 128))
    model = load(folder, backend="torch", dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    hf.eval()
    times: dict[str, list[float]] = {"loop": [], "generate": [], "transformers": []}
    loads = []
    for p in range(passes + 1):  # pass 0 warms up
        cache = model.make_cache()
        tok = model(ids, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        steps = iter(generate(model, ids[0], max_new_tokens=new + 1, stop=()))
        next(steps)
        with torch.no_grad():
            out = hf(torch.from_numpy(ids), use_cache=True)
        past, hf_tok = out.past_key_values, out.logits[:, -1, :].argmax(-1, keepdim=True)
        for _ in range(new):
            t0 = time.perf_counter()
            tok = model.decode_step(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
            tok.item()
            t1 = time.perf_counter()
            next(steps)
            t2 = time.perf_counter()
            with torch.no_grad():
                out = hf(hf_tok, past_key_values=past, use_cache=True)
            past, hf_tok = out.past_key_values, out.logits[:, -1, :].argmax(-1, keepdim=True)
            hf_tok.item()
            t3 = time.perf_counter()
            if p:
                times["loop"].append(t1 - t0)
                times["generate"].append(t2 - t1)
                times["transformers"].append(t3 - t2)
        loads.append(os.getloadavg()[0])
    rates = {k: 1.0 / statistics.median(v) for k, v in times.items()}
    return {**rates, "load_min": min(loads), "load_max": max(loads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.tiny:
        folder = write_bench_checkpoint(None, TINY)
    elif args.model is not None:
        folder = args.model
    else:
        from batch import smollm2_folder  # benchmarks/batch.py, beside this file

        folder = smollm2_folder()
    r = measure(folder, args.dtype, args.new, args.passes)
    hf = r["transformers"]
    print(
        f"{folder.name} {args.dtype} ({args.passes} x {args.new} tokens, 1 thread, load "
        f"{r['load_min']:.1f}-{r['load_max']:.1f}): loop {r['loop']:.1f} tok/s "
        f"({r['loop'] / hf:.2f}x), generate {r['generate']:.1f} ({r['generate'] / hf:.2f}x), "
        f"transformers {hf:.1f}"
    )


if __name__ == "__main__":
    main()
