"""Chat templates: a checkpoint's Jinja template rendered in a sandbox, as transformers does.

A chat template comes with the checkpoint, so it is untrusted input. It is compiled in
``jinja2.sandbox.ImmutableSandboxedEnvironment`` with the environment transformers gives it
(``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension and ``{% generation %}``
blocks; ``raise_exception``, ``strftime_now``, a ``tojson`` that takes ``indent``, and
transformers' guarded ``dict`` and ``namespace``), so a template cannot reach Python's internals
(``cycler.__init__.__globals__``) nor change its inputs. Work is bounded too: ``range`` is the
sandbox's (at most ``MAX_RANGE`` items), every ``{% for %}`` draws from one budget of
:data:`MAX_LOOP_STEPS` iterations per render, and ``*``/``**`` refuse results beyond
:data:`MAX_SIZE`. Every error (syntax, security, an undefined name, ``raise_exception``, a
bound hit) is a ``ValueError`` that names the file the template came from.
"""

from __future__ import annotations

import contextvars
import json
import numbers
import operator
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["MAX_LOOP_STEPS", "MAX_SIZE", "compile_chat_template", "render_chat_template"]

#: Loop iterations one render may run, over all its ``{% for %}`` loops together.
MAX_LOOP_STEPS = 1_000_000
#: The largest string, list or integer (in bits) that ``*`` and ``**`` may build.
MAX_SIZE = 1_000_000

_steps_left: contextvars.ContextVar[list[int]] = contextvars.ContextVar("_steps_left")


class _Refused(Exception):
    """A bound of the sandbox was hit (turned into a ValueError by the caller)."""


def _budget(iterable: Iterable[Any]) -> Iterator[Any]:
    """``iterable``, one step of the render's loop budget per item (wrapped around every loop)."""
    left = _steps_left.get([MAX_LOOP_STEPS])
    for item in iterable:
        left[0] -= 1
        if left[0] < 0:
            raise _Refused(f"the template ran more than {MAX_LOOP_STEPS} loop iterations")
        yield item


def _size(value: Any) -> int:
    if isinstance(value, str | bytes | list | tuple):
        return len(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value).bit_length()
    return 0


def _mul(left: Any, right: Any) -> Any:
    counts = [v for v in (left, right) if isinstance(v, numbers.Integral)]
    seqs = [v for v in (left, right) if isinstance(v, str | bytes | list | tuple)]
    if seqs and counts and _size(seqs[0]) * max(int(counts[0]), 0) > MAX_SIZE:
        raise _Refused(f"'*' would build a sequence longer than {MAX_SIZE}")
    if len(counts) == 2 and _size(left) + _size(right) > MAX_SIZE:
        raise _Refused(f"'*' would build an integer of more than {MAX_SIZE} bits")
    return left * right


def _pow(left: Any, right: Any) -> Any:
    if (
        isinstance(left, numbers.Integral)
        and isinstance(right, numbers.Integral)
        and int(right) > 0
        and _size(left) * int(right) > MAX_SIZE
    ):
        raise _Refused(f"'**' would build an integer of more than {MAX_SIZE} bits")
    return operator.pow(left, right)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    """transformers' ``tojson``: no HTML escaping, and json.dumps' options."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
    """transformers' ``dict`` global: builds dicts, exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from jinja2.utils import Namespace
    except ImportError as exc:
        raise ImportError(
            "apply_chat_template needs jinja2: pip install 'portable-llm[chat]'"
        ) from exc

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): the body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    class TemplateNamespace(Namespace):
        """transformers' ``namespace``: no underscore attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a namespace cannot hold underscore attributes, got {name!r}"
                )

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(("*", "**"))

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            return _mul(left, right) if op == "*" else _pow(left, right)

    env = Environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters["_pl_budget"] = _budget
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def compile_chat_template(source: str, origin: str) -> Any:
    """The compiled template of ``source``; a ``ValueError`` naming ``origin`` (the file) when
    it is not a string or not valid Jinja."""
    if not isinstance(source, str):
        raise ValueError(
            f"chat template in {origin}: expected a string, got {type(source).__name__}"
        )
    return _compile(source, origin)


@lru_cache(maxsize=16)
def _compile(source: str, origin: str) -> Any:
    import jinja2
    from jinja2 import nodes

    env = _environment()
    try:
        tree = env.parse(source)
        for loop in tree.find_all(nodes.For):  # every loop draws from the render's budget
            loop.iter = nodes.Filter(loop.iter, "_pl_budget", [], [], None, None)
            loop.iter.set_lineno(loop.lineno)
            loop.iter.set_environment(env)
        return env.from_string(tree)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"chat template in {origin}: syntax error on line {exc.lineno}: {exc.message}"
        ) from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template in {origin}: {exc}") from None


def render_chat_template(template: Any, origin: str, variables: Mapping[str, Any]) -> str:
    """Render a compiled template with ``variables`` (made plain JSON data first, as
    transformers does); every failure is a ``ValueError`` naming ``origin``."""
    import jinja2

    token = _steps_left.set([MAX_LOOP_STEPS])
    try:
        return str(template.render(**{k: _plain(v) for k, v in variables.items()}))
    except jinja2.exceptions.SecurityError as exc:
        raise ValueError(f"chat template in {origin}: refused by the sandbox: {exc}") from None
    except jinja2.exceptions.UndefinedError as exc:
        raise ValueError(f"chat template in {origin}: undefined: {exc}") from None
    except OverflowError as exc:  # the sandbox's range bound
        raise ValueError(f"chat template in {origin}: {exc}") from None
    except (_Refused, jinja2.TemplateError) as exc:
        raise ValueError(f"chat template in {origin}: {exc}") from None
    except RecursionError:
        raise ValueError(f"chat template in {origin}: recursion too deep") from None
    except Exception as exc:  # a template is code: any failure of it is the file's fault
        raise ValueError(f"chat template in {origin}: {type(exc).__name__}: {exc}") from None
    finally:
        _steps_left.reset(token)


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (transformers' ``_plain_template_data``): a
    template never sees a subclass or foreign object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):  # np.bool_(False) must stay falsy
        return _plain(value.item())
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"
