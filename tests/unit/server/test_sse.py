"""Streamed events: one encoded ``data:`` line per chunk; sends without a timeout go
straight through, and a send timeout still applies when one is set."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from sse_starlette.sse import SendTimeoutError
from starlette.types import Message

from carpool.server.http.sse import DONE, EventStream, sse_event


def test_an_event_is_one_data_line_of_compact_json() -> None:
    payload = {"text": "two\nlines", "n": [1, 2]}
    event = sse_event(payload)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # the newline in the text is escaped in the JSON
    assert json.loads(event[len(b"data: ") :]) == payload
    assert DONE == b"data: [DONE]\n\n"


async def _nothing() -> AsyncIterator[bytes]:
    yield b""


def test_sends_go_straight_through_and_a_set_timeout_still_applies() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def stalled(message: Message) -> None:
        await asyncio.Event().wait()

    async def scenario() -> None:
        message: Message = {"type": "http.response.body", "body": b"x", "more_body": True}
        await EventStream(_nothing())._send_with_timeout(send, message)
        assert sent == [message]
        with pytest.raises(SendTimeoutError):
            await EventStream(_nothing(), send_timeout=0.01)._send_with_timeout(stalled, message)

    asyncio.run(scenario())
