"""Failures of the libraries that read untrusted text files, as one exception type of ours.

``tokenizers`` raises bare ``Exception``s for a malformed ``tokenizer.json`` and, for a regex
that exceeds the regex engine's limits while encoding, a Rust panic: ``PanicException``, which
derives from ``BaseException`` and so escapes ``except Exception``. :func:`foreign_errors`
turns either into ``error`` (a ``ValueError`` by default) with a message that says where; an
interrupt (``KeyboardInterrupt``, ``SystemExit``) still interrupts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MAX_MESSAGE", "foreign_errors", "shorten"]

#: The longest message of an error about an untrusted file (longer ones are cut, saying so).
MAX_MESSAGE = 4000


def shorten(text: str, /, limit: int = MAX_MESSAGE) -> str:
    """``text``, cut to ``limit`` characters with a note of its full length when longer."""
    if len(text) <= limit:
        return text
    return text[: limit - 60] + f" ... (cut: {len(text)} characters in all)"


@contextmanager
def foreign_errors(where: str, error: type[Exception] = ValueError) -> Iterator[None]:
    """Run the body; any ``Exception`` or Rust panic it raises becomes ``error(f"{where}:
    ...")`` (an ``error`` raised by the body itself passes through)."""
    try:
        yield
    except error:
        raise
    except Exception as exc:
        raise error(shorten(f"{where}: {type(exc).__name__}: {exc}")) from None
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise error(shorten(f"{where}: the tokenizers library panicked: {exc}")) from None
