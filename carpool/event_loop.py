"""The event loop carpool's own asyncio programs run on (the server, ``carpool bench``'s
client): uvloop's where it is installed. A load generator on the server's cores takes
what it spends from the server: on two cores at 64 streams the standard loop's client
took ~17 us of CPU a token and uvloop's ~15 (BENCHMARKS.md, session 40)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` where uvloop is installed, else None (asyncio's own).
    uvicorn only picks uvloop itself when it owns the loop, which in carpool it does not."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` gives."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
