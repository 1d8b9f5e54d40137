"""A reply to a request that offered tools, read as it is generated: its text and
its calls, as events a stream can send at once (OpenAI's and Anthropic's streams send
a call's name first, then its arguments' JSON text piece by piece).

``ReplyReader(form).feed(new_text)`` returns the events that text completes;
``finish()`` the rest. The forms are ``carpool.server.generation.tools``':

- generic: one JSON object, ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``
  or ``{"response": "..."}``; the response string is decoded as it comes.
- hermes: free text with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks; the text outside blocks is content (a possible block opening is held back
  until it is known not to be one).

A call starts (``CallStarted``, with its id) once its name is whole; its arguments
follow as the raw JSON text the model wrote (``ArgumentsDelta``), so the pieces join
to the call's arguments. Pure: no I/O.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from carpool.server.generation.tools import CLOSE, GENERIC, HERMES, OPEN
from carpool.server.http.json_scanner import JsonScanner, Path


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int  # the call's place among the reply's calls
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ReplyEvent = TextDelta | CallStarted | ArgumentsDelta


@dataclass
class ReadCall:
    """A call as read so far."""

    id: str
    name: str
    arguments: str = ""  # the JSON text read so far
    source: int = 0  # which JSON part of the reply holds it


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Span:
    start: int
    end: int | None = None


class _JsonPart:
    """One JSON value of the reply (the whole reply, or one hermes block), read for the
    calls in it: ``locate`` says which call and field (``name``, ``arguments``) a path
    is, or ``response`` for the answer's text."""

    def __init__(self, locate: Callable[[Path], tuple[int, str] | None]) -> None:
        self.text = ""
        self.spans: dict[tuple[int, str], _Span] = {}
        self.locate = locate
        self.scanner = JsonScanner(self._started, self._ended)

    def _started(self, path: Path, start: int) -> None:
        where = self.locate(path)
        if where is not None:
            self.spans[where] = _Span(start)

    def _ended(self, path: Path, start: int, end: int) -> None:
        where = self.locate(path)
        if where is not None and where in self.spans:
            self.spans[where].end = end

    def feed(self, text: str) -> None:
        self.text += text
        self.scanner.feed(text)

    def whole(self, where: tuple[int, str]) -> str | None:
        span = self.spans.get(where)
        if span is None or span.end is None:
            return None
        return self.text[span.start : span.end]

    def so_far(self, where: tuple[int, str]) -> str | None:
        span = self.spans.get(where)
        if span is None:
            return None
        return self.text[span.start : span.end]


def _generic_place(path: Path) -> tuple[int, str] | None:
    if path == ("response",):
        return (-1, "response")
    if len(path) == 3 and path[0] == "tool_calls" and isinstance(path[1], int):
        return (path[1], str(path[2])) if path[2] in ("name", "arguments") else None
    return None


def _block_place(path: Path) -> tuple[int, str] | None:
    if len(path) == 1 and path[0] in ("name", "arguments"):
        return (0, str(path[0]))
    return None


class ReplyReader:
    """Reads one choice's reply in ``form`` as its text arrives."""

    def __init__(self, form: str) -> None:
        if form not in (GENERIC, HERMES):
            raise ValueError(f"unknown tool form {form!r}")
        self.form = form
        self.calls: list[ReadCall] = []
        self.content = ""  # the answer's text sent so far
        self._parts: list[tuple[_JsonPart, int]] = []  # a JSON part, its first call's index
        self._held = ""  # hermes: text not yet known to be content or a block
        self._in_block = False
        self._response_sent = 0  # generic: decoded characters of the response sent
        if form == GENERIC:
            self._parts.append((_JsonPart(_generic_place), 0))

    def feed(self, text: str) -> list[ReplyEvent]:
        if self.form == GENERIC:
            self._parts[0][0].feed(text)
            return self._progress()
        return self._hermes(text, final=False)

    def finish(self) -> list[ReplyEvent]:
        """The events still held back once the reply is complete. The wrapper's own
        JSON is never content: a reply cut (by ``max_tokens``) before its answer or
        a call's name began says nothing more."""
        if self.form == HERMES:
            return self._hermes("", final=True)
        return self._progress()

    def complete_calls(self) -> list[ReadCall]:
        """The calls whose arguments were read whole (a reply cut inside a call
        leaves that call out)."""
        complete = []
        for index, call in enumerate(self.calls):
            part, first = self._parts[call.source]
            if part.whole((index - first, "arguments")) is not None:
                complete.append(call)
        return complete

    # -- hermes ------------------------------------------------------------------------

    def _hermes(self, text: str, final: bool) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        self._held += text
        while True:
            marker = CLOSE if self._in_block else OPEN
            at = self._held.find(marker)
            if at < 0:
                keep = 0 if final else partial_suffix(self._held, marker)
                ready, self._held = (
                    self._held[: len(self._held) - keep],
                    self._held[len(self._held) - keep :],
                )
                events += self._hermes_text(ready)
                return events
            events += self._hermes_text(self._held[:at])
            self._held = self._held[at + len(marker) :]
            if self._in_block:
                self._in_block = False
            else:
                self._in_block = True
                self._parts.append((_JsonPart(_block_place), len(self.calls)))

    def _hermes_text(self, text: str) -> list[ReplyEvent]:
        if not text:
            return []
        if self._in_block:
            self._parts[-1][0].feed(text)
            return self._progress()
        self.content += text
        return [TextDelta(text)]

    # -- calls and the answer ----------------------------------------------------------

    def _progress(self) -> list[ReplyEvent]:
        """The events for what the JSON parts have read since the last call."""
        events: list[ReplyEvent] = []
        for source, (part, first) in enumerate(self._parts):
            if self.form == GENERIC:
                events += self._response(part)
            for local in sorted({local for local, _ in part.spans if local >= 0}):
                events += self._named(part, source, first + local, local)
                events += self._arguments(part, source, first + local, local)
        return events

    def _named(self, part: _JsonPart, source: int, index: int, local: int) -> list[ReplyEvent]:
        """The call's start once its name is whole (calls start in order)."""
        raw = part.whole((local, "name"))
        if raw is None or index != len(self.calls):
            return []
        try:
            name = json.loads(raw)
        except json.JSONDecodeError:
            return []
        if not isinstance(name, str):
            return []
        call = ReadCall(call_id(), name, source=source)
        self.calls.append(call)
        return [CallStarted(index, call.id, name)]

    def _arguments(self, part: _JsonPart, source: int, index: int, local: int) -> list[ReplyEvent]:
        """The arguments' text written since the last event, once the call started."""
        if index >= len(self.calls) or self.calls[index].source != source:
            return []
        text = part.so_far((local, "arguments")) or ""
        call = self.calls[index]
        new = text[len(call.arguments) :]
        if not new:
            return []
        call.arguments = text
        return [ArgumentsDelta(index, new)]

    def _response(self, part: _JsonPart) -> list[ReplyEvent]:
        raw = part.so_far((-1, "response"))
        if raw is None:
            return []
        whole = part.whole((-1, "response")) is not None
        inner = raw[1:-1] if whole else raw[1:]
        try:
            decoded = json.loads('"' + inner[: _decodable(inner)] + '"')
        except json.JSONDecodeError:
            return []
        new = decoded[self._response_sent :]
        if not new:
            return []
        self._response_sent = len(decoded)
        self.content += new
        return [TextDelta(new)]


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _decodable(raw: str) -> int:
    """How much of a JSON string's inside (cut anywhere) decodes whole: not into an
    escape, nor between the halves of a surrogate pair."""
    i = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
            continue
        if i + 1 >= len(raw):
            break
        if raw[i + 1] != "u":
            i += 2
            continue
        if i + 6 > len(raw):
            break
        try:
            code = int(raw[i + 2 : i + 6], 16)
        except ValueError:
            break
        if 0xD800 <= code <= 0xDBFF:
            if i + 12 > len(raw):
                break
            i += 12
        else:
            i += 6
    return i
