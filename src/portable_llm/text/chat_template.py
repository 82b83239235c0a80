"""Chat templates: a checkpoint's Jinja template rendered in a sandbox, as transformers does.

A chat template comes with the checkpoint, so it is untrusted input. It is compiled in
``jinja2.sandbox.ImmutableSandboxedEnvironment`` with the environment transformers gives it
(``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension and ``{% generation %}``
blocks; ``raise_exception``, ``strftime_now``, a ``tojson`` that takes ``indent``, and
transformers' guarded ``dict`` and ``namespace``), so a template cannot reach Python's internals
(``cycler.__init__.__globals__``) nor change its inputs. Work is bounded too: ``range`` is the
sandbox's (at most ``MAX_RANGE`` items), and every render and every compile draws from one
:class:`~portable_llm.text.template_budget.Budget` of steps (loop iterations and calls), call
depth, the size of each value built and the total built (see
:mod:`portable_llm.text.template_budget`); a template source is at most :data:`MAX_SOURCE`
characters. Every error (syntax, security, an undefined name, ``raise_exception``, a bound
hit) is a ``ValueError`` that names the file the template came from.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy as np

from portable_llm.extras import install_hint
from portable_llm.text.failures import shorten
from portable_llm.text.template_budget import (
    CALL_STEPS,
    MAX_DEPTH,
    MAX_LOOP_STEPS,
    MAX_SIZE,
    MAX_WORK,
    Budget,
    Refused,
    binop,
    budget,
    checked_filter,
    checked_lipsum,
    checked_method,
    reset_budget,
    set_budget,
    size_of,
)
from portable_llm.text.template_budget import loop as budget_loop

__all__ = [
    "MAX_DEPTH",
    "MAX_LOOP_STEPS",
    "MAX_SIZE",
    "MAX_SOURCE",
    "MAX_WORK",
    "TemplateError",
    "compile_chat_template",
    "render_chat_template",
]


class TemplateError(ValueError):
    """A chat template that fails (a ``ValueError``); the message names the template's file
    and is at most :data:`~portable_llm.text.failures.MAX_MESSAGE` characters long (a
    template's ``raise_exception`` of a megabyte string stays a short message)."""

    def __init__(self, message: object = "") -> None:
        super().__init__(shorten(str(message)))


#: The longest template source compiled (real chat templates are a few to a few dozen KB).
MAX_SOURCE = 1_000_000


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
    """The sandboxed Jinja environment of chat templates (built once): transformers' filters
    and globals, every call, operator and join under the budget."""
    try:
        import jinja2
        import jinja2.ext
    except ImportError as exc:
        raise ImportError(f"apply_chat_template needs jinja2: {install_hint('chat')}") from exc
    env = _sandbox()(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_tag(), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: checked_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["_pl_budget"] = budget_loop
    env.globals["lipsum"] = checked_lipsum(env.globals["lipsum"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _template_namespace()
    return env


# The classes below subclass jinja2's, an optional dependency: each is built when the
# environment is (jinja2 imported then), never at import.


def _generation_tag() -> type:
    """The ``{% generation %}`` extension."""
    import jinja2.ext
    from jinja2 import nodes

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): the body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return Generation


def _template_namespace() -> type:
    """transformers' ``namespace`` global."""
    import jinja2
    from jinja2.utils import Namespace

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

    return TemplateNamespace


def _sandbox() -> type:
    """The sandboxed environment class: ``+ * ** %``, calls, ``~`` and joins under the budget."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        """Jinja's code generator, with ``~`` joined under the budget."""

        def visit_Concat(self, node: Any, frame: Any) -> None:
            self.write("environment.budget_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(("*", "**", "+", "%"))
        code_generator_class = Generator

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            if op == "+" and type(left) is str and type(right) is str:  # the common case
                budget().check(len(left) + len(right), "'+'")
                return left + right
            binop(op, left, right)
            return budget().built(super().call_binop(context, op, left, right), f"'{op}'")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            b = budget()
            b.step(CALL_STEPS)
            args = checked_method(__obj, args, kwargs)
            if b.depth >= MAX_DEPTH:
                raise Refused(f"calls nested more than {MAX_DEPTH} deep (a recursive macro?)")
            b.depth += 1
            try:
                call = ImmutableSandboxedEnvironment.call
                result = call(__self, __context, __obj, *args, **kwargs)
            finally:
                b.depth -= 1
            return b.built(result, "a call")

        def concat(self, parts: Any) -> str:
            """Every buffer join (the output, a macro's, a block's), under the budget."""
            return budget().join(parts)

        def budget_join(self, parts: Any) -> str:
            return budget().join(parts, "'~'")

    return Environment


def compile_chat_template(source: str, origin: str) -> Any:
    """The compiled template of ``source``; a ``ValueError`` naming ``origin`` (the file) when
    it is not a string, longer than :data:`MAX_SOURCE`, or not valid Jinja, or when what jinja2
    evaluates while compiling exceeds a budget."""
    if not isinstance(source, str):
        raise TemplateError(
            f"chat template in {origin}: expected a string, got {type(source).__name__}"
        )
    if len(source) > MAX_SOURCE:
        raise TemplateError(
            f"chat template in {origin}: {len(source)} characters (at most {MAX_SOURCE})"
        )
    return _compile(source, origin)


@lru_cache(maxsize=16)
def _compile(source: str, origin: str) -> Any:
    from jinja2 import nodes

    env = _environment()
    token = set_budget(Budget(len(source)))  # jinja2 folds constants while compiling
    try:
        tree = env.parse(source)
        for loop in tree.find_all(nodes.For):  # every loop draws from the render's budget
            loop.iter = nodes.Filter(loop.iter, "_pl_budget", [], [], None, None)
            loop.iter.set_lineno(loop.lineno)
            loop.iter.set_environment(env)
        return env.from_string(tree)
    except Exception as exc:  # a template is code: any failure of it is the file's fault
        raise _failure(origin, exc) from None
    finally:
        reset_budget(token)


def render_chat_template(template: Any, origin: str, variables: Mapping[str, Any]) -> str:
    """Render a compiled template with ``variables`` (made plain JSON data first, as
    transformers does); every failure is a ``ValueError`` naming ``origin``."""

    plain = {k: _plain(v) for k, v in variables.items()}
    token = set_budget(Budget(size_of(plain)))
    try:
        return str(template.render(**plain))
    except Exception as exc:  # a template is code: any failure of it is the file's fault
        raise _failure(origin, exc) from None
    finally:
        reset_budget(token)


def _failure(origin: str, exc: Exception) -> TemplateError:
    """The one message of a template's failure, compiling or rendering, naming ``origin``."""
    import jinja2

    if isinstance(exc, jinja2.TemplateSyntaxError):
        what = f"syntax error on line {exc.lineno}: {exc.message}"
    elif isinstance(exc, jinja2.exceptions.SecurityError):
        what = f"refused by the sandbox: {exc}"
    elif isinstance(exc, jinja2.exceptions.UndefinedError):
        what = f"undefined: {exc}"
    elif isinstance(exc, RecursionError):
        what = "nested too deeply (Python's recursion limit)"
    elif isinstance(exc, Refused | jinja2.TemplateError | OverflowError):  # range's bound
        what = str(exc)
    else:
        what = f"{type(exc).__name__}: {exc}"
    return TemplateError(f"chat template in {origin}: {what}")


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
