"""``portable-llm serve MODEL``: an OpenAI-compatible HTTP server over continuous batching
(:mod:`portable_llm.serve`; needs the ``serve`` extra: starlette and uvicorn).

Every flag value is checked by argparse before anything loads (a bad one: one line, exit 2);
the port is bound next (a failure: one line, exit 1), then the model loads, and only then is
the URL, with the port really bound, announced.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable
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
from portable_llm.cli.output import Phases, plural
from portable_llm.extras import install_hint

__all__ = ["add_serve_parser", "listen", "run_serve"]


def _flag(check: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse type running ``check`` (a :mod:`portable_llm.serve.guard` rule) on the
    text: its ``ValueError`` becomes a usage error in the flag's words."""

    def parse(text: str) -> Any:
        try:
            return check(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name}: ")) from None

    parse.__name__ = name
    return parse


def _port(text: str) -> int:
    port = int(text) if text.strip().isdigit() else -1
    if not 0 <= port <= 65535:
        raise ValueError(f"port: expected a port number in [0, 65535] (0: any free port), "
                         f"got {text!r}")  # fmt: skip
    return port


def _host(text: str) -> str:
    from portable_llm.serve.guard import normalize_hosts

    normalize_hosts([text], name="host")  # a name or an address, no scheme or port
    return text


def _api_key(text: str) -> str:
    from portable_llm.serve.guard import check_api_key

    return str(check_api_key(text))


def _hosts(text: str) -> list[str]:
    from portable_llm.serve.guard import normalize_hosts

    items = [t.strip() for t in text.split(",") if t.strip()]
    normalize_hosts(items)
    return items


def _origins(text: str) -> list[str]:
    from portable_llm.serve.guard import normalize_origins

    return list(normalize_origins([t for t in text.split(",") if t.strip()]))


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
    p.add_argument(
        "--host", type=_flag(_host, "host"), default="127.0.0.1",
        help="address to listen on (127.0.0.1; 0.0.0.0: every address of the machine)",
    )  # fmt: skip
    p.add_argument(
        "--port", type=_flag(_port, "port"), default=8000,
        help="port (default 8000; 0: a free port, announced at start)",
    )  # fmt: skip
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
        help="requests that may wait beyond the --max-batch running ones; the next gets 429 "
        "(default 64; 0: none waits)",
    )  # fmt: skip
    p.add_argument(
        "--api-key", type=_flag(_api_key, "api_key"), default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 (not on /health); 1 to 256 printable "
        "ASCII characters without spaces",
    )  # fmt: skip
    p.add_argument(
        "--allowed-hosts", type=_flag(_hosts, "allowed_hosts"), default=[], metavar="H,H",
        help="Host header names (any port) accepted besides localhost, 127.0.0.1, ::1 and "
        "--host; others get 400 (DNS rebinding). '*': any",
    )  # fmt: skip
    p.add_argument(
        "--allowed-origins", type=_flag(_origins, "allowed_origins"), default=[],
        metavar="O,O",
        help="web page origins (http://localhost:3000) that may call the server through CORS; "
        "requests from other origins get 403. Default: none (CORS off)",
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

    try:  # before loading: a port in use fails at once
        sock = listen(args.host, args.port)
    except OSError as exc:
        print(f"portable-llm serve: error: cannot listen on {args.host} port {args.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
        return 1
    threads = apply_threads(args.threads, [args.backend])
    on = f"{args.backend} ({plural(threads, 'thread')})"
    print(f"portable-llm serve: loading {args.path} on {on}", file=sys.stderr)
    try:
        with Phases("portable-llm serve")("loading", announce=False):  # a line every 10 s
            model = load(
                args.path, backend=args.backend, dtype=args.dtype, device=args.device,
                dequantize=args.dequantize,
            )  # fmt: skip
    except (FileNotFoundError, ValueError, TypeError, ImportError, OSError) as exc:
        sock.close()
        print(f"portable-llm serve: error: {str(exc)[:2000]}", file=sys.stderr)
        return 1
    name = args.model_name or str(args.path)
    app = create_app(
        model, model_name=name, aliases=(Path(str(args.path)).name,), api_key=args.api_key,
        max_queue=args.max_queue, max_batch=args.max_batch, prefill_chunk=args.prefill_step_size,
        pool_pages=args.pool_pages, page_size=args.page_size,
        prefix_cache=not args.no_prefix_cache, default_max_tokens=args.max_new_tokens,
        allowed_hosts=(args.host, *args.allowed_hosts), allowed_origins=args.allowed_origins,
    )  # fmt: skip
    address, port = sock.getsockname()[:2]
    shown = f"[{address}]" if ":" in address else address
    print(f"portable-llm serve: {name} on http://{shown}:{port}/v1", file=sys.stderr)
    print(f"portable-llm serve: chat page at http://{shown}:{port}/", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level))
    with sock:
        server.run(sockets=[sock])
    if not server.started:
        print("portable-llm serve: error: the server did not start (see above)", file=sys.stderr)
        return 1
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host`` (a name or an address) and ``port`` (0: a free one), as
    uvicorn binds its own; ``OSError`` when the address does not resolve or is taken."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
