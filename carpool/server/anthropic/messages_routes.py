"""Anthropic's Messages API: ``POST /v1/messages`` (streamed or whole) and
``POST /v1/messages/count_tokens``.

An adapter over the chat path: the request becomes a chat request
(``messages_adapter``), goes through ``prepare_chat`` to the engine, and its reply's
events are shaped by ``MessageShaper``. Errors come in Anthropic's shape
(``errors.protocol_of``).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from carpool.server.anthropic.messages_adapter import NAMES, chat_request
from carpool.server.anthropic.messages_schemas import CountTokensRequest, MessagesRequest
from carpool.server.anthropic.messages_shaping import MessageShaper
from carpool.server.generation.chat_adapter import protocol_names
from carpool.server.generation.generation_inputs import chat_prompt, offered_tools, prepare_chat
from carpool.server.generation.reply_stream import shape_stream, shape_whole
from carpool.server.http.sse import EventStream
from carpool.server.http.unicode_check import UnicodeCheckedRoute
from carpool.server.registry.served import ServedModels


def router(models: ServedModels) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

    @api.post("/v1/messages", response_model=None)
    async def create(body: MessagesRequest, request: Request) -> Response:
        chat = chat_request(body)
        with protocol_names(NAMES):
            prepared = await prepare_chat(models, chat)
        shaper = MessageShaper(
            prepared.served.name, len(prepared.prompt), body.stop_sequences or []
        )
        stream = prepared.start(chat)
        form, reasoning = prepared.tool_form, prepared.reasoning
        if body.stream:
            return EventStream(shape_stream(stream, form, shaper, reasoning))
        await shape_whole(request, stream, form, shaper, reasoning)
        return Response(orjson.dumps(shaper.message()), media_type="application/json")

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        chat = chat_request(body)
        with protocol_names(NAMES):
            served = models.generator(chat.model)
            offered = offered_tools(served, chat)
            prompt = await models.preprocess.run(
                chat_prompt, served, chat.messages, True, chat, offered
            )
        return {"input_tokens": len(prompt)}

    return api
