"""A decoupled model's response stream: responses in order from another thread,
checked as they are read; a failed one, a silence past the gap and a consumer that
leaves early each end it as they should."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from carpool.batching.request import Failed
from carpool.errors import InvalidRequest, ModelExecutionError
from carpool.repository.decoupled import ResponseStream


def read(stream: ResponseStream, gap_s: float | None = 30.0, most: int = 100) -> list[Any]:
    async def collect() -> list[Any]:
        got = []
        async for outputs in stream.responses(gap_s):
            got.append(outputs["v"].tolist())
            if len(got) == most:
                break
        return got

    return asyncio.run(collect())


def test_responses_from_another_thread_arrive_in_order_checked() -> None:
    stream = ResponseStream()
    stream.check = lambda outputs: {"v": outputs["v"] * 10}

    def send() -> None:
        for i in range(5):
            stream.put({"v": np.array([i])})
        stream.finish()

    threading.Thread(target=send).start()
    assert read(stream) == [[0], [10], [20], [30], [40]]


def test_a_failed_response_ends_the_stream_with_its_error() -> None:
    stream = ResponseStream()
    stream.put({"v": np.array([1])})
    stream.put(Failed(InvalidRequest("bad")))
    with pytest.raises(InvalidRequest, match="bad"):
        read(stream)


def test_silence_past_the_gap_fails_and_leaving_early_cancels() -> None:
    quiet = ResponseStream()
    with pytest.raises(ModelExecutionError, match="no response"):
        read(quiet, gap_s=0.01)
    stream = ResponseStream()
    stream.put({"v": np.array([1])})
    stream.put({"v": np.array([2])})
    assert read(stream, most=1) == [[1]]
    assert stream.cancelled


def test_on_cancel_is_called_when_the_consumer_leaves_before_the_final_flag_only() -> None:
    told: list[str] = []
    early, whole = ResponseStream(), ResponseStream()
    for stream, name in ((early, "early"), (whole, "whole")):
        stream.on_cancel = lambda name=name: told.append(name)  # type: ignore[misc]
        stream.put({"v": np.array([1])})
        stream.put({"v": np.array([2])})
        stream.finish()
    assert read(early, most=1) == [[1]] and read(whole) == [[1], [2]]
    assert told == ["early"] and early.cancelled and not whole.cancelled


def test_a_forwarded_stream_hands_on_what_it_held_then_each_response_in_order() -> None:
    """A worker process's stream: what was sent before ``forward`` first, then each
    response as it is sent, the final flag as None; nothing is kept to be read here."""
    stream = ResponseStream()
    first, failed = {"v": np.array([1])}, Failed(InvalidRequest("no"))
    stream.put(first)
    sent: list[Any] = []
    stream.forward(sent.append)
    stream.put(failed)
    stream.finish()
    assert sent == [first, failed, None]
    with pytest.raises(ModelExecutionError, match="no response"):
        read(stream, gap_s=0.01)
