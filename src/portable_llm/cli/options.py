"""The flags the subcommands share, defined once, so that every subcommand spells, checks and
explains them alike: ``--backend``, ``--dtype``, ``--device``, ``--threads``,
``--max-new-tokens``, the sampling flags and ``--chat``.

A bad value is a usage error (exit status 2) in the flag's own words, on one line
(:class:`Parser`). A subcommand added later (``serve``) calls the same ``add_*`` functions and
:func:`apply_threads`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from portable_llm.backends import BACKENDS, BackendNotInstalledError, get_backend
from portable_llm.cli.output import WIDTH, wrap

__all__ = [
    "HelpFormatter",
    "Parser",
    "add_model_arguments",
    "add_sampling_arguments",
    "add_threads_argument",
    "apply_threads",
    "one_thread_decode",
    "backend_name",
    "default_threads",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "sampling_options",
    "token_ids",
]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, at most :data:`WIDTH` columns wide (narrower on a narrow
    terminal)."""

    def __init__(self, prog: str) -> None:
        width = min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)
        super().__init__(prog, width=width, max_help_position=32)


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one message, ``PROG: error: MESSAGE`` (wrapped
    to :data:`WIDTH` columns), exit status 2: argparse prints the whole usage first, which runs
    over many lines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        #: name -> parser of each subcommand, filled by whoever adds them
        self.subcommands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> NoReturn:
        self.exit(2, wrap(f"{self.prog}: error: {message}") + "\n")


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


#: argparse types: a bad value is a usage error that names the flag and what it expects.
positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked(float, lambda v: v > 0, "a number > 0")
_temperature = _checked(float, lambda v: v >= 0, "a number >= 0")
_probability = _checked(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def token_ids(text: str) -> list[int]:
    """``--ids 1,2,3`` as a list of ints (an argparse type: a bad value is a usage error)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id, got none")
    return ids


def backend_name(text: str) -> str:
    """``--backend NAME`` as the canonical name (aliases such as ``strict`` resolved); an unknown
    name is a usage error listing the known ones. The library is not imported unless ``NAME``
    is an alias."""
    if text in BACKENDS:
        return text
    try:
        return get_backend(text).name
    except BackendNotInstalledError:
        return text  # a known alias whose library is missing: the command says so
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"unknown backend {text!r}; known: {', '.join(BACKENDS)}"
        ) from None


def default_threads() -> int:
    """The ``--threads`` default: one thread per core that the other processes leave idle,
    at least 1: ``max(1, cores - round(1-minute load average))``.

    On a 2-core machine that is 2 when it is idle and 1 as soon as another process keeps a core
    busy: torch's own default (one thread per core) then decodes several times slower than one
    thread, as its threads wait for each other (docs/cli.md, "Threads").
    """
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return cores
    return max(1, min(cores, cores - round(load)))


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """``--threads N``: the CPU threads of torch and of NumPy's BLAS (see :func:`apply_threads`)."""
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads for torch and NumPy's BLAS (default: one per idle core, from the "
        "load average; JAX and MLX keep their own)",
    )


def apply_threads(threads: int | None, backends: Sequence[str], file: Any = None) -> int:
    """Set the CPU thread count of the named backends' libraries for this process; return it.

    ``threads``: the ``--threads`` value; ``None`` takes :func:`default_threads`. torch gets
    ``torch.set_num_threads``; NumPy's BLAS gets ``threadpoolctl.threadpool_limits`` where
    threadpoolctl is installed (else a note on ``file``, default stderr, says how to set
    ``OPENBLAS_NUM_THREADS``). JAX and MLX are left as they are: XLA fixes its CPU threads when
    it starts, and MLX has no thread setting.

    Called by a command after parsing its flags, never on import.
    """
    n = default_threads() if threads is None else threads
    if "torch" in backends:
        try:
            import torch
        except ImportError:
            pass
        else:
            torch.set_num_threads(n)
    if "numpy" in backends:
        try:
            threadpoolctl = importlib.import_module("threadpoolctl")  # optional, untyped
        except ImportError:
            if threads is not None:
                note = (
                    "note: --threads does not reach NumPy's BLAS without threadpoolctl (pip "
                    "install threadpoolctl); set OPENBLAS_NUM_THREADS before starting instead"
                )
                print(wrap(note), file=file if file is not None else sys.stderr)
        else:
            threadpoolctl.threadpool_limits(n, user_api="blas")
    return n


def one_thread_decode(threads: int | None, model: Any) -> bool:
    """Whether ``generate`` decodes on one torch thread once the prompt is read: torch float32
    on the CPU, no ``--threads`` given, more than one thread chosen. At one torch thread torch's
    ``linear`` runs each one-row product (a decode step) on NumPy's BLAS, which streams the
    weights 1.6-1.85x faster than ``F.linear``'s GEMV and which it leaves alone at two threads
    (the two thread pools contend: docs/ops/linear.md). Measured on an idle 2-core VM
    (2026-11-27), SmolLM2 Q4_1 float32: 49 decode tokens/s on one torch thread against 25 on
    two. The prompt is read with the threads chosen (a prefill is 1.5x faster on two)."""
    if threads is not None or model.backend.name != "torch":
        return False
    import torch

    cpu = getattr(model.backend.device_of(model.norm), "type", None) == "cpu"
    f32 = model.backend.dtype_name(model.dtype) == "float32"
    return cpu and f32 and torch.get_num_threads() > 1


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The checkpoint ``path`` and where it runs: ``--backend``, ``--dtype``, ``--device``,
    ``--threads``."""
    p.add_argument(
        "path",
        help="a checkpoint: a folder (config.json, *.safetensors, tokenizer.json), a .gguf file, "
        "or a Hub id (org/name) in the local Hugging Face cache",
    )
    p.add_argument(
        "--backend",
        type=backend_name,
        default="numpy",
        metavar="NAME",
        help=f"array library to run on: {', '.join(BACKENDS)} (default numpy)",
    )
    p.add_argument("--dtype", default=None, help="weights dtype (default: the checkpoint's)")
    p.add_argument(
        "--device", default=None, help="cpu, gpu, cuda:0, mps, ... (default: the backend's)"
    )
    add_threads_argument(p)


def add_sampling_arguments(p: argparse.ArgumentParser, *, per: str = "") -> None:
    """``--max-new-tokens`` (``--max-tokens`` is a hidden alias), ``--temperature``,
    ``--top-k``, ``--top-p``, ``--min-p``, ``--seed``, ``--repetition-penalty``, ``--chat``."""
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=50,
        metavar="N",
        help=f"the most new tokens{per} (default 50)",
    )
    p.add_argument("--max-tokens", type=positive_int, dest="max_new_tokens", help=argparse.SUPPRESS)
    p.add_argument(
        "--temperature", type=_temperature, default=0.0, metavar="T", help="0 (default): greedy"
    )
    p.add_argument("--top-k", type=positive_int, metavar="K", help="sample from the K likeliest")
    p.add_argument(
        "--top-p", type=_probability, metavar="P", help="... from the likeliest up to mass P"
    )
    p.add_argument(
        "--min-p", type=_probability, metavar="P", help="drop below P x the top probability"
    )
    p.add_argument("--seed", type=non_negative_int, metavar="N", help="makes sampling reproducible")
    p.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=None,
        metavar="R",
        help="divide the positive logits (multiply the negative) of the last 20 ids by R",
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template"
    )


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as :func:`portable_llm.make_sampler`'s keyword arguments."""
    return {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "seed": args.seed,
    }
