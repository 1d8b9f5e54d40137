"""The models a server serves, and the bridge from the event loop to their batchers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from starlette.requests import Request

from carpool.batching import DynamicBatcher
from carpool.errors import ModelNotFound
from carpool.models.embedding import EmbeddingModel

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its result was ready; nothing is sent."""


@dataclass
class ServedEmbedding:
    """An embedding model behind a dynamic batcher."""

    name: str
    model: EmbeddingModel
    batcher: DynamicBatcher
    created: int = field(default_factory=lambda: int(time.time()))

    async def embed(
        self,
        inputs: list[list[int]],
        *,
        priority: int | None = None,
        timeout_s: float | None = None,
        request: Request | None = None,
    ) -> list[np.ndarray[Any, Any]]:
        """One embedding per input, all batched by the runtime.

        Raises the first ``CarpoolError`` among the inputs; the others are cancelled.
        Raises ``ClientDisconnected`` (and cancels everything) if the client leaves.
        """
        futures: list[asyncio.Future[Any]] = []
        try:
            for ids in inputs:
                cf = self.batcher.submit(ids, len(ids), level=priority, timeout_s=timeout_s)
                futures.append(asyncio.wrap_future(cf))
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return await unless_disconnected(request, gather_or_cancel(futures))


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
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise ClientDisconnected


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ServedModels:
    """Name -> served model."""

    def __init__(self, models: list[ServedEmbedding]) -> None:
        self._models = {m.name: m for m in models}

    def __iter__(self) -> Iterator[ServedEmbedding]:
        return iter(self._models.values())

    def get(self, name: str) -> ServedEmbedding:
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(
                f"model {name!r} is not served here; served: {', '.join(self._models)}",
                param="model",
            )
        return model
