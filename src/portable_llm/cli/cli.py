"""The ``portable-llm`` command: ``report`` (accuracy, the default), ``bench`` (speed),
``generate`` (a checkpoint's continuation of a prompt) and ``batch`` (several prompts at once)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from portable_llm.cli.batch import add_batch_parser, run_batch
from portable_llm.cli.generate import add_generate_parser, run_generate
from portable_llm.cli.report import UsageError, run_report
from portable_llm.core.version import __version__

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="portable-llm",
        description="portable_llm ops on every installed backend: accuracy (report, the default) "
        "and speed (bench).",
    )
    parser.add_argument("--version", action="version", version=f"portable-llm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{report,bench,generate,batch}")

    report = sub.add_parser(
        "report",
        help="each op, backend and float dtype against the float64 reference; exit 1 if any is "
        "outside tolerance",
    )
    bench = sub.add_parser(
        "bench",
        help="median times of impl='auto', impl='portable' and the native kernel called directly, "
        "with their ratios; exit 1 if the dispatch-overhead gate fails",
    )
    for p in (report, bench):
        p.add_argument(
            "--backend", action="append", metavar="NAME", help="only this backend (repeatable)"
        )
        p.add_argument("--op", action="append", metavar="NAME", help="only this op (repeatable)")
    bench.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="at least N timed samples per variant (default 15; more while a case has had "
        "less than 1 s)",
    )
    bench.add_argument("--quick", action="store_true", help="few, short samples (a smoke run)")
    report.add_argument(
        "--dtype", action="append", metavar="NAME", help="only this float dtype (repeatable)"
    )
    bench.add_argument("--dtype", default="float32", help="input dtype (default float32)")
    bench.add_argument(
        "--model",
        nargs="?",
        const=True,
        metavar="PATH",
        help="instead of the ops: a whole model (PATH: a checkpoint folder or a .gguf file, "
        "kept quantized; default: a Qwen2-0.5B-shaped random checkpoint), its load time and "
        "prefill/decode tokens/s, next to transformers, mlx-lm and llama.cpp (.gguf, when "
        "llama-cpp-python is installed)",
    )
    bench.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where --model writes its checkpoint (default ~/.cache/portable_llm/bench)",
    )
    add_generate_parser(sub)
    add_batch_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    commands = ("report", "bench", "generate", "batch", "-h", "--help", "--version")
    if not args_list or args_list[0] not in commands:
        args_list.insert(0, "report")  # the report is the default command
    args = parser.parse_args(args_list)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "batch":
            return run_batch(args)
        if args.command == "bench" and args.model:
            from portable_llm.cli.model_bench import run_model_bench

            return run_model_bench(
                args.backend, dtype=args.dtype, quick=args.quick, cache_dir=args.cache_dir,
                folder=None if args.model is True else args.model,
            )  # fmt: skip
        if args.command == "bench":
            from portable_llm.cli.bench import run_bench

            if args.repeat is not None and args.repeat < 1:
                parser.error(f"--repeat must be >= 1, got {args.repeat}")
            return run_bench(
                args.backend, args.op, repeat=args.repeat, quick=args.quick, dtype=args.dtype
            )
        return run_report(args.backend, args.op, args.dtype)
    except UsageError as exc:  # a bad --backend/--op/--dtype: exit 2 with the usage line
        parser.error(str(exc))
