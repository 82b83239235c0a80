"""Constrained decoding: a token mask per request, from a grammar engine chosen by name.

A :class:`Grammar` says what the output must be: JSON valid under a schema, between a literal
prefix and suffix (a tool call's ``<tool_call>\\n ... \\n</tool_call>``). A *grammar engine*
compiles it against the model's tokenizer into a :class:`Matcher`, which gives, before each token,
the ids allowed next (a mask over the vocabulary) and then accepts the token drawn.
:func:`constrained_logits` wraps matchers as a
:data:`~portable_llm.generation.sampler.LogitsProcessor`: the logits of ids not allowed become
``-inf`` before the sampler runs, so any sampler (greedy, top-p, seeded) draws inside the grammar.
Once the grammar is complete only the stop ids remain allowed, so the request ends there.

Engines are registered by name (:func:`register_grammar_engine`), as vLLM's structured-output
backends: ``llguidance`` (the default; in the ``serve`` extra) and ``xgrammar``
(used where installed and asked for by name). JSON is written compactly (``", "`` and ``": "``
separators, no other whitespace): a model cannot stall in whitespace, and the output is what
``json.dumps`` writes.

The cost of the mask per token is measured in ``benchmarks/grammar_mask.py`` (see
``benchmarks/README.md``).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from portable_llm.backends import backend_of
from portable_llm.core.types import Array
from portable_llm.extras import install_hint

__all__ = [
    "ENGINES",
    "Grammar",
    "GrammarEngine",
    "Matcher",
    "Constraint",
    "constrained_logits",
    "grammar_engine",
    "grammar_of",
    "mask_logits",
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


class Constraint:
    """One sequence kept inside a grammar: :meth:`allowed` takes the sequence's ids so far,
    whose generated ones begin at ``start`` (the matcher accepts those it has not seen), and
    gives the mask of the next."""

    def __init__(self, matcher: Matcher) -> None:
        self.matcher = matcher
        self.seen = 0  # generated ids the matcher accepted

    def allowed(self, ids: Sequence[int], /, *, start: int = 0) -> np.ndarray:
        for i in range(start + self.seen, len(ids)):
            self.matcher.accept(int(ids[i]))
        self.seen = len(ids) - start
        return self.matcher.allowed()


def mask_logits(logits: Array, masks: Sequence[np.ndarray | None], /) -> Array:
    """``logits`` ``(B, V)`` with ``-inf`` where row ``b``'s mask ``(V,)`` is ``False`` (a
    ``None`` mask keeps the row); on the logits' backend and device."""
    bk = backend_of(logits)
    assert bk is not None, "mask_logits: logits must be an array"
    B, V = logits.shape  # (B, V)
    if len(masks) != B:
        raise ValueError(f"mask_logits: {len(masks)} masks for logits of shape {(B, V)}")
    keep = np.ones((B, V), dtype=bool)
    for b, mask in enumerate(masks):
        if mask is not None:
            n = min(V, mask.shape[0])
            keep[b, :n] = mask[:n]
            keep[b, n:] = False
    allowed = bk.from_numpy(keep, bk.device_of(logits))  # (B, V)
    return bk.xp.where(allowed, logits, bk.xp.asarray(-bk.xp.inf, dtype=logits.dtype))


def constrained_logits(matchers: Sequence[Matcher], /) -> Callable[[Any, Array], Array]:
    """A logits processor (:data:`~portable_llm.generation.sampler.LogitsProcessor`) that keeps
    row ``b`` inside ``matchers[b]``'s grammar: the first call takes ``tokens[b]`` as the
    prompt; each call accepts the ids row ``b`` gained since, then masks the logits
    (:func:`mask_logits`)."""
    rows = [Constraint(m) for m in matchers]
    prompts: list[int] = []

    def processor(tokens: Any, logits: Array) -> Array:
        if not prompts:
            prompts.extend(len(row) for row in tokens)
        if len(tokens) != len(rows):
            raise ValueError(f"constrained_logits: {len(rows)} matchers for {len(tokens)} rows")
        masks = [c.allowed(row, start=p) for c, row, p in zip(rows, tokens, prompts, strict=True)]
        return mask_logits(logits, masks)

    return processor


#: The start of the message of a schema an engine cannot compile.
_UNSUPPORTED = "the JSON schema (response_format, or a tool's parameters) is not supported"


def _unpack(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bool mask ``(V,)`` from a bitmask of int32 words (bit ``i % 32`` of word ``i // 32``)."""
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


# -- llguidance ---------------------------------------------------------------------------------
class _LLGuidance:
    """llguidance's ``LLMatcher`` over a Lark grammar ``prefix %json{schema} suffix``; text of
    the prefix or suffix that is a special token's (Mistral's ``[TOOL_CALLS]``) is that
    token."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import llguidance

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=self.stop_ids or None
        )
        self._grammars: dict[str, str] = {}
        # special tokens by text: llguidance reads a literal's text as plain bytes, so a prefix
        # such as Mistral's "[TOOL_CALLS]" must name the token (the mask would offer the token
        # for the text, and consuming it would then fail)
        added = json.loads(tokenizer_json).get("added_tokens") or []
        self.specials = {
            t["content"]: int(t["id"]) for t in added if t.get("special") and t.get("content")
        }
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(self.specials, key=len, reverse=True)) + ")"
        )

    def literal(self, text: str) -> str:
        """Lark for ``text``: its special tokens as token ids (``<[id]>``), the rest quoted."""
        if not self.specials:
            return json.dumps(text)
        parts = [p for p in self._split.split(text) if p]
        return " ".join(
            f"<[{self.specials[p]}]>" if p in self.specials else json.dumps(p) for p in parts
        )

    def lark(self, grammar: Grammar) -> str:
        schema = dict(grammar.schema)
        schema["x-guidance"] = {
            "whitespace_flexible": False, "item_separator": ITEM_SEPARATOR,
            "key_separator": KEY_SEPARATOR,
        }  # fmt: skip
        parts = [self.literal(grammar.prefix)] if grammar.prefix else []
        parts.append("%json " + json.dumps(schema))
        if grammar.suffix:
            parts.append(self.literal(grammar.suffix))
        return "start: " + " ".join(parts) + "\n"

    def matcher(self, grammar: Grammar, /) -> Matcher:
        lark = self._grammars.get(grammar.key)
        if lark is None:
            lark = self.lark(grammar)
            error = self._ll.LLMatcher.validate_grammar(lark, self.tokenizer)
            if error:
                raise ValueError(f"{_UNSUPPORTED} by llguidance: {error[:500]}")
            self._grammars[grammar.key] = lark
        return _LLMatcher(self, self._ll.LLMatcher(self.tokenizer, lark, log_level=0))


class _LLMatcher:
    def __init__(self, engine: _LLGuidance, matcher: Any) -> None:
        self.engine, self.m = engine, matcher
        self.bits = np.zeros((engine.vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        if self.m.is_stopped() or self.m.is_error():
            mask = np.zeros(self.engine.vocab_size, dtype=bool)
            mask[[i for i in self.engine.stop_ids if i < mask.shape[0]]] = True
            return mask
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return _unpack(self.bits, self.engine.vocab_size)

    def accept(self, token: int, /) -> None:
        if self.m.is_stopped():
            return
        if not self.m.consume_token(token):
            raise ValueError(f"the grammar does not allow token {token}: {self.m.get_error()}")


# -- xgrammar -----------------------------------------------------------------------------------
class _XGrammar:
    """xgrammar's ``GrammarMatcher`` over ``prefix`` + its JSON-schema grammar + ``suffix``."""

    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import xgrammar  # type: ignore[import-not-found, unused-ignore]
        from tokenizers import Tokenizer as RustTokenizer
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        hf = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=self.stop_ids or None
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[str, Any] = {}

    def matcher(self, grammar: Grammar, /) -> Matcher:
        xgr = self._xgr
        compiled = self._compiled.get(grammar.key)
        if compiled is None:
            body = xgr.Grammar.from_json_schema(
                json.dumps(dict(grammar.schema)), any_whitespace=False,
                separators=(ITEM_SEPARATOR, KEY_SEPARATOR), strict_mode=False,
            )  # fmt: skip
            parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(t)}") for t in
                     (grammar.prefix,) if t] + [body] + [
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(t)}") for t in (grammar.suffix,) if t
            ]  # fmt: skip
            try:
                compiled = self.compiler.compile_grammar(xgr.Grammar.concat(*parts))
            except RuntimeError as exc:
                raise ValueError(f"{_UNSUPPORTED} by xgrammar: {str(exc)[:500]}") from None
            self._compiled[grammar.key] = compiled
        return _XMatcher(self, xgr.GrammarMatcher(compiled))


class _XMatcher:
    def __init__(self, engine: _XGrammar, matcher: Any) -> None:
        self.engine, self.m = engine, matcher
        self.bits = np.zeros((1, (engine.vocab_size + 31) // 32), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        if self.m.is_terminated():
            mask = np.zeros(self.engine.vocab_size, dtype=bool)
            mask[[i for i in self.engine.stop_ids if i < mask.shape[0]]] = True
            return mask
        self.m.fill_next_token_bitmask(self.bits, 0)
        return _unpack(self.bits[0], self.engine.vocab_size)

    def accept(self, token: int, /) -> None:
        if self.m.is_terminated():
            return
        if not self.m.accept_token(token):
            raise ValueError(f"the grammar does not allow token {token}")


register_grammar_engine("llguidance", _LLGuidance)
register_grammar_engine("xgrammar", _XGrammar)
