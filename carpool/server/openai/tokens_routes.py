"""vLLM's tokens-in, tokens-out API: ``POST /inference/v1/generate`` (vLLM's path;
``/v1/generate`` too). Prompt token ids and vLLM's ``SamplingParams`` in, each
choice's token ids out, whole or as server-sent events; nothing is detokenized for
the answer.

An adapter over the completions path: ``sampling_params`` is read as a completion
request's fields (same names, same ranges, errors naming ``sampling_params.<field>``),
then started exactly as ``/v1/completions`` starts a prompt of token ids. Only the
shaping (``tokens_choice``, ``tokens_logprobs``) is this API's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from carpool.engine.async_engine import GenerationStream
from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.errors import CarpoolError, InvalidRequest
from carpool.server.generation.generation_inputs import compile_grammar, sampling_params
from carpool.server.generation.schemas import CompletionRequest, GenerateTokensRequest
from carpool.server.http.errors import error_body, status_of, validated
from carpool.server.http.sse import DONE, EventStream, sse_event
from carpool.server.http.unicode_check import UnicodeCheckedRoute
from carpool.server.openai.openai_shaping import usage
from carpool.server.registry.served import ServedModels, unless_disconnected
from carpool.server.tgi.tgi_routes import the_generator

# Fields of a completion request that the tokens API sets itself, not its sampling_params.
_OWN = frozenset({"model", "prompt", "stream", "stream_options", "priority", "echo", "suffix"})


def router(models: ServedModels) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

    @api.post("/inference/v1/generate", response_model=None)
    @api.post("/v1/generate", response_model=None)
    async def generate(body: GenerateTokensRequest, request: Request) -> Response:
        served = the_generator(models, body.model)
        completion = as_completion(served.name, body)
        try:
            grammar = await compile_grammar(models, served, completion)
            params = sampling_params(
                served,
                completion,
                len(body.token_ids),
                completion.max_tokens,
                completion.logprobs,
                grammar=grammar,
            )
            stream = served.engine.start_many(
                [list(body.token_ids)],
                [params],
                priority=body.priority,
                timeout_s=served.timeout(completion.timeout),
            )[0]
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, param=_named(exc.param)) from None
        request_id = f"generate-tokens-{body.request_id or uuid.uuid4().hex}"
        head = {"id": request_id, "request_id": request_id, "model": served.name}
        wants_logprobs = completion.logprobs is not None
        if body.stream:
            with_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(_events(stream, head, wants_logprobs, with_usage), ping=15, sep="\n")
        try:
            final = await unless_disconnected(request, stream.final())
        finally:
            stream.close()
        answer = {
            **head,
            "created": int(time.time()),
            "choices": [
                tokens_choice(o, o.token_ids, o.logprobs, wants_logprobs) for o in final.outputs
            ],
            "usage": usage([final]),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    return api


def as_completion(model: str, body: GenerateTokensRequest) -> CompletionRequest:
    """The completion request ``body``'s sampling parameters describe; a bad one is a
    400 naming ``sampling_params.<field>``."""
    given = {k: v for k, v in body.sampling_params.items() if k not in _OWN}
    return validated(
        CompletionRequest,
        {**given, "model": model, "prompt": body.token_ids},
        at=("body", "sampling_params"),
    )


def _named(param: str | None) -> str | None:
    """A completion field's name as this API's body names it."""
    if param is None or param == "model":
        return param
    return "token_ids" if param == "prompt" else f"sampling_params.{param}"


def tokens_choice(
    out: CompletionOutput,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    wants_logprobs: bool,
) -> dict[str, Any]:
    """One choice of the answer (or of a streamed chunk: the new tokens alone)."""
    reason = out.finish_reason
    return {
        "index": out.index,
        "token_ids": list(token_ids),
        "finish_reason": None if reason is None else reason.value,
        "logprobs": tokens_logprobs(token_ids, logprobs) if wants_logprobs else None,
    }


def tokens_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """OpenAI's chat logprobs for tokens named by id (``token_id:<id>``, vLLM's way
    when nothing is detokenized)."""
    return {
        "content": [
            {
                "token": f"token_id:{t}",
                "logprob": lp.logprob,
                "top_logprobs": [{"token": f"token_id:{top}", "logprob": v} for top, v in lp.top],
            }
            for t, lp in zip(token_ids, logprobs, strict=False)
        ]
    }


async def _events(
    stream: GenerationStream, head: dict[str, Any], wants_logprobs: bool, with_usage: bool
) -> AsyncIterator[bytes]:
    """A chunk per step with each choice's new tokens; with usage asked, a last chunk
    that carries it; a failure after the stream began is an error event."""
    final: RequestOutput | None = None
    try:
        async for out in stream:
            final = out
            choices = [
                tokens_choice(o, o.new_token_ids, o.new_logprobs, wants_logprobs)
                for o in out.outputs
                if o.new_token_ids or o.finish_reason is not None
            ]
            if choices:
                yield sse_event({**head, "choices": choices})
        if with_usage and final is not None:
            yield sse_event({**head, "choices": [], "usage": usage([final])})
    except CarpoolError as exc:
        status, kind = status_of(exc)
        yield sse_event(error_body(status, exc.message, kind=kind, param=exc.param))
    finally:
        stream.close()
    yield DONE
