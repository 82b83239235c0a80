"""``portable-llm batch PATH --prompt A --prompt B ...``: several prompts through the batch
generator (:class:`~portable_llm.generation.batch.BatchGenerator`); prints each request's stream,
prefixed by its id, then each whole text and the aggregate tokens/s."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from portable_llm.cli.options import (
    add_engine_arguments,
    add_model_arguments,
    add_sampling_arguments,
    apply_threads,
    sampling_options,
    token_ids,
)
from portable_llm.cli.output import (
    Progress,
    activations_note,
    check_usage,
    error,
    path_errors,
    plural,
    wrap,
)

__all__ = ["add_batch_parser", "run_batch"]


def add_batch_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``batch`` subcommand to the ``portable-llm`` subparsers; return its parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "batch",
        help="generate for several prompts at once (continuous batching); prints each "
        "request's stream and the aggregate tokens/s",
    )
    add_model_arguments(p)
    p.add_argument(
        "--prompt", action="append", default=[], help="a prompt text (repeatable; needs "
        "the checkpoint's tokenizer)",
    )  # fmt: skip
    p.add_argument(
        "--ids", action="append", type=token_ids, default=[], metavar="1,2,3",
        help="a prompt as comma-separated token ids (repeatable; no tokenizer needed)",
    )  # fmt: skip
    add_sampling_arguments(p)
    add_engine_arguments(p)
    return p


def run_batch(
    args: argparse.Namespace,
    out: TextIO | None = None,
    *,
    usage: argparse.ArgumentParser | None = None,
) -> int:
    """Load, run every prompt through one batch generator, print; return the exit code.

    A usage error goes to ``usage.error`` (exit 2), or raises :class:`UsageError` without one.
    """
    from portable_llm.checkpoint.loader import load
    from portable_llm.generation.batch import BatchGenerator, Request
    from portable_llm.generation.sampler import make_sampler

    out = out if out is not None else sys.stdout
    check_usage(usage, [
        (not args.prompt and not args.ids, "give at least one --prompt or --ids"),
        (args.chat and bool(args.ids), "--chat needs text prompts (--prompt), not --ids"),
        *path_errors([("path", args.path)]),
    ])  # fmt: skip
    threads = apply_threads(getattr(args, "threads", None), [args.backend])
    progress = Progress("batch")
    try:
        progress(f"loading {args.path} on {args.backend} ({plural(threads, 'thread')}) ...")
        with progress.still("loading"):
            model = load(
                args.path, backend=args.backend, dtype=args.dtype, device=args.device,
                dequantize=args.dequantize, activations=args.activations,
            )  # fmt: skip
        tok = model.tokenizer
        if args.prompt and tok is None:
            raise ValueError(f"{args.path} has no tokenizer.json: a text --prompt needs one")
        if args.chat:  # transformers' chat ids: the template writes its own BOS
            rows = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
                    for p in args.prompt]  # fmt: skip
        else:
            rows = [tok.encode_prompt(p) for p in args.prompt]
        rows += list(args.ids)
        gen = BatchGenerator(model, max_batch=args.max_batch, prefill_chunk=args.prefill_step_size)
        options = sampling_options(args)
        ids = []
        for i, r in enumerate(rows):
            seed = None if options["seed"] is None else options["seed"] + i  # one per request
            sampler = make_sampler(**{**options, "seed": seed})
            ids.append(gen.add(Request(r, args.max_new_tokens, sampler=sampler)))
        progress(f"{len(ids)} requests; prefill and decode ...")
    except (OSError, ValueError, TypeError, ImportError) as exc:
        error("batch", exc)
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
    speed = total / seconds if seconds else 0.0
    line = f"{len(ids)} requests, {total} new tokens in {seconds:.3f} s: {speed:.1f} tokens/s"
    line += activations_note(model)
    print(wrap(line + " (aggregate, prefill included)"), file=out)
    return 0
