"""What constrained decoding keeps to (:class:`Grammar`, from an OpenAI ``response_format`` or a
tool call's schema), the engine and matcher contracts, and the registry of engines by name."""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from portable_llm.extras import install_hint

__all__ = [
    "ENGINES",
    "ITEM_SEPARATOR",
    "KEY_SEPARATOR",
    "EngineFactory",
    "Grammar",
    "GrammarEngine",
    "Matcher",
    "grammar_engine",
    "grammar_of",
    "register_grammar_engine",
    "response_format_grammar",
]


#: The separators of the JSON every engine writes (``json.dumps``' defaults).
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "


@dataclass(frozen=True)
class Grammar:
    """JSON valid under ``schema``, after the text ``prefix`` and before ``suffix``.

    ``schema`` is a JSON schema (a dict, JSON-serializable); ``{"type": "object"}`` is any JSON
    object (``response_format`` ``json_object``).
    """

    schema: Mapping[str, Any]
    prefix: str = ""
    suffix: str = ""
    #: The schema as canonical JSON text (hashable: engines cache compiled grammars by it).
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.schema, Mapping):
            raise TypeError(f"Grammar: schema must be a dict, got {type(self.schema).__name__}")
        try:
            text = json.dumps(self.schema, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Grammar: the schema is not JSON ({exc})") from None
        object.__setattr__(self, "key", f"{self.prefix!r}{text}{self.suffix!r}")


class Matcher(Protocol):
    """One request's place in its grammar."""

    def allowed(self) -> np.ndarray:
        """A bool mask ``(V,)`` of the ids allowed next (the stop ids once complete)."""
        ...

    def accept(self, token: int, /) -> None:
        """Advance past ``token``; ``ValueError`` when the grammar does not allow it."""
        ...


class GrammarEngine(Protocol):
    """Compiles grammars against one tokenizer: ``matcher(grammar)`` starts a request."""

    name: str

    def matcher(self, grammar: Grammar, /) -> Matcher: ...


#: ``factory(tokenizer_json, vocab_size, stop_ids) -> GrammarEngine``, by name, the default
#: first.
EngineFactory = Callable[[str, int, Sequence[int]], GrammarEngine]
ENGINES: dict[str, EngineFactory] = {}
_engines: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], GrammarEngine]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def register_grammar_engine(name: str, factory: EngineFactory) -> None:
    """Make ``factory`` the engine called ``name`` (a later registration replaces it)."""
    ENGINES[name] = factory


def grammar_engine(
    tokenizer: Any, /, *, vocab_size: int, stop_ids: Iterable[int], name: str | None = None
) -> GrammarEngine:
    """The engine ``name`` (default: the first registered whose library is installed) for
    ``tokenizer`` (a :class:`~portable_llm.text.Tokenizer`), made once per tokenizer, vocabulary
    and stop ids (building one reads the whole vocabulary: about a second for 50k ids).

    Raises
    ------
    ValueError
        ``name`` is not registered.
    ImportError
        No engine's library is installed (or not the one named).
    """
    if name is not None and name not in ENGINES:
        raise ValueError(f"grammar_engine: name must be one of {sorted(ENGINES)}, got {name!r}")
    if tokenizer is None:
        raise ValueError("grammar_engine: constrained decoding needs the checkpoint's tokenizer")
    names = [name] if name is not None else list(ENGINES)
    key = (tuple(names), int(vocab_size), tuple(sorted(int(i) for i in stop_ids)))
    with _lock:
        made = _engines.setdefault(tokenizer, {})
        if key in made:
            return made[key]
        failures = []
        for candidate in names:
            try:
                engine = ENGINES[candidate](tokenizer.to_str(), key[1], key[2])
            except ImportError as exc:
                failures.append(f"{candidate}: {exc}")
                continue
            made[key] = engine
            return engine
    raise ImportError(
        f"constrained decoding needs a grammar engine: {install_hint('serve')} "
        f"(llguidance); tried {'; '.join(failures)}"
    )


def response_format_grammar(response_format: Any, /) -> Grammar | None:
    """The grammar of an OpenAI ``response_format``: ``None`` for ``{"type": "text"}``,
    any JSON object for ``{"type": "json_object"}``, the schema of ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}``.

    Raises
    ------
    TypeError, ValueError
        Naming ``response_format`` and the field at fault.
    """
    op = "response_format"
    if not isinstance(response_format, Mapping):
        raise TypeError(f"{op}: expected a dict, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar({"type": "object"})
    if kind != "json_schema":
        raise ValueError(f"{op}: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise TypeError(f"{op}: json_schema must be an object, got {type(spec).__name__}")
    schema = spec.get("schema", {})
    if not isinstance(schema, Mapping):
        raise TypeError(f"{op}: json_schema.schema must be an object, got {type(schema).__name__}")
    return Grammar(schema)


def grammar_of(response_format: Any, /) -> Grammar | None:
    """A :class:`Grammar` as given, or the grammar of an OpenAI ``response_format`` dict
    (:func:`response_format_grammar`); ``None`` for none (``{"type": "text"}``)."""
    if response_format is None or isinstance(response_format, Grammar):
        return response_format
    return response_format_grammar(response_format)
