"""One chat reply as protocol-neutral events: its reasoning (``--reasoning-parser``),
its text, its calls (read as they are generated, ``ReplyReader``) and its end. The
Responses and Messages adapters shape these events, streamed or folded into one body,
so both forms of a protocol's answer come from the same code."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from starlette.requests import Request

from carpool.engine.async_engine import GenerationStream
from carpool.engine.request_output import RequestOutput
from carpool.errors import CarpoolError
from carpool.server.generation.reasoning import ReasoningSplitter, Split
from carpool.server.generation.reply_reader import ReadCall, ReplyEvent, ReplyReader, TextDelta
from carpool.server.http.awaiting import unless_disconnected


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the reply's reasoning (a reasoning parser's part before the answer)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The reply ended: the engine's last output (finish reason, token counts)."""

    output: RequestOutput


StreamEvent = ReplyEvent | ReasoningDelta | Finished


class ReplyFolder:
    """One reply's text, piece by piece, as neutral events: its thinking split off by
    the ``reasoning`` parser (``ReasoningDelta``), then its answer, read for calls in
    ``tool_form`` when tools were offered (``ReplyReader``'s events) or else as
    ``TextDelta``. Every protocol's shaper folds these, streamed or whole."""

    def __init__(self, tool_form: str | None, reasoning: str | None = None) -> None:
        self.reader = None if tool_form is None else ReplyReader(tool_form)
        self.splitter = None if reasoning is None else ReasoningSplitter(reasoning)

    def feed(self, piece: str, last: bool) -> list[ReplyEvent | ReasoningDelta]:
        """The events ``piece`` completes; on the ``last``, what was held back too."""
        split = Split(content=piece)
        if self.splitter is not None:
            split = self.splitter.feed(piece)
            if last:
                rest = self.splitter.finish()
                split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
        events: list[ReplyEvent | ReasoningDelta] = []
        if split.reasoning:
            events.append(ReasoningDelta(split.reasoning))
        if self.reader is None:
            if split.content:
                events.append(TextDelta(split.content))
            return events
        events += self.reader.feed(split.content)
        if last:
            events += self.reader.finish()
        return events

    @property
    def called(self) -> bool:
        """Whether the reply has started any call."""
        return self.reader is not None and bool(self.reader.calls)

    def complete_calls(self) -> list[ReadCall]:
        """The calls read whole (``ReplyReader.complete_calls``); none without tools."""
        return [] if self.reader is None else self.reader.complete_calls()


async def reply_events(
    stream: GenerationStream, tool_form: str | None, reasoning: str | None = None
) -> AsyncIterator[StreamEvent]:
    """The events of ``stream``'s one sequence (``ReplyFolder``), ending with
    ``Finished``. Leaving early closes (aborts) the stream."""
    folder = ReplyFolder(tool_form, reasoning)
    try:
        async for out in stream:
            for event in folder.feed(out.outputs[0].new_text, out.finished):
                yield event
            if out.finished:
                yield Finished(out)
                return
    finally:
        stream.close()


class ReplyShaper(Protocol):
    """A protocol's shaper of one reply: its stream's opening events, each reply
    event's stream events (the whole answer kept as it goes), and the events that end
    a failed stream."""

    def started(self) -> list[dict[str, str]]: ...

    def on(self, event: StreamEvent) -> list[dict[str, str]]: ...

    def failed(self, exc: CarpoolError) -> list[dict[str, str]]: ...


async def shape_whole(
    request: Request,
    stream: GenerationStream,
    tool_form: str | None,
    shaper: ReplyShaper,
    reasoning: str | None = None,
) -> None:
    """Feed the whole reply to ``shaper`` (for a body sent at the end); a client that
    leaves first aborts it (``ClientDisconnected``)."""

    async def fold() -> None:
        async for event in reply_events(stream, tool_form, reasoning):
            shaper.on(event)

    try:
        await unless_disconnected(request, fold())
    finally:
        stream.close()


async def shape_stream(
    stream: GenerationStream,
    tool_form: str | None,
    shaper: ReplyShaper,
    reasoning: str | None = None,
) -> AsyncIterator[dict[str, str]]:
    """The reply as ``shaper``'s Server-Sent Events; a request that fails after the
    stream began ends it with the protocol's error events."""
    for opening in shaper.started():
        yield opening
    try:
        async for event in reply_events(stream, tool_form, reasoning):
            for shaped in shaper.on(event):
                yield shaped
    except CarpoolError as exc:
        for shaped in shaper.failed(exc):
            yield shaped
    finally:
        stream.close()
