"""Any tokenizer with ``encode`` and ``decode`` as text generation uses it.

Generation calls four things of a tokenizer: ``encode_prompt(text)``, ``decode(ids)``,
``stream(ids)`` and ``stream_decoder()`` (:class:`~portable_llm.Tokenizer` has them all).
:func:`text_tokenizer` hands those back for a model's tokenizer of any library: a
``pl.Tokenizer`` as it is; any other object with ``encode(text)`` (ids, or an object with
``.ids`` as ``tokenizers.Tokenizer`` returns) and ``decode(ids)`` (transformers', tokenizers',
a course's) wrapped in :class:`EncodeDecodeTokenizer`. :func:`check_same_tokenizer` is the check
that a draft's ids mean the target's, for any two of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from portable_llm.text.failures import foreign_errors
from portable_llm.text.tokenizer import IdStream, stream_pieces

__all__ = ["EncodeDecodeTokenizer", "IdStream", "check_same_tokenizer", "text_tokenizer"]

#: What text generation calls on a tokenizer (:class:`~portable_llm.Tokenizer` has them).
TEXT_MEMBERS = ("encode_prompt", "decode", "stream", "stream_decoder")
#: How many ids two tokenizers that state no vocabulary must decode alike (each alone).
DECODED_IDS = 4096


def text_tokenizer(tokenizer: Any, /) -> Any:
    """``tokenizer`` with the members text generation calls: itself when it has them (a
    :class:`~portable_llm.Tokenizer`), ``None`` for ``None``, else an
    :class:`EncodeDecodeTokenizer` around its ``encode`` and ``decode``."""
    if tokenizer is None or all(callable(getattr(tokenizer, m, None)) for m in TEXT_MEMBERS):
        return tokenizer
    return EncodeDecodeTokenizer(tokenizer)


class EncodeDecodeTokenizer:
    """A tokenizer of another library seen through ``encode(text)`` and ``decode(ids)``.

    ``encode_prompt`` is the tokenizer's ``encode`` (its own rule for special tokens; an
    ``Encoding``'s ``.ids`` are taken), ``decode`` its ``decode``, and :meth:`stream_decoder`
    an :class:`IdStream` over its ``decode``. ``vocab()`` is its ``get_vocab()`` (transformers,
    tokenizers) or ``vocab()``, else ``None``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_prompt(self, text: str) -> list[int]:
        with foreign_errors("encode: the tokenizer failed on this text"):
            out = self.tokenizer.encode(text)
        ids = getattr(out, "ids", out)  # tokenizers' Encoding, else ids
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        with foreign_errors("decode: the tokenizer failed on these ids"):
            return str(self.tokenizer.decode([int(i) for i in ids]))

    def stream_decoder(self) -> IdStream:
        return IdStream(self.decode)

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Text pieces whose concatenation is ``decode(all ids)``."""
        return stream_pieces(self.stream_decoder(), ids)

    def vocab(self) -> dict[str, int] | None:
        for name in ("get_vocab", "vocab"):
            table = getattr(self.tokenizer, name, None)
            if callable(table):
                return dict(table())
        return None


def check_same_tokenizer(op: str, target: Any, draft: Any, /) -> None:
    """A ``ValueError`` unless the draft's ids mean the target's: the same vocabulary (token ->
    id) where both state one, else the same text for each of the first :data:`DECODED_IDS`
    ids decoded alone (an id one of them cannot decode counts as such). Nothing to check when
    either is ``None``."""
    if target is None or draft is None:
        return
    tm, td = text_tokenizer(target), text_tokenizer(draft)
    am, ad = _vocab(tm), _vocab(td)
    if am is not None and ad is not None:
        if am != ad:
            diff = sorted(set(am.items()) ^ set(ad.items()), key=lambda item: item[1])[:3]
            raise ValueError(
                f"{op}: the draft's tokenizer differs from the target's ({len(ad)} and "
                f"{len(am)} tokens; first differences (token, id): {diff})"
            )
        return
    for i in range(DECODED_IDS):
        a, b = _decoded(tm, i), _decoded(td, i)
        if a != b:
            raise ValueError(
                f"{op}: the draft's tokenizer differs from the target's: id {i} decodes to "
                f"{b!r} and {a!r}"
            )


def _decoded(tokenizer: Any, i: int) -> str | None:
    """The text of id ``i`` alone, ``None`` where the tokenizer cannot decode it."""
    try:
        return str(tokenizer.decode([i]))
    except Exception:  # a foreign tokenizer's own error: the id is not in it
        return None


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    table = getattr(tokenizer, "vocab", None)
    out = table() if callable(table) else None
    return None if out is None else dict(out)
