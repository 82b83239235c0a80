"""``portable-llm batch PATH --prompt A --prompt B ...``: several prompts through the batch
generator (:class:`~portable_llm.generation.batch.BatchGenerator`); prints each request's stream,
prefixed by its id, then each whole text and the aggregate tokens/s."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from portable_llm.cli.generate import _ids

__all__ = ["add_batch_parser", "run_batch"]


def add_batch_parser(sub: Any) -> None:
    """Add the ``batch`` subcommand to the ``portable-llm`` subparsers."""
    p = sub.add_parser(
        "batch",
        help="generate for several prompts at once (continuous batching); prints each "
        "request's stream and the aggregate tokens/s",
    )
    p.add_argument("path", help="checkpoint folder (config.json, model.safetensors, tokenizer)")
    p.add_argument(
        "--prompt", action="append", default=[], help="a prompt text (repeatable; needs "
        "the checkpoint's tokenizer.json)",
    )  # fmt: skip
    p.add_argument(
        "--ids", action="append", type=_ids, default=[], metavar="1,2,3",
        help="a prompt as comma-separated token ids (repeatable; no tokenizer needed)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=50, metavar="N", help="per request (50)")
    p.add_argument("--backend", default="numpy", help="array library to run on (default numpy)")
    p.add_argument("--dtype", default=None, help="weights dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="the backend's device (default its own)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N", help="default 8")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N", help="default 512")


def run_batch(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load, run every prompt through one batch generator, print; return the exit code."""
    from portable_llm.checkpoint.loader import load
    from portable_llm.generation.batch import BatchGenerator, Request

    out = out if out is not None else sys.stdout
    try:
        if not args.prompt and not args.ids:
            raise ValueError("give at least one --prompt or --ids")
        model = load(args.path, backend=args.backend, dtype=args.dtype, device=args.device)
        tok = model.tokenizer
        if args.prompt and tok is None:
            raise ValueError(f"{args.path} has no tokenizer.json: a text --prompt needs one")
        rows = [tok.encode_prompt(p) for p in args.prompt] + list(args.ids)
        gen = BatchGenerator(model, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk)
        ids = [gen.add(Request(r, args.max_tokens)) for r in rows]
    except (FileNotFoundError, ValueError, TypeError, ImportError) as exc:
        print(f"portable-llm batch: error: {exc}", file=sys.stderr)
        return 1
    texts = len(args.prompt)  # the first requests are text prompts
    streams = {rid: tok.stream_decoder() for rid in ids[:texts]} if tok is not None else {}
    new: dict[int, list[int]] = {rid: [] for rid in ids}
    reasons: dict[int, str] = {}
    start = time.perf_counter()
    while gen.has_work:
        for rid, token, reason in gen.step():
            piece = ""
            if reason != "stop":  # a stop token is not part of the text
                new[rid].append(token)
                piece = streams[rid].step(token) if rid in streams else str(token)
            if reason is not None:
                reasons[rid] = reason
                piece += streams[rid].finish() if rid in streams else ""
            if piece:
                print(f"[{rid}] {piece!r}", file=out, flush=True)
    seconds = time.perf_counter() - start
    total = sum(len(v) for v in new.values())
    for rid in ids:
        body = tok.decode(new[rid]) if rid in streams else ",".join(map(str, new[rid]))
        print(f"--- [{rid}] {reasons[rid]}, {len(new[rid])} tokens\n{body}", file=out)
    print(
        f"{len(ids)} requests, {total} new tokens in {seconds:.3f} s: "
        f"{total / seconds if seconds else 0.0:.1f} tokens/s (aggregate, prefill included)",
        file=out,
    )
    return 0
