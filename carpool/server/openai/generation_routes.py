"""OpenAI-compatible text generation: /v1/chat/completions, /v1/completions, and
vLLM's /tokenize and /detokenize.

Thin: validate (pydantic), render and tokenize and build ``SamplingParams``
(``generation_inputs``), start one engine stream per prompt, then shape the outputs
(``openai_shaping``) as OpenAI's JSON or as Server-Sent Events (sse-starlette). A
stream that is left (client gone) aborts its request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Request, Response

from carpool.engine.async_engine import GenerationStream
from carpool.engine.request_output import RequestOutput
from carpool.engine.sampling_params import SamplingParams
from carpool.errors import CarpoolError, InvalidRequest
from carpool.server.generation.generation_inputs import (
    chat_prompt,
    check_prompt_count,
    compile_grammar,
    detokenize_ids,
    encode_prompts,
    prepare_chat,
    prompt_token_ids,
    sampling_params,
)
from carpool.server.generation.schemas import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from carpool.server.http.errors import error_body, status_of, validated
from carpool.server.http.sse import DONE, EventStream, sse_event
from carpool.server.http.unicode_check import UnicodeCheckedRoute
from carpool.server.openai.openai_shaping import Shaper, choice_delta, usage
from carpool.server.registry.served import (
    ServedGenerator,
    ServedModels,
    gather_or_cancel,
    unless_disconnected,
)
from carpool.server.tei import tei_routes
from carpool.server.tei.tei_schemas import TeiTokenizeRequest


def router(models: ServedModels) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

    @api.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        prepared = await prepare_chat(models, body)
        call = _Call(
            prepared.served,
            body,
            "chatcmpl",
            chat=True,
            tool_form=prepared.tool_form,
            reasoning=prepared.reasoning,
        )
        return await call.respond([prepared.prompt], prepared.params, request)

    @api.post("/v1/chat/completions/batch", response_model=None)
    async def chat_batch(body: BatchChatCompletionRequest, request: Request) -> Response:
        """vLLM's batch of conversations: each prepared as a chat of its own, all
        started together, answered as one completion (a choice per conversation)."""
        if body.stream:
            raise InvalidRequest("a batch of conversations is not streamed", param="stream")
        if body.tools or body.tool_choice not in (None, "none"):
            raise InvalidRequest("a batch of conversations cannot offer tools", param="tools")
        check_prompt_count(models.generator(body.model), len(body.messages), "messages")
        prepared = await asyncio.gather(
            *(prepare_chat(models, body.model_copy(update={"messages": m})) for m in body.messages)
        )
        first = prepared[0]
        call = _Call(first.served, body, "chatcmpl", chat=True, reasoning=first.reasoning)
        return await call.respond(
            [p.prompt for p in prepared], [p.params for p in prepared], request
        )

    @api.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served = models.generator(body.model)
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
            check_prompt_count(served, len(body.prompt))
        prompts = await prompt_token_ids(models, served, body.prompt, body)
        grammar = await compile_grammar(models, served, body)
        params = [
            sampling_params(
                served,
                body,
                len(p),
                16 if body.max_tokens is None else body.max_tokens,
                body.logprobs,
                prompt_logprobs=body.logprobs if body.echo else None,
                grammar=grammar,
            )
            for p in prompts
        ]
        call = _Call(served, body, "cmpl", chat=False, echo=body.echo)
        return await call.respond(prompts, params, request)

    @api.post("/tokenize")
    async def tokenize(raw: Annotated[dict[str, Any], Body()]) -> Any:
        """vLLM's tokenize, or TEI's (told by its ``inputs``, which vLLM's lacks)."""
        if "inputs" in raw:
            return await tei_routes.tokenize(models, validated(TeiTokenizeRequest, raw))
        return await _vllm_tokenize(validated(TokenizeRequest, raw))

    async def _vllm_tokenize(body: TokenizeRequest) -> dict[str, Any]:
        served = models.generator(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            tokens = await models.preprocess.run(
                chat_prompt, served, body.messages, body.add_generation_prompt, None
            )
        else:
            assert body.prompt is not None
            encoded = await models.preprocess.run(
                encode_prompts, served, [body.prompt], None, body.add_special_tokens
            )
            tokens = encoded[0]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": served.max_model_len}

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        served = models.generator(body.model)
        return {"prompt": await models.preprocess.run(detokenize_ids, served, body.tokens)}

    return api


class _Call:
    """One chat or completion call: its engine streams, shaped by a ``Shaper``."""

    def __init__(
        self,
        served: ServedGenerator,
        body: SamplingFields,
        prefix: str,
        *,
        chat: bool,
        echo: bool = False,
        tool_form: str | None = None,
        reasoning: str | None = None,
    ) -> None:
        self.served = served
        self.body = body
        self.shape = Shaper(
            call_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=served.name,
            n=body.n,
            decode=served.tokenizer.decode,
            chat=chat,
            echo=echo,
            tool_form=tool_form,
            reasoning=reasoning,
            echoed={"service_tier": body.service_tier} if body.service_tier else None,
        )

    async def respond(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        request: Request,
    ) -> Response:
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        streams = self._start(prompts, per_prompt)
        if self.body.stream:
            return EventStream(self._events(streams), ping=15, sep="\n")
        try:
            finals = await unless_disconnected(
                request, gather_or_cancel([asyncio.ensure_future(s.final()) for s in streams])
            )
        finally:
            for s in streams:
                s.close()
        return Response(orjson.dumps(self.shape.full(finals)), media_type="application/json")

    def _start(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> list[GenerationStream]:
        return self.served.engine.start_many(
            prompts,
            params,
            priority=self.body.priority,
            timeout_s=self.served.timeout(self.body.timeout),
        )

    # -- streaming -------------------------------------------------------------------

    async def _events(self, streams: list[GenerationStream]) -> AsyncIterator[bytes]:
        finals: dict[int, RequestOutput] = {}
        done: set[int] = set()
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        try:
            if self.shape.chat:
                first = {"role": "assistant", "content": ""}
                yield self.shape.chunk(
                    [choice_delta(i, first) for i in range(self.shape.n)],
                    include_usage,
                )
            async for p, out in _merge(streams):
                if out.finished:
                    finals[p] = out
                choices = [c for c in (self.shape.delta(p, out, o, done) for o in out.outputs) if c]
                if choices:
                    yield self.shape.chunk(choices, include_usage)
            if include_usage:
                ordered = [finals[p] for p in sorted(finals)]
                yield sse_event(self.shape.envelope([], usage(ordered)))
        except CarpoolError as exc:
            status, kind = status_of(exc)
            body = error_body(status, exc.message, kind=kind, param=exc.param)
            yield sse_event(body)
        finally:
            for s in streams:
                s.close()
        yield DONE


async def _merge(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every stream's outputs as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(p: int, stream: GenerationStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((p, out))
        except BaseException as exc:
            merged.put_nowait(exc)
            raise
        finally:
            merged.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
