"""A job's tokens as text: streaming detokenization and stop strings matched across token
boundaries, never emitted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["StopStrings", "TextOut"]


class StopStrings:
    """Text in, text safe to show out: a suffix that could begin a stop string is held back
    until the next piece settles it; the text from the first stop string on is never shown.

    ``feed(piece)`` returns ``(text, stopped)``; ``feed("", final=True)`` releases what is
    held back at the end.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._text += piece
        text, sent = self._text, self._sent
        hits = [i for i in (text.find(s, sent) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._sent = len(text)
            return text[sent : min(hits)], True
        hold = 0
        if not final:
            for s in self.stops:  # the longest end of the text that starts a stop string
                for k in range(min(len(s) - 1, len(text) - sent), hold, -1):
                    if text.endswith(s[:k]):
                        hold = k
                        break
        end = len(text) - hold
        self._sent = end
        return text[sent:end], False


class TextOut:
    """One job's text: ``step(token)`` and ``finish()`` return the new text to show (the
    tokenizer's :class:`~portable_llm.text.tokenizer.TextStream`, then :class:`StopStrings`);
    ``stopped`` once a stop string matched. ``skip_special_tokens=False`` keeps special tokens
    in the text (a tool-call format whose markers are special tokens: Mistral's)."""

    def __init__(
        self, tokenizer: Any, stops: Sequence[str], *, skip_special_tokens: bool = True
    ) -> None:
        self._stream = (
            tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self._stops = StopStrings(stops)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def step(self, token: int) -> str:
        piece = self._stream.step(token) if self._stream is not None else ""
        return self._stops.feed(piece)[0]

    def finish(self) -> str:
        rest = self._stream.finish() if self._stream is not None else ""
        return self._stops.feed(rest, final=True)[0]
