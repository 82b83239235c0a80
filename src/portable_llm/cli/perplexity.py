"""``portable-llm perplexity PATH --text FILE``: perplexity on a text, and the KL divergence of
the next-token distributions from a base model (``--kl-base``), as ``llama-perplexity
--kl-divergence`` reports them (:mod:`portable_llm.generation.perplexity`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from portable_llm.cli.options import add_model_arguments, apply_threads, positive_int
from portable_llm.cli.output import (
    Progress,
    activations_note,
    check_usage,
    error,
    path_errors,
    plural,
)

__all__ = ["DEFAULT_TEXT", "add_perplexity_parser", "run_perplexity"]

#: Real English text on every Debian and Ubuntu machine (base-files): the GNU GPL v3, ~7,800
#: tokens for SmolLM2's tokenizer.
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


def add_perplexity_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``perplexity`` subcommand to the ``portable-llm`` subparsers; return its parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "perplexity",
        help="perplexity of a checkpoint on a text, and with --kl-base the KL divergence and "
        "top-1 agreement of its token distributions with a base model's",
    )
    add_model_arguments(p)
    p.add_argument(
        "--text",
        default=DEFAULT_TEXT,
        metavar="FILE",
        help=f"the text to score (UTF-8; default {DEFAULT_TEXT})",
    )
    p.add_argument(
        "--ctx",
        type=positive_int,
        default=512,
        metavar="N",
        help="tokens per chunk, each from an empty cache; the second half of each is scored, as "
        "llama-perplexity -c N scores them (default 512)",
    )
    p.add_argument(
        "--chunks",
        type=positive_int,
        default=None,
        metavar="N",
        help="evaluate at most N chunks (default: every whole chunk of the text)",
    )
    p.add_argument(
        "--kl-base",
        default=None,
        metavar="PATH",
        help="the base to compare with: a checkpoint (loaded like PATH, with --kl-base-dtype) "
        "or a .npy of log-probabilities saved by --save-logprobs on the same text, ctx, chunks",
    )
    p.add_argument(
        "--kl-base-dtype",
        default="float32",
        metavar="DTYPE",
        help="dtype of a --kl-base checkpoint, dequantized (default float32)",
    )
    p.add_argument(
        "--save-logprobs",
        default=None,
        metavar="FILE",
        help="write this run's scored log-probabilities (float32, T x V: large, about 190 KiB "
        "per token for a 49k vocabulary) as a later run's --kl-base",
    )
    return p


def _bar(done: int, total: int, seconds: float, tokens: int) -> str:
    filled = round(20 * done / total)
    speed = done * tokens / seconds if seconds > 0 else 0.0
    return f"[{'#' * filled}{'.' * (20 - filled)}] chunk {done}/{total}, {speed:.1f} tok/s"


def run_perplexity(
    args: argparse.Namespace,
    out: TextIO | None = None,
    *,
    usage: argparse.ArgumentParser | None = None,
) -> int:
    """Load, score the text, print perplexity (and KL against the base); return the exit
    code. Progress goes to stderr, one line per chunk (a bar on a terminal)."""
    from portable_llm.checkpoint.loader import load
    from portable_llm.generation.perplexity import (
        adds_bos,
        load_logprobs,
        perplexity,
        save_logprobs,
    )

    out = out if out is not None else sys.stdout
    base_path = args.kl_base
    saved_base = base_path is not None and base_path.endswith(".npy")
    check_usage(usage, [
        *path_errors([("path", args.path), ("--text", args.text)]),
        *([] if base_path is None else path_errors([("--kl-base", base_path)])),
    ])  # fmt: skip
    threads = apply_threads(getattr(args, "threads", None), [args.backend])
    progress = Progress("perplexity")
    try:
        progress(f"loading {args.path} on {args.backend} ({plural(threads, 'thread')}) ...")
        start = time.perf_counter()
        model = load(
            args.path, backend=args.backend, dtype=args.dtype, device=args.device,
            dequantize=args.dequantize, activations=args.activations,
        )  # fmt: skip
        if model.tokenizer is None:
            raise ValueError(f"{args.path} has no tokenizer: perplexity needs one to read --text")
        base: Any = None
        if saved_base:
            base = load_logprobs(base_path)
        elif base_path is not None:
            progress(f"loading the base {base_path} ({args.kl_base_dtype}) ...")
            base = load(
                base_path, backend=args.backend, dtype=args.kl_base_dtype, device=args.device,
                dequantize=True,
            )  # fmt: skip
        loaded = time.perf_counter() - start
        text = Path(args.text).read_text(encoding="utf-8")
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        bos = adds_bos(model.tokenizer)
        kept: list[Any] = []
        keep = kept.append if args.save_logprobs else None

        def report(done: int, total: int, seconds: float) -> None:
            progress(_bar(done, total, seconds, args.ctx))

        result = perplexity(
            model, ids, ctx=args.ctx, chunks=args.chunks, base=base, bos=bos, keep=keep,
            progress=report,
        )  # fmt: skip
    except (OSError, ValueError, ImportError) as exc:
        error("perplexity", exc)
        return 1
    scored = f"{result.tokens} tokens scored: the second half of {result.chunks} chunks"
    print(f"text: {args.text} ({len(ids)} tokens; {scored} of {args.ctx})", file=out)
    print(f"model: {model!r}; load {loaded:.2f} s", file=out)
    ppl, err = result.perplexity, result.perplexity_error
    print(f"perplexity: {ppl:.4f} +/- {err:.4f}", file=out)
    if result.kl is not None:
        print(
            f"KL divergence from the base: mean {result.kl_mean:.6f}, median "
            f"{result.kl_quantile(0.5):.6f}, 99th percentile {result.kl_quantile(0.99):.6f}, "
            f"max {float(result.kl.max()):.6f} (nats)",
            file=out,
        )
        print(f"same top token as the base: {100 * result.top1_agreement:.2f} %", file=out)
    speed = result.tokens_per_second
    evaluated = f"{result.chunks * args.ctx} tokens evaluated"
    print(f"speed: {speed:.1f} tok/s{activations_note(model)} ({evaluated})", file=out)
    if args.save_logprobs:
        written = save_logprobs(args.save_logprobs, kept)
        print(f"saved the scored log-probabilities to {written}", file=out)
    return 0
