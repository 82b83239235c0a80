"""A streamed answer split into its text and the deltas of its tool calls as it arrives."""

from __future__ import annotations

from portable_llm.text.tool_calls.calls import ToolCall, ToolCallDelta, new_call_id
from portable_llm.text.tool_calls.parser import ToolParser

__all__ = ["ToolCallStream"]


class ToolCallStream:
    """A streamed answer split as it arrives: ``feed(piece)`` returns ``(text, deltas)``, the
    new text to show and :class:`ToolCallDelta` pieces of the calls; ``feed("", final=True)``
    settles the end (output that never became a call is shown as text, as
    :meth:`ToolParser.parse` does, unless a call of it was already being sent).

    Text that could begin a call is held back until the next piece settles it; from the first
    call on nothing more is shown as text (text between calls is dropped, as the non-streamed
    :meth:`ToolParser.parse` keeps only the text before them). A call goes out as soon as its
    name and the ``{`` of its arguments are there (formats with :meth:`ToolParser.pending`),
    then its arguments as they come; otherwise whole, once complete. ``calls`` holds the
    complete calls so far, their ids those the stream sent.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""
        self._shown = 0  # characters shown as text
        self._begin: int | None = None  # where the calls begin
        self.calls: list[ToolCall] = []
        self._open: tuple[str, str] | None = None  # (id, arguments sent) of the call being sent

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._text += piece
        text = self._text
        if self._begin is None:
            self._begin = self.parser.begin(text)
        if self._begin is None:
            end = len(text) if final else len(text) - self.parser.held(text)
            return self._show(end), []
        shown = self._show(self._begin)
        body = text[self._begin :]
        calls, _ = self.parser.calls(body)
        if final and not calls and self._open is None:
            self._begin = len(text)  # never calls: all of it is text
            return shown + self._show(len(text)), []
        deltas = [d for call in calls[len(self.calls) :] for d in self._complete(call)]
        opened = None if final else self.parser.pending(body, len(self.calls))
        if opened is not None:
            deltas += self._progress(*opened)
        return shown, deltas

    def _complete(self, call: ToolCall) -> list[ToolCallDelta]:
        """The deltas that finish ``call`` (the rest of its arguments when it was being sent,
        else the whole call)."""
        index = len(self.calls)
        if self._open is None or not call.arguments.startswith(self._open[1]):
            out = [
                ToolCallDelta(index, "", call.id, call.name),
                ToolCallDelta(index, call.arguments),
            ]
        else:
            call = ToolCall(call.name, call.arguments, self._open[0])
            rest = call.arguments[len(self._open[1]) :]
            out = [ToolCallDelta(index, rest)] if rest else []
        self.calls.append(call)
        self._open = None
        return out

    def _progress(self, name: str, arguments: str) -> list[ToolCallDelta]:
        index = len(self.calls)
        out = []
        if self._open is None:
            self._open = (new_call_id(), "")
            out.append(ToolCallDelta(index, "", self._open[0], name))
        sent = self._open[1]
        if len(arguments) > len(sent) and arguments.startswith(sent):
            out.append(ToolCallDelta(index, arguments[len(sent) :]))
            self._open = (self._open[0], arguments)
        return out

    def _show(self, end: int) -> str:
        out = self._text[self._shown : max(end, self._shown)]
        self._shown = max(end, self._shown)
        return out
