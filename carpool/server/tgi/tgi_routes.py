"""Text Generation Inference's API over carpool's generation models: ``POST
/generate``, ``POST /generate_stream`` (server-sent events, one per token), ``POST /``
(either, by ``stream``) and ``GET /info``; errors in TGI's shape (``errors``).

An adapter over the completions path: the body becomes a ``CompletionRequest``
(TGI's sampling rule: greedy unless ``do_sample`` or a warper is set), tokenized,
constrained and started exactly as ``/v1/completions`` does; only the shaping
(``tgi_shaping``) is TGI's. Where the server has several generation models, a
``model`` field picks one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from carpool.engine.async_engine import GenerationStream
from carpool.engine.sampling_params import SamplingParams
from carpool.errors import CarpoolError, InvalidRequest
from carpool.server.generation.generation_inputs import (
    compile_grammar,
    prompt_token_ids,
    sampling_params,
)
from carpool.server.generation.schemas import CompletionRequest, StructuredOutputs
from carpool.server.http.errors import status_of
from carpool.server.http.sse import EventStream
from carpool.server.http.unicode_check import UnicodeCheckedRoute
from carpool.server.registry.served import (
    ServedGenerator,
    ServedModels,
    the_only,
    unless_disconnected,
)
from carpool.server.tei.tei_routes import embedder_info, the_embedder
from carpool.server.tgi.tgi_schemas import TgiGrammar, TgiParameters, TgiRequest
from carpool.server.tgi.tgi_shaping import StreamShaper, TokenFacts, error_body, generate_body
from carpool.version import __version__

# TGI's clients leave max_new_tokens unset and expect a short answer (the default that
# huggingface_hub documents); the whole context would be minutes on a CPU.
DEFAULT_MAX_NEW_TOKENS = 100


def router(models: ServedModels) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

    @api.post("/generate", response_model=None)
    async def generate(body: TgiRequest, request: Request) -> Response:
        return await _Call(models, body).answer(request)

    @api.post("/generate_stream", response_model=None)
    async def generate_stream(body: TgiRequest, request: Request) -> Response:
        return await _Call(models, body).stream()

    @api.post("/", response_model=None)
    async def compat(body: TgiRequest, request: Request) -> Response:
        call = _Call(models, body)
        if body.stream:
            return await call.stream()
        answer = await call.answer(request)
        return Response(b"[" + answer.body + b"]", media_type="application/json")

    @api.get("/info")
    async def info(model: str | None = None) -> dict[str, Any]:
        """TGI's info of the generation model; TEI's of the embedder where the server
        has no generation model (or ``model`` names an embedder)."""
        names = {g.name for g in models.generators}
        if (model is None and not names) or (model is not None and model not in names):
            return embedder_info(the_embedder(models, model))
        return info_body(the_generator(models, model))

    return api


def the_generator(models: ServedModels, name: str | None) -> ServedGenerator:
    """The generation model ``name``, or the server's only one; else 400 naming them."""
    if name is not None:
        return models.generator(name)
    return the_only(models.generators, "text generation")


def info_body(served: ServedGenerator) -> dict[str, Any]:
    """TGI's ``Info`` for ``served``."""
    return {
        "model_id": served.name,
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": served.engine.max_waiting or 0,
        "max_best_of": 1,
        "max_stop_sequences": 16,
        "max_input_tokens": served.max_model_len - 1,
        "max_total_tokens": served.max_model_len,
        "validation_workers": 1,
        "max_client_batch_size": 1,
        "router": "carpool",
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }


class _Call:
    """One TGI request: translated, started on the engine, shaped as TGI's."""

    def __init__(self, models: ServedModels, body: TgiRequest) -> None:
        self.models = models
        self.body = body
        self.params = body.parameters
        self.served = the_generator(models, body.model)
        self.facts = _facts(self.served)
        self.prefix = body.inputs if self.params.return_full_text else ""

    async def _start(self) -> GenerationStream:
        p = self.params
        _refuse_unsupported(p)
        completion = as_completion(self.served.name, self.body)
        prompts = await prompt_token_ids(self.models, self.served, completion.prompt, completion)
        try:
            grammar = await compile_grammar(self.models, self.served, completion)
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, param="parameters.grammar") from None
        top = p.top_n_tokens
        wants_logprobs = p.details or p.decoder_input_details or top is not None
        params: SamplingParams = sampling_params(
            self.served,
            completion,
            len(prompts[0]),
            completion.max_tokens,
            (top or 0) if wants_logprobs else None,
            prompt_logprobs=(top or 0) if p.decoder_input_details else None,
            grammar=grammar,
        )
        streams = self.served.engine.start_many(
            prompts, [params], priority=0, timeout_s=self.served.timeout(None)
        )
        return streams[0]

    async def answer(self, request: Request) -> Response:
        stream = await self._start()
        try:
            final = await unless_disconnected(request, stream.final())
        finally:
            stream.close()
        body = generate_body(
            self.facts,
            final,
            prefix=self.prefix,
            details=self.params.details or self.params.decoder_input_details,
            seed=self.params.seed,
            top_n=self.params.top_n_tokens is not None,
        )
        return Response(orjson.dumps(body), media_type="application/json")

    async def stream(self) -> Response:
        if self.params.decoder_input_details:
            raise InvalidRequest(
                "decoder_input_details is not available when streaming (as in TGI)",
                param="parameters.decoder_input_details",
            )
        stream = await self._start()
        shaper = StreamShaper(
            self.facts,
            prefix=self.prefix,
            details=self.params.details,
            seed=self.params.seed,
            top_n=self.params.top_n_tokens is not None,
        )
        return EventStream(_events(stream, shaper), ping=15, sep="\n")


async def _events(stream: GenerationStream, shaper: StreamShaper) -> AsyncIterator[dict[str, str]]:
    """The token events; a failure after the stream began ends it with TGI's error event."""
    try:
        async for out in stream:
            for event in shaper.events(out):
                yield {"data": orjson.dumps(event).decode()}
    except CarpoolError as exc:
        status, _ = status_of(exc)
        yield {"data": orjson.dumps(error_body(status, exc.message)).decode()}
    finally:
        stream.close()


def as_completion(model: str, body: TgiRequest) -> CompletionRequest:
    """The completion request that asks what ``body`` asks. TGI samples only with
    ``do_sample`` or a warper (a temperature other than 1, ``top_k``, ``top_p`` below
    1); otherwise it decodes greedily."""
    p = body.parameters
    sampling = (
        p.do_sample
        or p.temperature not in (None, 1.0)
        or p.top_k is not None
        or p.top_p not in (None, 1.0)
    )
    return CompletionRequest.model_validate(
        {
            "model": model,
            "prompt": body.inputs,
            "max_tokens": p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            "temperature": (p.temperature or 1.0) if sampling else 0.0,
            "top_p": p.top_p if sampling else None,
            "top_k": p.top_k if sampling else None,
            "seed": p.seed,
            "stop": p.stop,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty,
            "truncate_prompt_tokens": p.truncate,
            "structured_outputs": _structured(p.grammar),
        }
    )


def _structured(grammar: TgiGrammar | None) -> StructuredOutputs | None:
    """TGI's ``grammar`` as vLLM's ``structured_outputs``."""
    if grammar is None:
        return None
    value = grammar.value
    if grammar.type == "regex":
        if not isinstance(value, str):
            raise InvalidRequest("a regex grammar's value is a string", param="parameters.grammar")
        return StructuredOutputs(regex=value)
    if grammar.type == "json_schema":
        value = value.get("schema") if isinstance(value, dict) else None
    if not isinstance(value, dict | str):
        raise InvalidRequest(
            "a json grammar's value is a JSON schema (an object or its text)",
            param="parameters.grammar",
        )
    return StructuredOutputs.model_validate({"json": value})


def _refuse_unsupported(p: TgiParameters) -> None:
    """What TGI can do and carpool cannot: said by name rather than ignored."""
    if p.adapter_id is not None:
        raise InvalidRequest("LoRA adapters are not served", param="parameters.adapter_id")
    if p.watermark:
        raise InvalidRequest("watermarking is not supported", param="parameters.watermark")
    if p.typical_p not in (None, 1.0):
        raise InvalidRequest(
            "typical decoding is not supported; use top_p or min_p", param="parameters.typical_p"
        )


def _facts(served: ServedGenerator) -> TokenFacts:
    tokenizer = served.tokenizer
    return TokenFacts(tokenizer.decode, frozenset(tokenizer.all_special_ids))
