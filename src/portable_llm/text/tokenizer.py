"""The checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library.

:class:`Tokenizer` encodes text to ids, decodes ids to text, and streams text while ids arrive
(:meth:`Tokenizer.stream`): a piece is released only once its bytes form whole characters, so a
character split over several byte-level tokens is never shown half-done. The chat template
(``chat_template.jinja``, or ``tokenizer_config.json``'s) is rendered in a Jinja sandbox
(:mod:`portable_llm.text.chat_template`) when ``jinja2`` is installed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from portable_llm.text.failures import foreign_errors

__all__ = [
    "TEMPLATE_FILES",
    "IdStream",
    "TextStream",
    "Tokenizer",
    "default_template",
    "stream_pieces",
]


class Tokenizer:
    """Encode and decode with a ``tokenizers.Tokenizer``; the special tokens of the folder.

    Parameters
    ----------
    tok : tokenizers.Tokenizer
    config : dict
        ``tokenizer_config.json`` (``chat_template``, ``bos_token``, ``eos_token``, ...),
        possibly empty.
    chat_template : str, optional
        The chat template's source; default: ``config["chat_template"]`` (the ``"default"``
        one of named templates).
    origin : str, optional
        The file the template came from, named in its errors.
    """

    def __init__(
        self,
        tok: Any,
        config: Mapping[str, Any] | None = None,
        *,
        chat_template: str | None = None,
        origin: str | None = None,
    ) -> None:
        self._tok = tok
        self.config = dict(config or {})
        if chat_template is None:
            chat_template = default_template(self.config.get("chat_template"))
            origin = origin or "tokenizer_config.json"
        self._template = chat_template
        self._origin = origin or "the chat template"
        self._rules: tuple[frozenset[int], frozenset[int]] | None = None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        """The id of a token string (``"<|endoftext|>"``), or ``None``."""
        return self._tok.token_to_id(token)

    def to_str(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar engines read the vocabulary
        from)."""
        return str(self._tok.to_str())

    def vocab(self) -> dict[str, int]:
        """Every token string and its id, added tokens included (to compare two tokenizers)."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's special tokens, e.g. a BOS).

        A failure of the tokenizer's own files (a pre-tokenizer regex past the regex engine's
        limits makes the Rust library panic) is a ``ValueError``; so is a lone surrogate in
        ``text`` (``"\\udc80"``, as ``surrogateescape`` makes of an undecodable byte), which is
        no Unicode text, named with its index."""
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"encode: text holds a lone surrogate {text[exc.start]!r} at index {exc.start}, "
                "which is not Unicode text (an undecodable byte read with surrogateescape?)"
            ) from None
        with foreign_errors("encode: the tokenizer failed on this text"):
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text (``tokenizer_config.json``'s ``bos_token``), or ``None``."""
        return _token_text(self.config.get("bos_token"))

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt: :meth:`encode`, without the post-processor's special tokens
        when ``text`` already starts with the BOS token (a rendered chat template), so the BOS
        is never doubled (mlx-lm's rule)."""
        bos = self.bos_token
        return self.encode(text, add_special_tokens=not (bos and text.startswith(bos)))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; ids the tokenizer does not know give nothing, as in tokenizers
        and transformers. An id outside ``[0, 2**32)`` is a ``ValueError`` naming it."""
        ids = list(ids)
        bad = next((i for i in ids if not 0 <= i < 2**32), None)
        if bad is not None:
            raise ValueError(f"decode: token id {bad} is not in [0, 2**32)")
        with foreign_errors("decode: the tokenizer failed on these ids"):
            return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def stream_decoder(self, *, skip_special_tokens: bool = True) -> TextStream:
        """A :class:`TextStream` of this tokenizer: ids in, new text out, O(window) per id."""
        return TextStream(self, skip_special_tokens=skip_special_tokens)

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Text pieces of a stream of ids: their concatenation is ``decode(all ids)``.

        Each id goes to a :class:`TextStream` (a short window decoded per id); a piece is
        released once its text is settled (whole characters, a closed run of byte-fallback
        tokens), and text held back at the end (an incomplete character, U+FFFD in
        :meth:`decode`) comes as a last piece.
        """
        return stream_pieces(self.stream_decoder(), ids)

    def _stream_rules(self, skip_special_tokens: bool) -> tuple[frozenset[int], frozenset[int]]:
        """What :class:`TextStream` needs of ``decode``: the ids it drops (special tokens, when
        skipped) and the byte-fallback ids (none unless the decoder has ``ByteFallback``)."""
        if self._rules is None:
            added = self._tok.get_added_tokens_decoder()
            specials = frozenset(i for i, t in added.items() if t.special)
            self._rules = (specials, _byte_fallback_ids(self._tok))
        specials, byte_ids = self._rules
        return (specials if skip_special_tokens else frozenset()), byte_ids

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (``None`` when the checkpoint has none)."""
        return self._template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """The prompt of ``messages`` (``[{"role": "user", "content": ...}]``), as transformers'
        ``apply_chat_template``: its text, or with ``tokenize=True`` its token ids.

        Renders the checkpoint's chat template in a sandbox
        (:mod:`portable_llm.text.chat_template`), with the special tokens of
        ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...), ``tools`` (JSON schemas)
        and ``kwargs`` (e.g. ``enable_thinking=False``) as template variables. The ids encode
        the text without the post-processor's special tokens (the template writes its own
        BOS), as transformers does. Needs ``jinja2``.

        Returns
        -------
        str, or list of int with ``tokenize=True``

        Raises
        ------
        ValueError
            No chat template, or the template fails (a syntax error, a sandbox refusal, an
            undefined name, its own ``raise_exception``): the message names its file.
        """
        from portable_llm.text.chat_template import compile_chat_template, render_chat_template

        if self._template is None:
            raise ValueError(
                "apply_chat_template: the checkpoint has no chat template (none in "
                f"{', '.join(TEMPLATE_FILES)})"
            )
        template = compile_chat_template(self._template, self._origin)
        if not isinstance(messages, Sequence) or isinstance(messages, str):
            raise TypeError("apply_chat_template: messages must be a list of dicts")
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise TypeError(f"apply_chat_template: each message must be a dict, got {m!r}")
            chat.append({k: v for k, v in m.items() if v is not None})  # as transformers
        texts = {k: _token_text(self.config.get(k)) for k in _SPECIAL_TOKENS}
        specials = {k: text for k, text in texts.items() if text is not None}
        text = render_chat_template(
            template,
            self._origin,
            {
                "messages": chat,
                "tools": None if tools is None else list(tools),
                "documents": None,
                "add_generation_prompt": bool(add_generation_prompt),
                **specials,
                **kwargs,
            },
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IdStream:
    """Incremental detokenization over any ``decode(ids) -> str``: ``step(id)`` returns the new
    text, ``finish()`` what is held back; the pieces together are ``decode(ids)``.

    A piece is released when the text decoded so far extends what was shown and does not end
    in U+FFFD (an incomplete character that the next id may complete). Each step decodes the
    ids since the last piece after the piece's own ids (so a decoder's rule for a first token
    sees context): O(window) per id.
    """

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._window: list[int] = []  # the last piece's ids (context), then pending ids
        self._context = 0
        self._shown = ""  # decode(window[:context])

    def step(self, token: int) -> str:
        self._window.append(int(token))
        return self._release()

    def _release(self) -> str:
        """The window's new text, if settled: the pending ids then become the context."""
        text = self._decode(self._window)
        if len(text) <= len(self._shown) or text.endswith("\ufffd"):
            return ""
        if not text.startswith(self._shown):
            return ""
        piece = text[len(self._shown) :]
        self._window = self._window[self._context :]
        self._context = len(self._window)
        self._shown = self._decode(self._window)
        return piece

    def finish(self) -> str:
        text = self._decode(self._window)
        rest = text[len(self._shown) :] if text.startswith(self._shown) else ""
        self._context, self._shown = len(self._window), text
        return rest


class TextStream(IdStream):
    """Incremental detokenization of one sequence: ``step(id)`` returns the new text that id
    completes (``""`` while the text is not settled), ``finish()`` what is still held back, so
    that all the pieces together equal ``tokenizer.decode(ids)``, U+FFFD included.

    Each step decodes a short window with the tokenizer's own ``decode``: the ids of the last
    piece (context, so that a decoder's rule for the first token, such as stripping its
    leading space, sees what it sees in the whole sequence) and the ids since (pending). The new
    text is the window's text past the context's, released once it is settled:

    - a trailing U+FFFD may still become a character (byte-level BPE: an incomplete UTF-8
      sequence), so it waits for the next id;
    - a run of byte-fallback ids (``<0x41>``, SentencePiece) is decoded as one byte string, all
      or nothing: ``<0x41>`` alone is ``"A"``, but ``<0x41> <0xC3>`` is two U+FFFD. The run
      waits, undecoded, until an id that is not a byte ends it;
    - ids that ``decode`` drops (special tokens when ``skip_special_tokens``, ids the tokenizer
      does not know) are dropped here too: a special token inside a byte run does not end it.

    The cost of an id is O(window), not O(ids so far): the window holds the last piece's ids
    and those pending. (``tokenizers.decoders.DecodeStream`` computes the same difference, but
    raises on a byte run that turns text it already returned into U+FFFD.)
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer._tok
        self._skip = skip_special_tokens
        self._dropped, self._bytes = tokenizer._stream_rules(skip_special_tokens)
        super().__init__(self._decode_ids)

    def _decode_ids(self, ids: list[int]) -> str:
        with foreign_errors("decode: the tokenizer failed on these ids"):
            return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def step(self, token: int) -> str:
        token = int(token)
        if not 0 <= token < 2**32:  # tokenizers' ids are u32
            raise ValueError(f"TextStream.step: token id {token} is not in [0, 2**32)")
        if token in self._dropped or self._tok.id_to_token(token) is None:
            return ""  # decode() drops it: nothing to show, and no byte run ends here
        self._window.append(token)
        if token in self._bytes:
            return ""  # the byte run may go on
        return self._release()


#: Where a checkpoint's chat template is read from, first found first (transformers 5's order).
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")
#: transformers' ``SPECIAL_TOKENS_ATTRIBUTES``: passed to the template when the config has them.
_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


def _byte_fallback_ids(tok: Any, /) -> frozenset[int]:
    """The ids a ``tokenizers.Tokenizer``'s ``ByteFallback`` decoder reads as one byte: tokens
    spelled ``<0xNN>`` (the library's test: six bytes, ``<0x`` and ``>`` around a base-16
    number), none when its decoder has no ``ByteFallback``."""
    decoder = tok.decoder
    if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
        return frozenset()
    return frozenset(
        i
        for t, i in tok.get_vocab(with_added_tokens=True).items()
        if len(t) == 6 and t.isascii() and t.startswith("<0x") and t.endswith(">")
        and _BYTE_DIGITS.fullmatch(t[3:5])
    )  # fmt: skip


#: Rust's ``u8::from_str_radix(s, 16)`` on two characters: a sign, or two hex digits.
_BYTE_DIGITS = re.compile(r"\+?[0-9A-Fa-f]{1,2}")


def _token_text(token: Any) -> str | None:
    if isinstance(token, Mapping):  # {"content": "<s>", ...}: a serialised AddedToken
        token = token.get("content")
    return token if isinstance(token, str) else None


def default_template(value: Any) -> Any:
    """A ``chat_template`` value: a string, or named templates (a list of ``{"name",
    "template"}`` or a dict), of which the default is taken."""
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    if isinstance(value, Mapping):
        value = value.get("default")
    return value


def stream_pieces(stream: Any, ids: Iterable[int]) -> Iterator[str]:
    """The text pieces of ``ids`` through an incremental decoder (``step(id) -> str``,
    ``finish() -> str``): each non-empty piece as it settles, then what the decoder held back.
    Their concatenation is the decoder's text of all the ids."""
    for token in ids:
        piece = stream.step(token)
        if piece:
            yield piece
    rest = stream.finish()
    if rest:
        yield rest
