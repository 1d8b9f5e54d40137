"""OpenAI-compatible text generation: /v1/chat/completions, /v1/completions, and
vLLM's /tokenize and /detokenize.

Thin: validate (pydantic), render and tokenize, build ``SamplingParams``, start
one engine stream per prompt, then shape the outputs as OpenAI's JSON or as
Server-Sent Events (sse-starlette). A stream that is left (client gone) aborts
its request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from sse_starlette.sse import EventSourceResponse

from carpool.engine.async_engine import GenerationStream, max_request_prompts
from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.engine.sampling_params import Grammar, SamplingParams
from carpool.engine.sequence import FinishReason
from carpool.errors import CarpoolError, InvalidRequest, RequestTooLarge
from carpool.server.errors import status_of
from carpool.server.preprocess import Keep, TooManyTokens, encode_within
from carpool.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    SamplingFields,
    TokenizeRequest,
)
from carpool.server.served import (
    ServedGenerator,
    ServedModels,
    gather_or_cancel,
    unless_disconnected,
)
from carpool.server.tools import (
    ToolSpec,
    calls_as_content,
    chosen_tools,
    read_reply,
    tool_grammar,
    tools_prompt,
    with_tools_prompt,
)
from carpool.server.unicode_check import UnicodeCheckedRoute

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def router(models: ServedModels) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

    @api.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        served = models.generator(body.model)
        offered = offered_tools(body)
        prompt = await models.preprocess.run(
            chat_prompt, served, body.messages, body.add_generation_prompt, body, offered
        )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens
        grammar = await compile_grammar(models, served, body, offered)
        params = sampling_params(
            served,
            body,
            len(prompt),
            body.max_tokens if max_tokens is None else max_tokens,
            logprobs,
            grammar=grammar,
        )
        call = _Call(served, body, "chatcmpl", chat=True, tools=offered is not None)
        return await call.respond([prompt], params, request)

    @api.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served = models.generator(body.model)
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
            check_prompt_count(served, len(body.prompt))
        prompts = await models.preprocess.run(tokenize_prompts, served, body.prompt, body)
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
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
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


def detokenize_ids(served: ServedGenerator, ids: list[int]) -> str:
    """The text of ``ids``, each checked against the vocabulary. Runs on the
    pre-processing pool."""
    vocab = served.lm.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"token ids must be in [0, {vocab})", param="tokens")
    return served.tokenizer.decode(ids)


@dataclass(frozen=True)
class OfferedTools:
    """The tools a chat request lets the model call, and how."""

    tools: list[ToolSpec]
    required: bool
    parallel: bool


def offered_tools(body: ChatCompletionRequest) -> OfferedTools | None:
    """The tools ``body`` offers (None: none, or ``tool_choice: none``)."""
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice != "none":
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    specs = [
        ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in body.tools
    ]
    if len({t.name for t in specs}) != len(specs):
        raise InvalidRequest("tools must have distinct names", param="tools")
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    plain = None if isinstance(choice, NamedToolChoice) else choice
    tools, required = chosen_tools(specs, plain, named)
    if not tools:
        return None
    if body.response_format is not None or body.structured_outputs is not None:
        raise InvalidRequest(
            "response_format and structured_outputs cannot be combined with tools",
            param="response_format",
        )
    return OfferedTools(tools, required, body.parallel_tool_calls)


def chat_prompt(
    served: ServedGenerator,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    body: SamplingFields | None,
    offered: OfferedTools | None = None,
) -> list[int]:
    """The conversation rendered with the model's own chat template, as token ids
    (``body``: the request whose ``truncate_prompt_tokens`` applies; ``offered``:
    tools described in the system message). Runs on the pre-processing pool."""
    text = render_chat(served, messages, add_generation_prompt, offered)
    return encode_prompts(served, [text], body, add_special_tokens=False)[0]


def render_chat(
    served: ServedGenerator,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    offered: OfferedTools | None = None,
) -> str:
    """The conversation rendered with the model's own chat template; assistant turns
    that called tools are written in the tool wrapper's JSON (``carpool.server.tools``)."""
    plain: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(
                        "only text content parts are supported", param=f"messages[{i}].content"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if m.tool_calls:
            content = calls_as_content(
                [c.model_dump() for c in m.tool_calls], f"messages[{i}].tool_calls"
            )
        plain.append({"role": m.role, "content": content or ""})
    if offered is not None:
        plain = with_tools_prompt(plain, tools_prompt(offered.tools, offered.required))
    try:
        text: str = served.tokenizer.apply_chat_template(
            plain, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # a template may raise on a conversation it rejects
        raise InvalidRequest(
            f"the chat template refused messages: {exc}", param="messages"
        ) from exc
    return text


def tokenize_prompts(
    served: ServedGenerator,
    prompt: str | list[str] | list[int] | list[list[int]],
    body: SamplingFields,
) -> list[list[int]]:
    """Each prompt's token ids (texts tokenized within the context bound). Runs on the
    pre-processing pool."""
    if isinstance(prompt, str):
        return encode_prompts(served, [prompt], body)
    if not prompt:
        raise InvalidRequest("prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return encode_prompts(served, prompt, body)
    return [list(p) for p in prompt]


def encode_prompts(
    served: ServedGenerator,
    texts: list[str],
    body: SamplingFields | None,
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """Token ids of each text; a text certainly over the context (or, with
    ``truncate_prompt_tokens``, its kept tail) is judged without tokenizing it all."""
    truncate = None if body is None else body.truncate_prompt_tokens
    keep: Keep = "all" if truncate is None else "tail"
    limit = served.max_model_len if truncate is None else truncate
    try:
        return encode_within(
            lambda ts: served.encode_batch(ts, add_special_tokens), texts, limit, keep
        )
    except TooManyTokens as exc:
        raise InvalidRequest(
            f"this model's maximum context length is {served.max_model_len} tokens; "
            f"the prompt has more",
            param="prompt" if len(texts) == 1 else f"prompt[{exc.index}]",
        ) from None


def check_prompt_count(served: ServedGenerator, count: int) -> None:
    """Refuse (413), before tokenizing, a call with more prompts than one request
    may bring."""
    max_waiting = served.engine.max_waiting
    if max_waiting is not None and count > max_request_prompts(max_waiting):
        raise RequestTooLarge(
            f"{count} prompts in one request; at most "
            f"{max_request_prompts(max_waiting)} per request (half of --max-waiting-requests)",
            param="prompt",
        )


def requested_grammar(body: SamplingFields) -> tuple[Grammar, str] | None:
    """The grammar ``body`` asks its output to match, and the field that asked:
    OpenAI's ``response_format`` (``text`` asks nothing) or vLLM's
    ``structured_outputs``."""
    if body.response_format is not None and body.structured_outputs is not None:
        raise InvalidRequest(
            "give response_format or structured_outputs, not both", param="structured_outputs"
        )
    so = body.structured_outputs
    if so is not None:
        given = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
        }
        named = [k for k, v in given.items() if v is not None]
        if len(named) != 1:
            raise InvalidRequest(
                "structured_outputs needs exactly one of json, regex, choice and grammar",
                param="structured_outputs",
            )
        if so.json_ is not None:
            schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
            return Grammar("json_schema", schema), "structured_outputs"
        if so.regex is not None:
            return Grammar("regex", so.regex), "structured_outputs"
        if so.choice is not None:
            return Grammar("choice", json.dumps(so.choice)), "structured_outputs"
        return Grammar("lark", str(so.grammar)), "structured_outputs"
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Grammar("json_schema", '{"type": "object"}'), "response_format"
    schema_ = rf.json_schema.schema_ if rf.type == "json_schema" else None
    return Grammar("json_schema", json.dumps(schema_ or {"type": "object"})), "response_format"


async def compile_grammar(
    models: ServedModels,
    served: ServedGenerator,
    body: SamplingFields,
    offered: OfferedTools | None = None,
) -> Grammar | None:
    """The request's grammar (the tool wrapper's when tools are offered), compiled (or
    found cached) on the pre-processing pool before the request is queued; a grammar
    that does not compile is a 400."""
    if offered is not None:
        asked: tuple[Grammar, str] | None = (
            tool_grammar(offered.tools, offered.required, offered.parallel),
            "tools",
        )
    else:
        asked = requested_grammar(body)
    if asked is None:
        return None
    grammar, param = asked
    await models.preprocess.run(served.compile_grammar, grammar, param)
    return grammar


def logit_bias(body: SamplingFields) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as strings) as (id, bias) pairs."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise InvalidRequest(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            )
        pairs.append((int(key), bias))
    return tuple(pairs)


def sampling_params(
    served: ServedGenerator,
    body: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: Grammar | None = None,
) -> SamplingParams:
    if max_tokens is None:  # vLLM's default: whatever the context has left
        max_tokens = max(1, served.max_model_len - prompt_len)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        seed=body.seed,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        logit_bias=logit_bias(body),
        grammar=grammar,
    )


class _Call:
    """One chat or completion call: its streams and how to shape their outputs."""

    def __init__(
        self,
        served: ServedGenerator,
        body: SamplingFields,
        prefix: str,
        *,
        chat: bool,
        echo: bool = False,
        tools: bool = False,
    ) -> None:
        self.served = served
        self.body = body
        self.chat = chat
        self.echo = echo
        self.tools = tools  # replies are the tool wrapper's JSON, read back whole
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.n = body.n
        self._sent: dict[int, int] = {}  # characters of text streamed per choice

    async def respond(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        request: Request,
    ) -> Response:
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        streams = self._start(prompts, per_prompt)
        if self.body.stream:
            return EventSourceResponse(self._events(streams), ping=15, sep="\n")
        try:
            finals = await unless_disconnected(
                request, gather_or_cancel([asyncio.ensure_future(s.final()) for s in streams])
            )
        finally:
            for s in streams:
                s.close()
        return Response(orjson.dumps(self._full(finals)), media_type="application/json")

    def _start(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> list[GenerationStream]:
        return self.served.engine.start_many(
            prompts,
            params,
            priority=self.body.priority,
            timeout_s=self.served.timeout(self.body.timeout),
        )

    # -- whole responses -----------------------------------------------------------

    def _full(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for p, final in enumerate(finals):
            for out in final.outputs:
                index = p * self.n + out.index
                if self.chat:
                    message, reason = self._message(out)
                    choices.append(
                        {
                            "index": index,
                            "message": {"role": "assistant", **message},
                            "logprobs": self._chat_logprobs(out.logprobs, out.token_ids),
                            "finish_reason": reason,
                        }
                    )
                else:
                    echoed = self._echo(final) if self.echo else ("", None)
                    choices.append(
                        {
                            "index": index,
                            "text": echoed[0] + out.text,
                            "logprobs": _joined(
                                echoed[1],
                                self._completion_logprobs(
                                    out.logprobs, out.token_ids, len(echoed[0])
                                ),
                            ),
                            "finish_reason": _finish(out.finish_reason),
                        }
                    )
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.served.name,
            "choices": choices,
            "usage": _usage(finals),
        }

    # -- streaming -------------------------------------------------------------------

    async def _events(self, streams: list[GenerationStream]) -> AsyncIterator[dict[str, str]]:
        finals: dict[int, RequestOutput] = {}
        done: set[int] = set()
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        try:
            if self.chat:
                yield self._chunk(
                    [_choice_delta(i, {"role": "assistant", "content": ""}) for i in range(self.n)],
                    include_usage,
                )
            async for p, out in _merge(streams):
                if out.finished:
                    finals[p] = out
                choices = [c for c in (self._delta(p, out, o, done) for o in out.outputs) if c]
                if choices:
                    yield self._chunk(choices, include_usage)
            if include_usage:
                ordered = [finals[p] for p in sorted(finals)]
                yield {"data": orjson.dumps(self._envelope([], _usage(ordered))).decode()}
        except CarpoolError as exc:
            status, kind = status_of(exc)
            error = {"message": exc.message, "type": kind, "param": exc.param, "code": status}
            yield {"data": orjson.dumps({"error": error}).decode()}
        finally:
            for s in streams:
                s.close()
        yield {"data": "[DONE]"}

    def _delta(
        self, p: int, request: RequestOutput, out: CompletionOutput, done: set[int]
    ) -> dict[str, Any] | None:
        """The chunk choice for what ``out`` (of ``request``) added, None if nothing; a
        choice's finish reason is sent once (``done`` holds the choices already
        finished). With ``echo``, a choice's first piece starts with the prompt."""
        index = p * self.n + out.index
        reason = None
        if out.finish_reason is not None and index not in done:
            done.add(index)
            reason = _finish(out.finish_reason)
        if self.chat and self.tools:
            # The wrapper's JSON is read back whole: one delta when the choice ends.
            if reason is None:
                return None
            message, reason = self._message(out)
            calls = message.get("tool_calls")
            if calls is not None:
                message["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
            choice = _choice_delta(index, message)
            choice["finish_reason"] = reason
            return choice
        if not out.new_text and not out.new_logprobs and reason is None:
            return None
        if self.chat:
            delta = {"content": out.new_text} if out.new_text else {}
            choice = _choice_delta(index, delta)
            choice["logprobs"] = self._chat_logprobs(out.new_logprobs, out.new_token_ids)
        else:
            echoed: tuple[str, dict[str, Any] | None] = ("", None)
            if self.echo and index not in self._sent:
                echoed = self._echo(request)
            sent = self._sent.get(index, 0) + len(echoed[0])
            choice = {
                "index": index,
                "text": echoed[0] + out.new_text,
                "logprobs": _joined(
                    echoed[1],
                    self._completion_logprobs(out.new_logprobs, out.new_token_ids, sent),
                ),
                "finish_reason": None,
            }
            self._sent[index] = sent + len(out.new_text)
        choice["finish_reason"] = reason
        return choice

    def _message(self, out: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A finished chat choice's message fields and finish reason: with tools, the
        reply read back (``tool_calls`` and ``finish_reason: tool_calls``, or the
        answer's text)."""
        reason = _finish(out.finish_reason)
        if not self.tools:
            return {"content": out.text}, reason
        reply = read_reply(out.text)
        if reply.tool_calls is not None:
            return {"content": None, "tool_calls": reply.tool_calls}, "tool_calls"
        return {"content": reply.content}, reason

    def _echo(self, request: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text, and its tokens' logprobs when they were asked for."""
        text: str = self.served.tokenizer.decode(request.prompt_token_ids)
        if request.prompt_logprobs is None:
            return text, None
        return text, self._completion_logprobs(request.prompt_logprobs, request.prompt_token_ids, 0)

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, str]:
        envelope = self._envelope(choices, None)
        if not include_usage:
            envelope.pop("usage")
        return {"data": orjson.dumps(envelope).decode()}

    def _envelope(self, choices: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.name,
            "choices": choices,
            "usage": usage,
        }

    # -- logprobs ----------------------------------------------------------------------

    def _token(self, token_id: int) -> str:
        text: str = self.served.tokenizer.decode([token_id])
        return text

    def _chat_logprobs(
        self, logprobs: list[TokenLogprobs], token_ids: list[int]
    ) -> dict[str, Any] | None:
        if not logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        content = []
        for token_id, lp in zip(token_ids, logprobs, strict=False):
            item = entry(token_id, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
            content.append(item)
        return {"content": content}

    def _completion_logprobs(
        self, logprobs: Sequence[TokenLogprobs | None], token_ids: list[int], start: int
    ) -> dict[str, Any] | None:
        """OpenAI's completion logprobs of ``token_ids``, whose text begins at
        character ``start`` of the choice's text (None entries: a prompt's first
        token, which nothing predicts)."""
        if not logprobs:
            return None
        tokens = [self._token(t) for t in token_ids]
        offsets, at = [], start
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [
                None if lp is None else {self._token(t): v for t, v in lp.top} for lp in logprobs
            ],
            "text_offset": offsets,
        }


def _joined(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completion-logprobs objects as one (either may be None)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def _finish(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH.get(reason)


def _choice_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(f.num_generated_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


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
