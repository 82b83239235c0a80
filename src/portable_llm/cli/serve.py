"""``portable-llm serve MODEL``: an OpenAI-compatible HTTP server over continuous batching
(:mod:`portable_llm.serve`; needs the ``serve`` extra: starlette and uvicorn).

Every flag value is checked by argparse before anything loads (a bad one: one line, exit 2);
the port is bound next (a failure: one line, exit 1), then the model loads, and only then is
the URL, with the port really bound, announced. A model split over ranks (``--tensor-parallel``,
``--pipeline-parallel``) is served by rank 0; the other ranks step its batch (docs/serve.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from portable_llm.cli.options import (
    add_engine_arguments,
    add_max_new_tokens_argument,
    add_model_arguments,
    add_partition_arguments,
    apply_threads,
    non_negative_int,
    positive_int,
)
from portable_llm.cli.output import Phases, activations_note, plural
from portable_llm.extras import install_hint

__all__ = ["add_serve_parser", "listen", "run_serve"]


def _flag(check: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse type running ``check`` (a :mod:`portable_llm.serve.guard` rule) on the
    text: its ``ValueError`` becomes a usage error in the flag's words."""

    def parse(text: str) -> Any:
        if importlib.util.find_spec("starlette") is None:
            return text  # no serve extra: run_serve says how to install it, before any use
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


def _model_name(text: str) -> str:
    from portable_llm.serve.app import check_model_name

    return check_model_name(text, op="model_name")


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
    add_partition_arguments(p)  # --tensor-parallel, --pipeline-parallel
    p.add_argument(
        "--host", type=_flag(_host, "host"), default="127.0.0.1",
        help="address to listen on (127.0.0.1; 0.0.0.0: every address of the machine)",
    )  # fmt: skip
    p.add_argument(
        "--port", type=_flag(_port, "port"), default=8000,
        help="port (default 8000; 0: a free port, announced at start)",
    )  # fmt: skip
    p.add_argument(
        "--model-name", type=_flag(_model_name, "model_name"), default=None, metavar="NAME",
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
    """Load the model, build the app, run uvicorn until interrupted; return the exit code.

    With ``--tensor-parallel``/``--pipeline-parallel`` every rank (torchrun, mlx.launch) loads
    its share; rank 0 binds the port and serves, the others step its batch until it stops
    (:func:`_follow`); JAX drives its mesh from this one process."""
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
    try:
        groups, main = _groups(args)
    except (ValueError, RuntimeError, ImportError) as exc:
        print(f"portable-llm serve: error: {str(exc)[:2000]}", file=sys.stderr)
        return 1
    sock = None
    try:  # before loading: a port in use fails at once
        sock = listen(args.host, args.port) if main else None
    except OSError as exc:
        print(f"portable-llm serve: error: cannot listen on {args.host} port {args.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
        return 1
    model = _load(args, groups, announce=main)
    if model is None:
        if sock is not None:
            sock.close()
        return 1
    options = {
        "max_batch": args.max_batch, "prefill_chunk": args.prefill_step_size,
        "pool_pages": args.pool_pages, "page_size": args.page_size,
        "prefix_cache": not args.no_prefix_cache,
    }  # fmt: skip
    ranks = None  # rank 0's messages to the other ranks of a model split over processes
    if groups and _over_processes(model):
        ranks = _Ranks(model.engine.broadcast_object)
    if sock is None:
        assert ranks is not None  # only torch and MLX ranks other than 0 get here
        return _follow(model, options, ranks.broadcast)
    name = args.model_name or str(args.path)
    app = create_app(
        model, model_name=name, aliases=(Path(str(args.path)).name,), api_key=args.api_key,
        max_queue=args.max_queue, default_max_tokens=args.max_new_tokens,
        allowed_hosts=(args.host, *args.allowed_hosts), allowed_origins=args.allowed_origins,
        broadcast=ranks, **options,
    )  # fmt: skip
    address, port = sock.getsockname()[:2]
    shown = f"[{address}]" if ":" in address else address
    note = activations_note(model).removeprefix(", ")  # "int8 activations", or ""
    on = f"{name} ({note})" if note else name
    print(f"portable-llm serve: {on} on http://{shown}:{port}/v1", file=sys.stderr)
    print(f"portable-llm serve: chat page at http://{shown}:{port}/", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level))
    if ranks is not None:
        ranks.server = server
    with sock, contextlib.suppress(KeyboardInterrupt):  # uvicorn raises Ctrl-C's again
        server.run(sockets=[sock])  # once it stopped: that was the way out, not an error
    if not server.started:
        print("portable-llm serve: error: the server did not start (see above)", file=sys.stderr)
        return 1
    if ranks is not None and ranks.failure is not None:
        print(f"portable-llm serve: error: the other ranks cannot be reached ({ranks.failure}); "
              "the server stopped", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _groups(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """:func:`~portable_llm.partition.launch_groups` of the partition flags: ``load``'s
    keywords (none without the flags) and whether this process serves HTTP (rank 0)."""
    from portable_llm.partition.engine import launch_groups

    return launch_groups(
        args.backend,
        tensor_parallel=getattr(args, "tensor_parallel", 1),
        pipeline_parallel=getattr(args, "pipeline_parallel", 1),
    )


def _load(args: argparse.Namespace, groups: dict[str, Any], *, announce: bool) -> Any:
    """The model (this rank's share with ``groups``), or ``None`` after one error line;
    ``announce``: say what loads, and every 10 s that it still does."""
    from portable_llm.checkpoint.loader import load

    threads = apply_threads(args.threads, [args.backend])
    on = f"{args.backend} ({plural(threads, 'thread')})"
    if announce:
        print(f"portable-llm serve: loading {args.path} on {on}", file=sys.stderr)
    still = Phases("portable-llm serve")("loading", announce=False)  # a line every 10 s
    try:
        with still if announce else contextlib.nullcontext():
            return load(
                args.path, backend=args.backend, dtype=args.dtype, device=args.device,
                dequantize=args.dequantize, activations=args.activations, **groups,
            )  # fmt: skip
    except (FileNotFoundError, ValueError, TypeError, ImportError, OSError) as exc:
        print(f"portable-llm serve: error: {str(exc)[:2000]}", file=sys.stderr)
        return None


def _over_processes(model: Any) -> bool:
    """Whether ``model`` is one rank's share of a model split over processes (torch, MLX);
    JAX drives its whole mesh from one process (with tensor parallelism alone: a plain
    model)."""
    from portable_llm.partition.model import PartitionedModel

    return isinstance(model, PartitionedModel) and not model.engine.single_controller


class _Ranks:
    """Rank 0's ``broadcast`` to the other ranks of the model; when it fails (a rank is gone:
    the model cannot step any more) the HTTP server (``server``, once it runs) stops."""

    def __init__(self, broadcast: Callable[[Any], Any]) -> None:
        self.broadcast = broadcast
        self.server: Any = None
        self.failure: str | None = None  # the first failure, one line

    def __call__(self, message: Any) -> Any:
        try:
            return self.broadcast(message)
        except Exception as exc:
            if self.failure is None and not message[2]:  # not the stop of a server stopping
                self.failure = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            if self.server is not None:
                self.server.should_exit = True
            raise


def _follow(model: Any, options: dict[str, Any], broadcast: Callable[[Any], Any]) -> int:
    """A rank other than 0: its engine (``options`` as rank 0's) steps rank 0's batch until
    rank 0 stops; the exit code."""
    from portable_llm.serve.engine import Engine

    try:
        Engine(model, **options, broadcast=broadcast).follow()
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; rank 0 stops the server
        return 130
    except Exception as exc:  # rank 0 is gone (its group closed), or the ranks fell apart
        print(f"portable-llm serve: error: {type(exc).__name__}: {str(exc)[:2000]}",
              file=sys.stderr)  # fmt: skip
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
