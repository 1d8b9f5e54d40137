"""A repository model as the server serves it: its versions, each behind a dynamic
batcher on the device runtime, and the state model control moves it through."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request

from carpool.admission import RETRY_AFTER_S
from carpool.batching import DynamicBatcher
from carpool.errors import InvalidRequest, ModelNotFound, ModelUnavailable
from carpool.repository.decoupled import ResponseStream
from carpool.repository.payload import TensorPayload
from carpool.repository.repository import LoadedVersion
from carpool.repository.spec import CheckedRequest, ModelSpec
from carpool.repository.user_model import UserBatchModel
from carpool.server.http.awaiting import unless_disconnected


class ModelState(enum.Enum):
    """Triton's model states, as the repository index reports them."""

    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass
class ServedVersion:
    """One version of a repository model behind its batcher."""

    spec: ModelSpec
    model: UserBatchModel
    batcher: DynamicBatcher

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class ServedUserModel:
    """A repository model: every version its policy serves, the newest the default.

    Owned by the event loop: ``infer`` counts requests in flight so that unloading
    can wait for them (``drained``)."""

    name: str
    versions: dict[int, ServedVersion]
    state: ModelState = ModelState.READY
    created: int = field(default_factory=lambda: int(time.time()))
    _in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def from_loaded(cls, loaded: list[LoadedVersion]) -> ServedUserModel:
        versions = {
            v.spec.version: ServedVersion(
                v.spec,
                v.model,
                DynamicBatcher(v.spec.name, v.model, v.spec.batching, instances=v.model),
            )
            for v in loaded
        }
        served = cls(loaded[0].spec.name, versions)
        served._idle.set()
        return served

    @property
    def latest(self) -> ServedVersion:
        return self.versions[max(self.versions)]

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY and all(v.model.ready for v in self.versions.values())

    def version(self, version: str | None) -> ServedVersion:
        """The version named (the newest when ``None`` or empty)."""
        if not version:
            return self.latest
        if not version.isdigit() or int(version) not in self.versions:
            served = ", ".join(str(v) for v in sorted(self.versions))
            raise ModelNotFound(
                f"model '{self.name}' has no version {version!r}; served: {served}",
                param="version",
            )
        return self.versions[int(version)]

    async def infer(
        self,
        served: ServedVersion,
        checked: CheckedRequest,
        payload: TensorPayload,
        *,
        priority: int | None,
        timeout_s: float | None,
        request: Request | None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Run one request through the version's batcher; its outputs by name. A
        decoupled model must answer it with exactly one response here."""
        with self._counted():
            result = await self._result(served, checked, payload, priority, timeout_s, request)
            if isinstance(result, ResponseStream):
                timeout = served.model.timeout_s or None
                return await one_response(self.name, result.responses(timeout))
            return result

    async def responses(
        self,
        served: ServedVersion,
        checked: CheckedRequest,
        payload: TensorPayload,
        *,
        priority: int | None,
        timeout_s: float | None,
        request: Request | None,
    ) -> AsyncGenerator[dict[str, np.ndarray[Any, Any]], None]:
        """Run one request through the version's batcher; each response's outputs
        (one, but for a decoupled model). Counted in flight until the last response,
        so unloading waits for the whole answer. Close it (``aclosing``) when done."""
        with self._counted():
            result = await self._result(served, checked, payload, priority, timeout_s, request)
            if not isinstance(result, ResponseStream):
                yield result
                return
            async for outputs in result.responses(served.model.timeout_s or None):
                yield outputs

    async def _result(
        self,
        served: ServedVersion,
        checked: CheckedRequest,
        payload: TensorPayload,
        priority: int | None,
        timeout_s: float | None,
        request: Request | None,
    ) -> dict[str, np.ndarray[Any, Any]] | ResponseStream:
        """The batch's answer to one request: its outputs, or a decoupled model's
        stream of responses."""
        if self.state is not ModelState.READY:
            raise ModelUnavailable(f"model '{self.name}' is unloading", retry_after_s=RETRY_AFTER_S)
        lost = served.model.lost_reason
        if lost:
            raise ModelUnavailable(lost, retry_after_s=RETRY_AFTER_S)
        future = served.batcher.submit(
            payload,
            checked.cost,
            level=priority,
            timeout_s=timeout_s,
            size=checked.size,
            group=checked.group,
        )
        result: dict[str, np.ndarray[Any, Any]] | ResponseStream = await unless_disconnected(
            request, asyncio.wrap_future(future)
        )
        return result

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """One request in flight for its whole answer (``drained`` waits for it)."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def drained(self) -> None:
        """Once every request in flight has finished (new ones are refused while
        ``state`` is not READY)."""
        await self._idle.wait()


async def one_response(
    model: str, answers: AsyncGenerator[dict[str, np.ndarray[Any, Any]], None]
) -> dict[str, np.ndarray[Any, Any]]:
    """The one response of ``answers`` (closed after); ``InvalidRequest`` when a
    decoupled model sent none or several."""
    async with contextlib.aclosing(answers):
        collected = [outputs async for outputs in answers]
    if len(collected) != 1:
        raise InvalidRequest(
            f"decoupled model '{model}' sent {len(collected)} responses to this request; "
            f"read them from /v2/models/{model}/generate_stream",
            param="model",
        )
    return collected[0]
