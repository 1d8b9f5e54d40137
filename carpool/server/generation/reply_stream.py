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
from carpool.server.generation.reply_reader import ReplyEvent, ReplyReader, TextDelta
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


async def reply_events(
    stream: GenerationStream, tool_form: str | None, reasoning: str | None = None
) -> AsyncIterator[StreamEvent]:
    """The events of ``stream``'s one sequence (read in ``tool_form`` when tools were
    offered; its thinking split off by the ``reasoning`` parser), ending with
    ``Finished``. Leaving early closes (aborts) the stream."""
    reader = None if tool_form is None else ReplyReader(tool_form)
    splitter = None if reasoning is None else ReasoningSplitter(reasoning)
    try:
        async for out in stream:
            piece = out.outputs[0].new_text
            split = Split(content=piece)
            if splitter is not None:
                split = splitter.feed(piece)
                if out.finished:
                    rest = splitter.finish()
                    split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
            if split.reasoning:
                yield ReasoningDelta(split.reasoning)
            if reader is None:
                if split.content:
                    yield TextDelta(split.content)
            else:
                for event in reader.feed(split.content):
                    yield event
            if out.finished:
                for event in [] if reader is None else reader.finish():
                    yield event
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
