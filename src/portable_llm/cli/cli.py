"""The ``portable-llm`` command: ``report`` (accuracy, the default), ``bench`` (speed),
``generate`` (a checkpoint's continuation of a prompt) and ``batch`` (several prompts at once).

Exit status: 0 success, 1 a failed run (a row outside tolerance, a failed gate, a checkpoint that
does not load), 2 a usage error (an unknown flag or name, a value out of range, a path that does
not exist), always as one message without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from portable_llm.cli.batch import add_batch_parser, run_batch
from portable_llm.cli.generate import add_generate_parser, run_generate
from portable_llm.cli.options import (
    Parser,
    add_activations_argument,
    add_selection_arguments,
    add_threads_argument,
    apply_threads,
    positive_int,
)
from portable_llm.cli.output import UsageError, error
from portable_llm.cli.perplexity import add_perplexity_parser, run_perplexity
from portable_llm.cli.serve import add_serve_parser, run_serve
from portable_llm.core.version import __version__

__all__ = ["main", "parser"]

COMMANDS = ("report", "bench", "generate", "batch", "serve", "perplexity")


def parser() -> Parser:
    """The ``portable-llm`` argument parser, with one subparser per command."""
    top = Parser(
        prog="portable-llm",
        description="portable_llm ops on every installed backend: accuracy (report, the "
        "default) and speed (bench); a checkpoint's text (generate, batch).",
    )
    top.add_argument("--version", action="version", version=f"portable-llm {__version__}")
    sub = top.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")

    report = sub.add_parser(
        "report",
        help="each op, backend and float dtype against the float64 reference; exit 1 if any is "
        "outside tolerance",
    )
    bench = sub.add_parser(
        "bench",
        help="median times of impl='auto', impl='portable' and the native kernel called "
        "directly, with their ratios; exit 1 if the dispatch-overhead gate fails",
    )
    for p in (report, bench):
        add_selection_arguments(p)  # --backend NAME..., --op NAME...
    bench.add_argument(
        "--repeat",
        type=positive_int,
        metavar="N",
        help="at least N timed samples per variant (default 15; more while a case has had "
        "less than 1 s)",
    )
    bench.add_argument("--quick", action="store_true", help="few, short samples (a smoke run)")
    report.add_argument(
        "--dtype", action="append", metavar="NAME", help="only this float dtype (repeatable)"
    )
    report.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="a row per dtype and path (auto, and the path it did not take), the tolerances and "
        "the kernels behind each path; default: one line per op and backend",
    )
    bench.add_argument("--dtype", default="float32", help="input dtype (default float32)")
    bench.add_argument(
        "--model",
        nargs="?",
        const=True,
        metavar="PATH",
        help="instead of the ops: a whole model, its load time and prefill/decode tokens/s next "
        "to transformers, mlx-lm and llama.cpp (for a .gguf, when llama-cpp-python is "
        "installed). PATH: a checkpoint folder or a .gguf file (as pl.load reads it, and "
        "dequantized); default a "
        "Qwen2-0.5B-shaped random checkpoint",
    )
    add_activations_argument(bench, selection=True)
    bench.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where --model writes its checkpoint (default ~/.cache/portable_llm/bench)",
    )
    for p in (report, bench):
        add_threads_argument(p)
    texts = (
        add_generate_parser(sub),
        add_batch_parser(sub),
        add_serve_parser(sub),
        add_perplexity_parser(sub),
    )
    for cmd in (report, bench, *texts):
        cmd.set_defaults(parser=cmd)  # the subcommand's own usage errors name it
        top.subcommands[cmd.prog.split()[-1]] = cmd
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    top = parser()
    if not args_list or args_list[0] not in (*COMMANDS, "-h", "--help", "--version"):
        args_list.insert(0, "report")  # the report is the default command
    args = top.parse_args(args_list)
    sub: argparse.ArgumentParser = args.parser
    try:
        if args.command == "generate":
            return run_generate(args, usage=sub)
        if args.command == "batch":
            return run_batch(args, usage=sub)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "perplexity":
            return run_perplexity(args, usage=sub)
        from portable_llm.cli.report import backend_names

        apply_threads(args.threads, backend_names(args.backend))
        if args.command == "bench" and args.model:
            from portable_llm.cli.model_bench import run_model_bench

            return run_model_bench(
                args.backend, dtype=args.dtype, quick=args.quick, cache_dir=args.cache_dir,
                folder=None if args.model is True else args.model, activations=args.activations,
            )  # fmt: skip
        if args.command == "bench":
            from portable_llm.cli.bench import run_bench

            return run_bench(
                args.backend, args.op, repeat=args.repeat, quick=args.quick, dtype=args.dtype
            )
        from portable_llm.cli.report import run_report

        return run_report(args.backend, args.op, args.dtype, verbose=args.verbose)
    except UsageError as exc:  # a bad --op/--dtype/--model: exit 2, one line
        sub.error(str(exc))
    except (OSError, ValueError, ImportError) as exc:  # e.g. a checkpoint that does not load
        error(args.command, exc)
        return 1
