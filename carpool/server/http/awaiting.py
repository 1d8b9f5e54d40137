"""Awaiting a request's results on the event loop: all of them or the first error,
and nothing at all once the client has gone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its result was ready; nothing is sent."""


async def gather_or_cancel(futures: list[asyncio.Future[T]]) -> list[T]:
    """All results, or the first error with every other future cancelled."""
    try:
        return list(await asyncio.gather(*futures))
    except BaseException:
        for f in futures:
            f.cancel()
        raise


async def unless_disconnected(request: Request | None, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise
    ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)
    if request is None:
        return await task
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    # The watcher cancels the work when the client leaves: cheaper on the event loop
    # than asyncio.wait's waiter and callbacks on every request.
    watcher.add_done_callback(lambda w: w.cancelled() or task.cancel())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientDisconnected from None
        raise
    finally:
        watcher.cancel()
        task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
