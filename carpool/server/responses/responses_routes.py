"""OpenAI's Responses API: ``POST /v1/responses`` (streamed, whole, or in the
background), the stored responses' ``GET`` and ``DELETE /v1/responses/{id}``, and
``POST /v1/responses/{id}/cancel`` for a background one still running.

An adapter over the chat path: the request becomes a chat request
(``responses_adapter``), goes through ``prepare_chat`` to the engine, and its reply's
events are shaped by ``ResponseShaper``. With ``store`` (OpenAI's default) the
response and its conversation are kept in a bounded in-memory store, so a later
request may continue it with ``previous_response_id``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from carpool.engine.async_engine import GenerationStream
from carpool.errors import CarpoolError
from carpool.server.generation.chat_adapter import protocol_names
from carpool.server.generation.generation_inputs import prepare_chat
from carpool.server.generation.reply_stream import reply_events, shape_stream, shape_whole
from carpool.server.http.sse import EventStream
from carpool.server.http.unicode_check import UnicodeCheckedRoute
from carpool.server.registry.served import ServedModels
from carpool.server.responses.response_store import ResponseStore, StoredResponse
from carpool.server.responses.responses_adapter import (
    NAMES,
    assistant_turn,
    chat_request,
    conversation,
)
from carpool.server.responses.responses_schemas import ResponsesRequest
from carpool.server.responses.responses_shaping import ResponseShaper


def router(models: ServedModels, store: ResponseStore) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)
    background = Background(store)

    @api.post("/v1/responses", response_model=None)
    async def create(body: ResponsesRequest, request: Request) -> Response:
        history = store.history(body.previous_response_id)
        chat = chat_request(body, history)
        with protocol_names(NAMES):
            prepared = await prepare_chat(models, chat)
        shaper = ResponseShaper(body, prepared.served.name, int(time.time()))
        stream = prepared.start(chat)
        turn = [*history, *conversation(body)]
        form, reasoning = prepared.tool_form, prepared.reasoning
        if body.background:
            background.start(shaper, _folded(shaper, stream, form, reasoning), turn)
            return Response(orjson.dumps(shaper.response()), media_type="application/json")
        if body.stream:
            return EventStream(_streamed(shaper, stream, form, reasoning, store, turn))
        await shape_whole(request, stream, form, shaper, reasoning)
        _keep(store, shaper, turn)
        return Response(orjson.dumps(shaper.response()), media_type="application/json")

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        running = background.running.get(response_id)
        return running.response() if running else store.get(response_id).response

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict[str, Any]:
        """Cancel a background response still running; a finished one is returned as
        it ended (OpenAI's behaviour)."""
        running = background.running.get(response_id)
        if running is None:
            return store.get(response_id).response
        await background.cancel(response_id)
        return running.response()

    @api.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return api


async def _streamed(
    shaper: ResponseShaper,
    stream: GenerationStream,
    tool_form: str | None,
    reasoning: str | None,
    store: ResponseStore,
    turn: list[dict[str, Any]],
) -> AsyncIterator[dict[str, str]]:
    async for event in shape_stream(stream, tool_form, shaper, reasoning):
        yield event
    _keep(store, shaper, turn)


async def _folded(
    shaper: ResponseShaper, stream: GenerationStream, tool_form: str | None, reasoning: str | None
) -> None:
    """Feed the whole reply to ``shaper``; a request that fails ends it ``failed``."""
    try:
        async for event in reply_events(stream, tool_form, reasoning):
            shaper.on(event)
    except CarpoolError as exc:
        shaper.failed(exc)
    finally:
        stream.close()


class Background:
    """The background responses still running (OpenAI's ``background: true``): each
    an event-loop task that folds its reply, readable by ``GET`` while it runs and
    kept in the store when it ends (cancelled ones too)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.running: dict[str, ResponseShaper] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(
        self, shaper: ResponseShaper, fold: Coroutine[Any, Any, None], turn: list[dict[str, Any]]
    ) -> None:
        self.running[shaper.id] = shaper
        task = asyncio.ensure_future(self._run(shaper, fold, turn))
        self._tasks[shaper.id] = task

    async def _run(
        self, shaper: ResponseShaper, fold: Coroutine[Any, Any, None], turn: list[dict[str, Any]]
    ) -> None:
        try:
            await fold
        except asyncio.CancelledError:
            shaper.status = "cancelled"
        finally:
            self.running.pop(shaper.id, None)
            self._tasks.pop(shaper.id, None)
            _keep(self.store, shaper, turn)

    async def cancel(self, response_id: str) -> None:
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _keep(store: ResponseStore, shaper: ResponseShaper, turn: list[dict[str, Any]]) -> None:
    """Keep a finished response (asked with ``store``) for ``previous_response_id``
    (a background one also when it failed or was cancelled, for ``GET``)."""
    ended: tuple[str, ...] = ("completed", "incomplete")
    if shaper.body.background:
        ended += ("failed", "cancelled")
    if shaper.body.store and shaper.status in ended:
        conversation = [*turn, *assistant_turn(shaper.output)]
        store.keep(StoredResponse(shaper.response(), conversation))
