"""The grammar engines: llguidance (the default) and xgrammar, each registered by name with
:func:`~portable_llm.generation.grammar.spec.register_grammar_engine`; their libraries are
imported when an engine is first built."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_llm.generation.grammar.spec import (
    ITEM_SEPARATOR,
    KEY_SEPARATOR,
    Grammar,
    Matcher,
    register_grammar_engine,
)

__all__: list[str] = []  # reached through the registry


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
