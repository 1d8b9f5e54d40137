"""A process-isolated decoupled model's streams on the server's side: its responses
come on a pipe of their own, its batch's answer names the streams on another, in
either order; a worker that ends fails what it left open."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from carpool.errors import BatchFailed
from carpool.repository.decoupled import ResponseStream
from carpool.repository.process import _OpenStreams


def read(stream: ResponseStream) -> list[int]:
    async def collect() -> list[int]:
        return [int(o["v"][0]) async for o in stream.responses(5.0)]

    return asyncio.run(collect())


def outputs(value: int) -> dict[str, Any]:
    return {"v": np.array([value])}


def test_responses_that_arrive_before_the_batch_names_their_stream_are_kept() -> None:
    streams = _OpenStreams()
    for item in (outputs(2), outputs(1), None):
        streams.deliver(7, item)
    assert read(streams.claim(7)) == [2, 1]


def test_a_stream_named_first_receives_what_comes_after() -> None:
    streams = _OpenStreams()
    stream = streams.claim(3)
    streams.deliver(3, outputs(5))
    streams.deliver(3, None)
    assert read(stream) == [5]


def test_a_worker_that_ends_fails_its_open_streams_and_those_named_later() -> None:
    streams = _OpenStreams()
    open_one = streams.claim(1)
    streams.deliver(1, outputs(9))
    for item in (outputs(4), None):  # ended before the worker did: kept whole
        streams.deliver(2, item)
    streams.deliver(3, outputs(6))  # not yet named, not ended
    streams.fail_all("its worker process ended")
    with pytest.raises(BatchFailed, match="worker process ended"):
        read(open_one)
    assert read(streams.claim(2)) == [4]
    with pytest.raises(BatchFailed, match="worker process ended"):
        read(streams.claim(3))
