"""``portable-llm generate PATH --prompt ...``: stream a checkpoint's continuation of a prompt."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

__all__ = ["add_generate_parser", "run_generate"]


def add_generate_parser(sub: Any) -> None:
    """Add the ``generate`` subcommand to the ``portable-llm`` subparsers."""
    p = sub.add_parser(
        "generate",
        help="stream the continuation of a prompt by a checkpoint folder; prints prefill and "
        "decode tokens/s at the end",
    )
    p.add_argument("path", help="checkpoint folder (config.json, model.safetensors, tokenizer)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--backend", default="numpy", help="array library to run on (default numpy)")
    p.add_argument("--dtype", default=None, help="weights dtype (default: the checkpoint's)")
    p.add_argument(
        "--device", default=None, help="cpu, gpu, cuda:0, mps, ... (default: the backend's)"
    )
    p.add_argument("--max-new-tokens", type=int, default=50, metavar="N", help="default 50")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--min-p", type=float, default=None, metavar="P")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template"
    )


def run_generate(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load, stream the tokens to ``out`` (stdout), then print the speeds; return the exit code."""
    from portable_llm.models.generate import generate
    from portable_llm.models.loader import load

    out = out if out is not None else sys.stdout
    err = sys.stderr
    try:
        start = time.perf_counter()
        model = load(args.path, backend=args.backend, dtype=args.dtype, device=args.device)
        loaded = time.perf_counter() - start
        prompt = args.prompt
        if args.chat:
            if model.tokenizer is None:
                raise ValueError("--chat needs the checkpoint's tokenizer.json")
            prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        gen = generate(
            model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        )  # fmt: skip
        for piece in gen:
            print(piece, end="", file=out, flush=True)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"portable-llm generate: error: {exc}", file=err)
        return 1
    s = gen.stats
    print(file=out)
    print(
        f"load {loaded:.2f} s ({model!r})\n"
        f"prefill: {s.prompt_tokens} tokens in {s.prefill_seconds:.3f} s, "
        f"{s.prefill_tokens_per_second:.1f} tokens/s\n"
        f"decode: {s.decode_steps} tokens in {s.decode_seconds:.3f} s, "
        f"{s.decode_tokens_per_second:.1f} tokens/s",
        file=out,
    )
    return 0
