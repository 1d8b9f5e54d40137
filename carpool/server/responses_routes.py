"""OpenAI's Responses API: ``POST /v1/responses`` (streamed or whole), and the stored
responses' ``GET`` and ``DELETE /v1/responses/{id}``.

An adapter over the chat path: the request becomes a chat request
(``responses_adapter``), goes through ``prepare_chat`` to the engine, and its reply's
events are shaped by ``ResponseShaper``. With ``store`` (OpenAI's default) the
response and its conversation are kept in a bounded in-memory store, so a later
request may continue it with ``previous_response_id``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from carpool.engine.async_engine import GenerationStream
from carpool.server.chat_adapter import protocol_names
from carpool.server.generation_inputs import prepare_chat
from carpool.server.reply_stream import shape_stream, shape_whole
from carpool.server.response_store import ResponseStore, StoredResponse
from carpool.server.responses_adapter import NAMES, assistant_turn, chat_request, conversation
from carpool.server.responses_schemas import ResponsesRequest
from carpool.server.responses_shaping import ResponseShaper
from carpool.server.served import ServedModels
from carpool.server.sse import EventStream
from carpool.server.unicode_check import UnicodeCheckedRoute


def router(models: ServedModels, store: ResponseStore) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

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
        if body.stream:
            return EventStream(_streamed(shaper, stream, form, reasoning, store, turn))
        await shape_whole(request, stream, form, shaper, reasoning)
        _keep(store, shaper, turn)
        return Response(orjson.dumps(shaper.response()), media_type="application/json")

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return store.get(response_id).response

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


def _keep(store: ResponseStore, shaper: ResponseShaper, turn: list[dict[str, Any]]) -> None:
    """Keep a finished response (asked with ``store``) for ``previous_response_id``."""
    if shaper.body.store and shaper.status in ("completed", "incomplete"):
        conversation = [*turn, *assistant_turn(shaper.output)]
        store.keep(StoredResponse(shaper.response(), conversation))
