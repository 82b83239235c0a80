"""``portable-llm serve MODEL``: an OpenAI-compatible HTTP server over continuous batching
(:mod:`portable_llm.serve`; needs the ``serve`` extra: starlette and uvicorn)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from portable_llm.cli.options import (
    add_engine_arguments,
    add_max_new_tokens_argument,
    add_model_arguments,
    apply_threads,
    non_negative_int,
    positive_int,
)
from portable_llm.cli.output import plural
from portable_llm.extras import install_hint

__all__ = ["add_serve_parser", "run_serve"]


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to the ``portable-llm`` subparsers; return its parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health) over one continuous batch, with prefix caching",
    )
    add_model_arguments(p)  # path, --backend, --dtype, --device, --dequantize, --threads
    add_max_new_tokens_argument(p)  # of a request that sets no max_tokens
    add_engine_arguments(p)  # --prefill-step-size, --max-batch
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=non_negative_int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--model-name", default=None, metavar="NAME",
        help="the model id clients send and /v1/models lists (default: PATH as given; its "
        "last part is accepted too)",
    )  # fmt: skip
    p.add_argument(
        "--pool-pages", type=positive_int, default=None, metavar="N",
        help="KV pages per layer (of --page-size tokens); requests wait while they are taken. "
        "Default: the pools grow as needed",
    )  # fmt: skip
    p.add_argument(
        "--page-size", type=positive_int, default=16, metavar="N",
        help="tokens per KV page (default 16)",
    )  # fmt: skip
    p.add_argument(
        "--max-queue", type=non_negative_int, default=64, metavar="N",
        help="requests that may wait to join the batch; the next gets 429 (default 64)",
    )  # fmt: skip
    p.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 (not on /health)",
    )  # fmt: skip
    p.add_argument(
        "--no-prefix-cache", action="store_true",
        help="do not keep the pages of earlier prompts for reuse",
    )  # fmt: skip
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level: one line per request at info (default info)",
    )  # fmt: skip
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, build the app, run uvicorn until interrupted; return the exit code."""
    try:
        import uvicorn

        from portable_llm.serve import create_app
    except ImportError as exc:
        print(
            f"portable-llm serve: error: {exc.name or exc} is missing; install the serve extra: "
            f"{install_hint('serve')}",
            file=sys.stderr,
        )
        return 1
    from portable_llm.checkpoint.loader import load

    threads = apply_threads(args.threads, [args.backend])
    on = f"{args.backend} ({plural(threads, 'thread')})"
    print(f"portable-llm serve: loading {args.path} on {on}", file=sys.stderr)
    try:
        model = load(
            args.path, backend=args.backend, dtype=args.dtype, device=args.device,
            dequantize=args.dequantize,
        )  # fmt: skip
    except (FileNotFoundError, ValueError, TypeError, ImportError, OSError) as exc:
        print(f"portable-llm serve: error: {str(exc)[:2000]}", file=sys.stderr)
        return 1
    name = args.model_name or str(args.path)
    app = create_app(
        model, model_name=name, aliases=(Path(str(args.path)).name,), api_key=args.api_key,
        max_queue=args.max_queue, max_batch=args.max_batch, prefill_chunk=args.prefill_step_size,
        pool_pages=args.pool_pages, page_size=args.page_size,
        prefix_cache=not args.no_prefix_cache, default_max_tokens=args.max_new_tokens,
    )  # fmt: skip
    print(f"portable-llm serve: {name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
