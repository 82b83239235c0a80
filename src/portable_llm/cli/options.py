"""The flags the subcommands share, defined once, so that every subcommand spells, checks,
explains and defaults them alike: where the model runs (``--backend``, ``--dtype``,
``--device``, ``--dequantize``, ``--activations``, ``--threads``), how prompts are read and decoded
(``--prefill-step-size``, ``--max-batch``), sampling (``--max-new-tokens``, ``--temperature``,
..., ``--chat``), speculative decoding and partitioning.

A bad value is a usage error (exit status 2) in the flag's own words, on one line
(:class:`Parser`). A model command added later (``perplexity``) calls the same ``add_*``
functions and :func:`apply_threads`; an old spelling stays a hidden alias (:data:`DEPRECATED`).
``tests/test_cli_vocabulary.py`` walks every subcommand's parser and fails on a flag without
help, two names for one option, or one name with two meanings or defaults.
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
    "DEPRECATED",
    "FORMS",
    "MAX_BATCH",
    "MAX_NEW_TOKENS",
    "PREFILL_STEP_SIZE",
    "DeprecatedAlias",
    "HelpFormatter",
    "Parser",
    "ACTIVATIONS",
    "add_activations_argument",
    "add_engine_arguments",
    "add_max_new_tokens_argument",
    "add_model_arguments",
    "add_partition_arguments",
    "add_selection_arguments",
    "add_sampling_arguments",
    "add_speculative_arguments",
    "THREADS_PER_CPU",
    "add_threads_argument",
    "apply_threads",
    "check_threads",
    "one_thread_decode",
    "backend_name",
    "default_threads",
    "dequantize_choice",
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


#: The most CPU threads per CPU that ``--threads`` takes: more threads than CPUs only wait for
#: each other, and far more crash the process (torch's OpenMP pool cannot start them:
#: ``--threads 100000`` segfaulted, 20000 aborted on a 2-CPU machine).
THREADS_PER_CPU = 4


def check_threads(threads: Any) -> int:
    """``threads`` as an int in ``[1, THREADS_PER_CPU * os.cpu_count()]``: the one rule of
    ``--threads`` and of :func:`apply_threads`; a ValueError (a TypeError for a non-int) naming
    the bound and the CPUs otherwise."""
    cpus = os.cpu_count() or 1
    most = THREADS_PER_CPU * cpus
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads: expected an integer, got {type(threads).__name__}")
    if not 1 <= threads <= most:
        raise ValueError(
            f"threads: expected an integer in [1, {most}] ({THREADS_PER_CPU} per CPU; this "
            f"machine has {cpus}), got {threads}"
        )
    return threads


def _thread_count(text: str) -> int:
    """``--threads N`` (an argparse type): :func:`check_threads` of the integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    try:
        return check_threads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("threads: ")) from None


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """``--threads N``: the CPU threads of torch and of NumPy's BLAS (see :func:`apply_threads`),
    at most :data:`THREADS_PER_CPU` per CPU."""
    p.add_argument(
        "--threads",
        type=_thread_count,
        default=None,
        metavar="N",
        help=f"CPU threads for torch and NumPy's BLAS, at most {THREADS_PER_CPU} per CPU "
        "(default: one per idle core, from the load average; JAX and MLX keep their own)",
    )


def apply_threads(threads: int | None, backends: Sequence[str], file: Any = None) -> int:
    """Set the CPU thread count of the named backends' libraries for this process; return it.

    ``threads``: the ``--threads`` value; ``None`` takes :func:`default_threads`. torch gets
    ``torch.set_num_threads``; NumPy's BLAS gets ``threadpoolctl.threadpool_limits`` where
    threadpoolctl is installed (else a note on ``file``, default stderr, says how to set
    ``OPENBLAS_NUM_THREADS``), for NumPy and for torch alike: at one torch thread a torch
    model's one-row float32 products (a decode step) run on NumPy's BLAS (``native/torch.py``
    ``model_linear``), whose threads, left at one per core, spin against the other processes of a
    busy machine (SmolLM2 float32 decode 0.27 tok/s with OpenBLAS at 2 threads against 1.4-1.5
    at 1, load 15-19 on 2 cores). JAX and MLX are left as they are: XLA fixes its CPU threads
    when it starts, and MLX has no thread setting.

    Called by a command after parsing its flags, never on import. ``threads`` above
    :data:`THREADS_PER_CPU` per CPU is a ValueError (:func:`check_threads`), before any library
    is told.
    """
    n = default_threads() if threads is None else check_threads(threads)
    if "torch" in backends:
        try:
            import torch
        except ImportError:
            pass
        else:
            torch.set_num_threads(n)
    if "numpy" in backends or "torch" in backends:
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
    on the CPU, no ``--threads`` given, more than one thread chosen. At one torch thread a model's
    ``model_linear`` runs each one-row product (a decode step) on NumPy's BLAS, which streams the
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


#: The shared defaults of the model commands (``generate``, ``batch``, ``serve``): one value
#: each, whichever command runs.
MAX_NEW_TOKENS = 256
PREFILL_STEP_SIZE = 512
MAX_BATCH = 32

#: Old spelling -> the flag it now is. Each still works as a hidden alias that prints one note
#: (:class:`DeprecatedAlias`), where its flag is taken.
DEPRECATED = {"--max-tokens": "--max-new-tokens", "--prefill-chunk": "--prefill-step-size"}

_noted: set[str] = set()


class DeprecatedAlias(argparse.Action):
    """An old flag name kept working: it stores into its new flag's ``dest`` and prints, once
    per process, ``note: --old is now --new`` on stderr (not a warning: pytest turns those
    into errors, and a command line is no place for a traceback)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        name = option_string or self.option_strings[0]
        if name not in _noted:
            _noted.add(name)
            print(f"{parser.prog}: note: {name} is now {DEPRECATED[name]}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _flag(p: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Add the flag ``name``, and each old spelling of it (:data:`DEPRECATED`) as a hidden alias."""
    action = p.add_argument(name, **kwargs)
    alias = {k: kwargs[k] for k in ("type", "metavar") if k in kwargs}
    for old, new in DEPRECATED.items():
        if new == name:
            p.add_argument(
                old, action=DeprecatedAlias, dest=action.dest, help=argparse.SUPPRESS, **alias
            )


def dequantize_choice(text: str) -> bool | str:
    """``--dequantize [auto|yes|no]`` as :func:`portable_llm.load`'s ``dequantize``: ``"auto"``,
    ``True`` or ``False`` (an argparse type: a bad value is a usage error)."""
    choices: dict[str, bool | str] = {"auto": "auto", "yes": True, "no": False}
    if text not in choices:
        # A bare --dequantize before the checkpoint takes the path as its value.
        path = " (the checkpoint? put it first, or write --dequantize=yes)"
        where = path if os.path.exists(text) else ""
        raise argparse.ArgumentTypeError(f"expected auto, yes or no, got {text!r}{where}")
    return choices[text]


#: The flags whose form differs by command, and why: (command, flag) -> the form's name (every
#: other flag has one definition wherever it appears; tests/test_cli_vocabulary.py holds each
#: form to one definition too). ``report`` and ``bench`` check or time every installed backend
#: unless ``--backend`` names some: a repeatable selection, where a model runs on one library.
#: ``report`` checks every float dtype unless ``--dtype`` names some; ``bench`` times inputs of
#: one dtype; a model command loads its weights in one (default: the checkpoint's). ``batch``
#: takes several prompts, ``generate`` one.
FORMS = {
    ("report", "--backend"): "selection",
    ("bench", "--backend"): "selection",
    ("report", "--dtype"): "selection",
    ("bench", "--dtype"): "inputs",
    ("batch", "--prompt"): "repeatable",
    ("batch", "--ids"): "repeatable",
    ("bench", "--activations"): "selection",
}

#: ``--activations``' values: :func:`portable_llm.load`'s ``activations``.
ACTIVATIONS = ("auto", "float", "int8")


def add_activations_argument(p: argparse.ArgumentParser, *, selection: bool = False) -> None:
    """``--activations MODE``: what a quantized checkpoint's codes multiply (``pl.load``'s
    ``activations``); ``selection`` (``bench --model``): repeatable, the modes to time
    (default: both, where the checkpoint is quantized)."""
    if selection:
        p.add_argument(
            "--activations",
            action="append",
            choices=ACTIVATIONS,
            metavar="MODE",
            help="a .gguf --model: time its quantized projections with these activations "
            "(repeatable: auto, float, int8; default float and int8, each with its KL "
            "divergence on the bundled text)",
        )
        return
    p.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default="auto",
        metavar="MODE",
        help="a quantized checkpoint: float multiplies its codes' weights by the activations "
        "as they are (exact); int8 rounds each projection's input to 8-bit blocks first, as "
        "llama.cpp does (judged by KL divergence: docs/gguf.md); auto (default) is int8 where "
        "measured faster and as close as llama.cpp's, else float",
    )


def add_selection_arguments(p: argparse.ArgumentParser) -> None:
    """``--backend NAME`` and ``--op NAME`` of ``report`` and ``bench``: each repeatable, each
    selecting (default: every installed backend, every op)."""
    p.add_argument(
        "--backend",
        action="append",
        type=backend_name,
        metavar="NAME",
        help="only this backend (repeatable; default: every installed one)",
    )
    p.add_argument(
        "--op", action="append", metavar="NAME", help="only this op (repeatable; default: all)"
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The checkpoint ``path`` and how it is loaded: ``--backend``, ``--dtype``, ``--device``,
    ``--dequantize``, ``--activations``, ``--threads``."""
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
    p.add_argument(
        "--dequantize",
        nargs="?",
        type=dequantize_choice,
        const=True,
        default="auto",
        metavar="WHEN",
        help="a quantized checkpoint (.gguf, mlx-lm folder): auto (default) keeps the codes "
        "where they decode at least as fast as floats here; yes (or no value): every weight as "
        "--dtype floats, more memory; no: keep every code, least memory",
    )
    add_activations_argument(p)
    add_threads_argument(p)


def add_engine_arguments(p: argparse.ArgumentParser, *, batch: bool = True) -> None:
    """How the prompts are read and decoded: ``--prefill-step-size`` (``--prefill-chunk`` is an
    old spelling) and, where requests are batched (``batch``), ``--max-batch``."""
    _flag(
        p,
        "--prefill-step-size",
        type=positive_int,
        default=PREFILL_STEP_SIZE,
        metavar="N",
        help=f"the most prompt tokens one forward reads, over all requests; a longer prompt "
        f"goes in chunks (default {PREFILL_STEP_SIZE})",
    )
    if not batch:
        return
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=MAX_BATCH,
        metavar="N",
        help=f"the most requests decoded together in one forward (default {MAX_BATCH})",
    )


def add_max_new_tokens_argument(p: argparse.ArgumentParser) -> None:
    """``--max-new-tokens N`` (``--max-tokens`` is an old spelling): the most new tokens per
    request; for ``serve``, of a request that sets no ``max_tokens``."""
    _flag(
        p,
        "--max-new-tokens",
        type=positive_int,
        default=MAX_NEW_TOKENS,
        metavar="N",
        help=f"the most new tokens per request (serve: of a request that sets no max_tokens; "
        f"default {MAX_NEW_TOKENS})",
    )


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """``--max-new-tokens`` (``--max-tokens`` is an old spelling), ``--temperature``, ``--top-k``,
    ``--top-p``, ``--min-p``, ``--seed``, ``--repetition-penalty``, ``--chat``: the same flags
    whatever the command, and for ``serve`` the values of a request that sets none."""
    add_max_new_tokens_argument(p)
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


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """``--draft PATH`` and ``--num-draft-tokens K``: speculative decoding (``generate``)."""
    p.add_argument(
        "--draft",
        default=None,
        metavar="PATH",
        help="speculative decoding: a smaller checkpoint (folder or .gguf, kept quantized) with "
        "the same tokenizer proposes tokens that the model verifies; prints the acceptance rate",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=positive_int,
        default=4,
        metavar="K",
        help="tokens the --draft proposes per round (default 4)",
    )


def add_partition_arguments(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel T`` and ``--pipeline-parallel P``: the model split over ranks
    (``generate``, ``serve``)."""
    p.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="T",
        help="split the model over T ranks by heads (torch: started by torchrun, MLX: by "
        "mlx.launch, JAX: T of its devices; default 1); see docs/partition.md",
    )
    p.add_argument(
        "--pipeline-parallel",
        type=positive_int,
        default=1,
        metavar="P",
        help="split the model's layers over P ranks (as --tensor-parallel; both: T x P ranks; "
        "default 1)",
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
