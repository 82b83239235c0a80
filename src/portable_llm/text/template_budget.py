"""The work budget of a chat template: steps, call depth and the size of what it builds.

A chat template is untrusted code, so beyond the sandbox (which keeps it from Python's
internals) one :class:`Budget` per render, and one per compile (jinja2 evaluates constant
expressions while compiling), bounds what it may do:

- **steps**: every loop iteration and filter is one step, every call (macros, methods,
  globals) :data:`CALL_STEPS`; at most :data:`MAX_LOOP_STEPS` per render;
- **depth**: calls nested at most :data:`MAX_DEPTH` deep (a recursive macro);
- **size**: no operation builds a string, list or integer (in bits) larger than the limit
  (:data:`MAX_SIZE` plus the size of the template's inputs), and the operations that can
  make something large from something small are checked *before* they run: ``*``, ``**``,
  ``+``, ``%`` and ``~``, ``center``/``ljust``/``rjust``/``zfill``, ``format`` padding,
  ``replace``, ``join``, ``expandtabs``, ``translate``, ``indent``, ``wordwrap``, ``batch``,
  ``slice``, ``lipsum``, ``tojson``'s indent;
- **work**: the characters and items all operations build, and the output, together at most
  :data:`MAX_WORK` (plus a multiple of the inputs' size): a string doubled in a loop, or a
  megabyte string output a thousand times, runs out of work long before it runs out of memory.

Every refusal is :class:`Refused`, which the renderer turns into a ``ValueError`` naming the
template's file.
"""

from __future__ import annotations

import contextvars
import numbers
import re
import string
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "CALL_STEPS",
    "MAX_DEPTH",
    "MAX_LOOP_STEPS",
    "MAX_SIZE",
    "MAX_WORK",
    "Budget",
    "Refused",
    "budget",
    "checked_filter",
    "checked_lipsum",
    "checked_method",
    "size_of",
]

#: Loop iterations and calls one render may run, over all its loops and calls together.
MAX_LOOP_STEPS = 1_000_000
#: The largest string or list (items) or integer (bits) one operation may build, beyond the
#: size of the template's inputs.
MAX_SIZE = 1_000_000
#: Characters and items all operations of one render may build together, output included,
#: beyond 16 times the size of the template's inputs.
MAX_WORK = 100_000_000
#: The deepest nesting of calls (a macro calling itself).
MAX_DEPTH = 64
#: The steps one call (of a macro, a method, a global) spends.
CALL_STEPS = 10

_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class Refused(Exception):
    """A bound of the template budget was hit."""


class Budget:
    """What one render (or compile) may still do."""

    def __init__(self, inputs: int = 0) -> None:
        self.steps = MAX_LOOP_STEPS
        self.work = MAX_WORK + 16 * inputs
        self.limit = MAX_SIZE + inputs
        self.depth = 0

    def step(self, cost: int = 1) -> None:
        """Spend ``cost`` steps: 1 per loop iteration or filter, :data:`CALL_STEPS` per call
        (a macro call costs jinja2 about as much as ten loop iterations)."""
        self.steps -= cost
        if self.steps < 0:
            raise Refused(f"the template ran more than {MAX_LOOP_STEPS} loop iterations and calls")

    def check(self, n: int, what: str) -> None:
        """Refuse before building ``n`` items (characters, list items, bits)."""
        if n > self.limit:
            raise Refused(f"{what} would build {n} items (at most {self.limit})")
        self.spend(n)

    def spend(self, n: int) -> None:
        self.work -= n
        if self.work < 0:
            raise Refused(f"the template built more than its budget of {MAX_WORK} characters")

    def built(self, value: Any, what: str) -> Any:
        """``value``, refused when it is larger than the limit; its size is spent."""
        n = size_of(value, deep=False)
        if n > self.limit:
            raise Refused(f"{what} built {n} items (at most {self.limit})")
        self.spend(n)
        return value

    def join(self, parts: Iterable[Any], what: str = "the output") -> str:
        """``"".join(map(str, parts))``, refused before it would exceed the limit."""
        pieces, total = [], 0
        for part in parts:
            piece = part if isinstance(part, str) else str(part)
            total += len(piece)
            if total > self.limit:
                raise Refused(f"{what} would be longer than {self.limit} characters")
            self.spend(len(piece))
            pieces.append(piece)
        return "".join(pieces)


_current: contextvars.ContextVar[Budget] = contextvars.ContextVar("template_budget")


def budget() -> Budget:
    """The budget of the render (or compile) under way; a fresh one outside any."""
    try:
        return _current.get()
    except LookupError:
        b = Budget()
        _current.set(b)
        return b


def set_budget(b: Budget) -> contextvars.Token[Budget]:
    return _current.set(b)


def reset_budget(token: contextvars.Token[Budget]) -> None:
    _current.reset(token)


def size_of(value: Any, *, deep: bool = True) -> int:
    """Characters of a string, items of a list or dict (with ``deep``, those of its items
    too), bits of an integer; 0 for anything else."""
    if type(value) is str or isinstance(value, str | bytes):
        return len(value)
    if value is None or type(value) is float or type(value) is bool:
        return 0
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value).bit_length()
    if isinstance(value, dict):
        if not deep:
            return len(value)
        return len(value) + sum(size_of(k) + size_of(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return len(value) + (sum(size_of(v) for v in value) if deep else 0)
    return 0


def _int(value: Any) -> int:
    return int(value) if isinstance(value, numbers.Integral) else 0


def loop(iterable: Iterable[Any]) -> Iterator[Any]:
    """``iterable``, one step per item (wrapped around every ``{% for %}``)."""
    b = budget()
    for item in iterable:
        b.step()
        yield item


def binop(op: str, left: Any, right: Any) -> None:
    """Check ``left op right`` before it runs (``*``, ``**``, ``+``, ``%``)."""
    b = budget()
    if op == "*":
        counts = [v for v in (left, right) if isinstance(v, numbers.Integral)]
        seqs = [v for v in (left, right) if isinstance(v, str | bytes | list | tuple)]
        if seqs and counts and size_of(seqs[0], deep=False) * max(_int(counts[0]), 0) > b.limit:
            raise Refused(f"'*' would build a sequence longer than {b.limit}")
        if len(counts) == 2 and size_of(left) + size_of(right) > b.limit:
            raise Refused(f"'*' would build an integer of more than {b.limit} bits")
    elif op == "**" and isinstance(left, numbers.Integral) and isinstance(right, numbers.Integral):
        if int(right) > 0 and max(size_of(left), 1) * int(right) > b.limit:
            raise Refused(f"'**' would build an integer of more than {b.limit} bits")
    elif op == "+":
        if isinstance(left, str | bytes | list | tuple) and type(left) is type(right):
            b.check(size_of(left, deep=False) + size_of(right, deep=False), "'+'")
    elif op == "%" and isinstance(left, str):
        printf(left)


def printf(fmt: str) -> None:
    """Refuse a ``%``-format whose widths or precisions exceed the limit, or come from
    arguments (``*``)."""
    limit = budget().limit
    for m in _PRINTF.finditer(fmt):
        for n in m.groups():
            if n == "*":
                raise Refused("'%' with a width or precision from the arguments ('*') is refused")
            if n is not None and int(n) > limit:
                raise Refused(f"'%' would pad to {n} characters (at most {limit})")


def format_spec(fmt: str) -> None:
    """Refuse a ``str.format`` string whose field widths or precisions exceed the limit, or
    come from arguments (nested ``{}`` in a spec)."""
    limit = budget().limit
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError as exc:
        raise Refused(f"format string: {exc}") from None
    for _, _, spec, _ in fields:
        if not spec:
            continue
        if "{" in spec:
            raise Refused("format specs with nested fields ('{:{w}}') are refused")
        for n in _DIGITS.findall(spec):
            if int(n) > limit:
                raise Refused(f"format would pad to {n} characters (at most {limit})")


def checked_method(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Check a call of a ``str`` (or ``bytes``) method that can build much from little; the
    arguments to call it with (``join``'s iterable listed, so it is read once)."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, str | bytes):
        return args
    name = getattr(target, "__name__", "")
    b, n = budget(), len(owner)
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        b.check(max(_int(first if first is not None else kwargs.get("width")), n), name)
    elif name == "expandtabs":
        tab = _int(first if first is not None else kwargs.get("tabsize", 8))
        tabs = owner.count("\t") if isinstance(owner, str) else owner.count(b"\t")
        b.check(n + tabs * max(tab, 0), name)
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str | bytes) and isinstance(new, str | bytes):
            hits = n + 1 if not old else owner.count(old)  # type: ignore[arg-type]
            b.check(n + hits * len(new), name)
    elif name == "join" and args:
        items = list(args[0])
        b.check(sum(size_of(i) for i in items) + n * max(len(items) - 1, 0), name)
        return (items, *args[1:])
    elif name in ("format", "format_map") and isinstance(owner, str):
        format_spec(owner)
    elif name == "translate" and isinstance(first, dict):
        longest = max((size_of(v) for v in first.values()), default=1)
        b.check(n * max(longest, 1), name)
    return args


# -- filters -----------------------------------------------------------------------------------


def _center(value: Any, width: Any = 80) -> None:
    budget().check(max(_int(width), len(str(value))), "center")


def _indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    text = str(s)
    pad = len(width) if isinstance(width, str) else _int(width)
    budget().check(len(text) + (text.count("\n") + 1) * max(pad, 0), "indent")


def _wordwrap(
    s: Any, width: Any = 79, break_long_words: bool = True,
    wrapstring: Any = None, break_on_hyphens: bool = True,
) -> None:  # fmt: skip
    text = str(s)
    lines = len(text) // max(_int(width), 1) + text.count("\n") + 1
    budget().check(len(text) + lines * len(str(wrapstring or "\n")), "wordwrap")


def _format(value: Any, *args: Any, **kwargs: Any) -> None:
    printf(str(value))


def _batch(value: Any, linecount: Any, fill_with: Any = None) -> None:
    budget().check(_int(linecount), "batch")


def _slice(value: Any, slices: Any, fill_with: Any = None) -> None:
    budget().check(_int(slices), "slice")


def _replace(s: Any, old: Any, new: Any, count: Any = None) -> None:
    text, old, new = str(s), str(old), str(new)
    hits = len(text) + 1 if not old else text.count(old)
    budget().check(len(text) + hits * len(new), "replace")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, *args: Any, **kw: Any) -> None:
    pad = len(indent) if isinstance(indent, str) else _int(indent)
    if pad > 64:
        raise Refused(f"tojson: indent {pad} is more than 64")


#: Filters checked before they run, by name (the template's arguments: the value first).
PRECHECKS = {
    "center": _center,
    "indent": _indent,
    "wordwrap": _wordwrap,
    "format": _format,
    "batch": _batch,
    "slice": _slice,
    "replace": _replace,
    "tojson": _tojson,
}


def checked_lipsum(fn: Any) -> Any:
    """The ``lipsum(n, html, min, max)`` global, checked first: ``n`` paragraphs of up to
    ``max`` words of up to 12 characters."""
    import functools

    @functools.wraps(fn)
    def run(n: Any = 5, html: bool = True, min: Any = 20, max: Any = 100) -> Any:
        words = _int(max)
        budget().check(abs(_int(n)) * abs(words) * 12, "lipsum")
        return fn(n, html, min, max)

    return run


def checked_filter(name: str, fn: Any) -> Any:
    """Filter ``fn`` with a step spent per call, its pre-check (if any) run first, and the size
    of its result checked and spent."""
    import functools

    pre: Any = PRECHECKS.get(name)
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/environment

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        b = budget()
        b.step()
        if pre is not None:
            pre(*args[skip:], **kwargs)
        return b.built(fn(*args, **kwargs), f"filter {name}")

    return run
