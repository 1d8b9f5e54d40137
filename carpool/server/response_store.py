"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: a
bounded, in-memory store (the oldest goes first), owned by the event loop's thread
(only route handlers touch it). Nothing survives a restart."""

from __future__ import annotations

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


class ResponseNotFound(ModelNotFound):
    """No stored response has that id (404)."""


class ResponseStore:
    """At most ``capacity`` responses, the most recent kept."""

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def keep(self, stored: StoredResponse) -> None:
        self._kept[stored.response["id"]] = stored
        self._kept.move_to_end(stored.response["id"])
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._kept.get(response_id)
        if stored is None:
            raise ResponseNotFound(f"no stored response with id {response_id!r}")
        return stored

    def history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The conversation a request continues (400 naming ``previous_response_id``
        when it is not stored: never stored, or pushed out)."""
        if previous_response_id is None:
            return []
        stored = self._kept.get(previous_response_id)
        if stored is None:
            raise InvalidRequest(
                f"previous response with id {previous_response_id!r} not found "
                f"(this server keeps its last {self.capacity} stored responses, in memory)",
                param="previous_response_id",
            )
        return list(stored.conversation)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._kept[response_id]
