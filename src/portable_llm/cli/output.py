"""How the ``portable-llm`` commands write: lines of at most :data:`WIDTH` columns, errors as one
message without a traceback, progress on stderr while a terminal watches."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TextIO

from portable_llm.checkpoint.hub import is_repo_id

__all__ = [
    "HEARTBEAT",
    "activations_note",
    "compile_note",
    "WIDTH",
    "Phases",
    "Progress",
    "Table",
    "UsageError",
    "check_usage",
    "error",
    "heartbeat",
    "path_errors",
    "plural",
    "wrap",
]

#: Every line the command prints fits this many columns (longer text is wrapped or shortened).
WIDTH = 100
#: Seconds between the lines that say a long step still runs (:func:`heartbeat`).
HEARTBEAT = 10.0


class UsageError(ValueError):
    """A flag whose value names nothing known or is out of range: exit status 2."""


def wrap(text: str, indent: str = "", hang: str = "    ") -> str:
    """``text`` wrapped to :data:`WIDTH` columns, continuation lines indented by ``hang``
    (words longer than a line, such as long paths, are kept whole)."""
    lines = textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=hang,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return "\n".join(lines) if lines else text


def plural(n: int, word: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def error(command: str, exc: BaseException | str, file: TextIO | None = None) -> None:
    """Print ``portable-llm COMMAND: error: MESSAGE`` on stderr: one message (its whitespace
    collapsed, wrapped to :data:`WIDTH` columns), no traceback."""
    message = " ".join(str(exc).split())
    print(wrap(f"portable-llm {command}: error: {message}"), file=file or sys.stderr)


def check_usage(usage: argparse.ArgumentParser | None, checks: Iterable[tuple[bool, str]]) -> None:
    """The first failed check as a usage error: ``usage.error`` (one line, exit status 2), or a
    :class:`UsageError` without a parser (a call from Python)."""
    for failed, message in checks:
        if failed:
            if usage is not None:
                usage.error(message)
            raise UsageError(message)


def path_errors(paths: Sequence[tuple[str, str | None]]) -> list[tuple[bool, str]]:
    """For :func:`check_usage`: each ``(argument, path)`` whose path is given but missing and
    is not shaped like a Hub repository id (``org/name``, which ``pl.load`` looks up in the
    local Hugging Face cache and answers itself)."""
    return [
        (
            path is not None and not os.path.exists(path) and not is_repo_id(path),
            f"{name}: no such file or folder: {path}",
        )
        for name, path in paths
    ]


class Progress:
    """Lines that say what runs now (loading, prefill), on stderr, only where stderr is a
    terminal: piped or captured output stays the command's result alone."""

    def __init__(self, command: str, file: TextIO | None = None) -> None:
        self.command = command
        self.file = file if file is not None else sys.stderr
        isatty = getattr(self.file, "isatty", None)
        self.on = bool(isatty and isatty())

    def __call__(self, message: str) -> None:
        if self.on:
            print(wrap(message), file=self.file, flush=True)

    def still(self, message: str) -> AbstractContextManager[None]:
        """Where a terminal watches: ``... still MESSAGE (N s)`` every :data:`HEARTBEAT` seconds
        until the block ends (:func:`heartbeat`); elsewhere nothing."""
        return heartbeat(self, message) if self.on else nullcontext()


@contextmanager
def heartbeat(
    say: Callable[[str], None], message: str, every: float | None = None
) -> Iterator[None]:
    """``say("... still MESSAGE (N s)")`` every ``every`` seconds (default :data:`HEARTBEAT`)
    until the block ends, from a daemon thread that the block's end stops: a long step is never
    silent for longer."""
    every = HEARTBEAT if every is None else every
    stop, start = threading.Event(), time.perf_counter()

    def beat() -> None:
        while not stop.wait(every):
            say(f"... still {message} ({time.perf_counter() - start:.0f} s)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Phases:
    """Lines on stderr (always: a long measurement is watched in logs too) that say which phase
    of a long command runs now, and every ``every`` seconds that it still runs, so that the
    command is never silent for longer: ``bench: torch: loading portable_llm ...``, then
    ``bench: ... still loading portable_llm (10 s)``."""

    def __init__(
        self, command: str, file: TextIO | None = None, every: float | None = None
    ) -> None:
        self.command = command
        self.file = file
        self.every = every

    def say(self, message: str) -> None:
        """One line, ``COMMAND: MESSAGE``, on stderr at once."""
        out = self.file if self.file is not None else sys.stderr
        print(wrap(f"{self.command}: {message}"), file=out, flush=True)

    @contextmanager
    def __call__(self, message: str, *, announce: bool = True) -> Iterator[None]:
        """Say ``message ...`` now (unless not ``announce``), and ``... still message (N s)``
        every ``every`` seconds until the block ends (:func:`heartbeat`)."""
        if announce:
            self.say(f"{message} ...")
        with heartbeat(self.say, message, self.every):
            yield


class Table:
    """A plain-text table printed a row at a time, as each row is ready: left-aligned columns
    separated by two spaces, a rule under the header. Column widths are fixed in advance (at
    least each header's); a longer cell pushes the rest of its row right."""

    def __init__(self, headers: Sequence[str], widths: Sequence[int] = ()) -> None:
        self.headers = list(headers)
        given = list(widths) + [0] * (len(headers) - len(widths))
        self.widths = [max(len(h), w) for h, w in zip(headers, given, strict=True)]

    def row(self, cells: Sequence[object]) -> str:
        """One row, padded to the column widths."""
        parts = [str(c).ljust(w) for c, w in zip(cells, self.widths, strict=True)]
        return "  ".join(parts).rstrip()

    def header(self) -> str:
        """The header line and the rule of dashes under it."""
        return self.row(self.headers) + "\n" + self.row(["-" * w for w in self.widths])


def compile_note(model: object) -> str:
    """``"; compiled step off: <why>"`` for a model whose compiled decode step was asked for
    and does not run (:attr:`portable_llm.models.Model.compile_note`, e.g. no C++ compiler for
    torch's inductor), to end a decode speed line; ``""`` otherwise."""
    note = getattr(model, "compile_note", None)
    return "" if note is None else f"; compiled step off: {note}"


def activations_note(model: object) -> str:
    """``", int8 activations"`` (or ``float``) for a model with quantized projections, to end
    a speed line with the mode that ran (:attr:`portable_llm.models.Model.activations`); ``""``
    for a model without them, or one that does not say (another model of the protocol)."""
    mode = getattr(model, "activations", None)
    if mode is None or not getattr(model, "quantized_projections", 0):
        return ""
    return f", {mode} activations"
