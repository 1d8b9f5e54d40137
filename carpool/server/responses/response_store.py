"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: a
bounded, in-memory store (the oldest goes first), owned by the event loop's thread
(only route handlers touch it). Nothing survives a restart."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from carpool.errors import InvalidRequest, ModelNotFound


@dataclass(frozen=True)
class StoredResponse:
    """A response, and the conversation that ends with it (chat messages, without the
    request's instructions, which OpenAI does not carry over)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]

    def size(self) -> int:
        """Bytes it holds, as JSON (what a client sent and was sent back, roughly)."""
        return len(json.dumps(self.response)) + len(json.dumps(self.conversation))


class ResponseNotFound(ModelNotFound):
    """No stored response has that id (404)."""


class ResponseStore:
    """At most ``capacity`` responses holding at most ``capacity_bytes`` together (as
    JSON), the most recent kept; one larger than ``capacity_bytes`` alone is not kept."""

    def __init__(self, capacity: int = 1024, capacity_bytes: int = 64 << 20) -> None:
        if capacity < 1 or capacity_bytes < 1:
            raise ValueError("capacity and capacity_bytes must be at least 1")
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._kept: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def keep(self, stored: StoredResponse) -> None:
        key = stored.response["id"]
        self._forget(key)
        size = stored.size()
        if size > self.capacity_bytes:
            return
        self._kept[key] = (stored, size)
        self._bytes += size
        while len(self._kept) > self.capacity or self._bytes > self.capacity_bytes:
            self._forget(next(iter(self._kept)))

    def _forget(self, response_id: str) -> None:
        entry = self._kept.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry[1]

    def get(self, response_id: str) -> StoredResponse:
        entry = self._kept.get(response_id)
        if entry is None:
            raise ResponseNotFound(f"no stored response with id {response_id!r}")
        return entry[0]

    def history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The conversation a request continues (400 naming ``previous_response_id``
        when it is not stored: never stored, or pushed out)."""
        if previous_response_id is None:
            return []
        entry = self._kept.get(previous_response_id)
        if entry is None:
            raise InvalidRequest(
                f"previous response with id {previous_response_id!r} not found "
                f"(this server keeps its last {self.capacity} stored responses, at most "
                f"{self.capacity_bytes >> 20} MiB of them, in memory)",
                param="previous_response_id",
            )
        return list(entry[0].conversation)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._forget(response_id)
