"""OpenAI's response and chunk shapes for chat and completions, as functions of the
engine's outputs: no I/O, no engine; the routes stream what these return.
``Shaper`` keeps one piece of state per call, the characters of text already sent
per choice (streamed logprobs' ``text_offset``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.engine.sequence import FinishReason
from carpool.server.generation.reply_reader import (
    ArgumentsDelta,
    CallStarted,
    ReplyEvent,
    TextDelta,
)
from carpool.server.generation.reply_stream import ReasoningDelta, ReplyFolder
from carpool.server.http.sse import sse_event

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class Shaper:
    """Shapes one chat or completion call's outputs (``n`` choices per prompt;
    ``decode``: token ids to text; ``tool_form``: tools were offered, and replies
    in that form (``carpool.server.generation.tools``) are read back; ``reasoning``: a
    ``--reasoning-parser`` that splits a chat reply's thinking into
    ``reasoning_content``; ``echoed``: request fields the response repeats, such as
    ``service_tier``). A chat choice's reply is folded from the same neutral events
    as the Responses and Messages APIs' (``reply_stream.ReplyFolder``), one folder per
    choice. Chat messages and deltas always carry ``reasoning_content`` and
    ``reasoning`` (vLLM's older and newer names), null when there is none: vLLM's
    clients read them unconditionally."""

    def __init__(
        self,
        *,
        call_id: str,
        created: int,
        model: str,
        n: int,
        decode: Callable[[list[int]], str],
        chat: bool,
        echo: bool = False,
        tool_form: str | None = None,
        reasoning: str | None = None,
        echoed: dict[str, Any] | None = None,
    ) -> None:
        self.id = call_id
        self.created = created
        self.model = model
        self.n = n
        self.decode = decode
        self.chat = chat
        self.echo = echo
        self.tool_form = tool_form
        self.reasoning = reasoning
        self.echoed = echoed or {}
        self.object = "chat.completion" if chat else "text_completion"
        self._sent: dict[int, int] = {}  # characters of text streamed per choice
        self._folders: dict[int, ReplyFolder] = {}  # each chat choice's reply so far

    def full(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The whole response for the finished outputs of each prompt, in order."""
        choices = []
        for p, final in enumerate(finals):
            for out in final.outputs:
                index = p * self.n + out.index
                if self.chat:
                    message, reason = self._message(out)
                    choices.append(
                        {
                            "index": index,
                            "message": with_reasoning({"role": "assistant", **message}),
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
            "model": self.model,
            "choices": choices,
            "usage": usage(finals),
            **self.echoed,
        }

    def delta(
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
        if self.chat:
            return self._chat_delta(index, out, reason)
        if not out.new_text and not out.new_logprobs and reason is None:
            return None
        echoed: tuple[str, dict[str, Any] | None] = ("", None)
        if self.echo and index not in self._sent:
            echoed = self._echo(request)
        sent = self._sent.get(index, 0) + len(echoed[0])
        self._sent[index] = sent + len(out.new_text)
        return {
            "index": index,
            "text": echoed[0] + out.new_text,
            "logprobs": _joined(
                echoed[1], self._completion_logprobs(out.new_logprobs, out.new_token_ids, sent)
            ),
            "finish_reason": reason,
        }

    def _chat_delta(
        self, index: int, out: CompletionOutput, reason: str | None
    ) -> dict[str, Any] | None:
        """A chat choice's delta: the events its new text completes (its thinking as
        ``reasoning_content``; with tools, a call's name first and its arguments' JSON
        text in pieces); ``finish_reason`` is ``tool_calls`` once it called any."""
        folder = self._folders.setdefault(index, ReplyFolder(self.tool_form, self.reasoning))
        events = folder.feed(out.new_text, reason is not None)
        if reason is not None and folder.called and reason != "length":  # cut short: says so
            reason = "tool_calls"
        if not events and not out.new_logprobs and reason is None:
            return None
        choice = choice_delta(index, chat_delta(events))
        choice["logprobs"] = self._chat_logprobs(out.new_logprobs, out.new_token_ids)
        choice["finish_reason"] = reason
        return choice

    def _message(self, out: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A finished chat choice's message fields and finish reason: with a
        reasoning parser, the thinking split off as ``reasoning_content``; with
        tools, the answer read back (``tool_calls`` and ``finish_reason:
        tool_calls``, or the answer's text)."""
        reason = _finish(out.finish_reason)
        folder = ReplyFolder(self.tool_form, self.reasoning)
        events = folder.feed(out.text, True)
        answer = "".join(e.text for e in events if isinstance(e, TextDelta))
        thinking = "".join(e.text for e in events if isinstance(e, ReasoningDelta)) or None
        if self.tool_form is None:
            if self.reasoning is None:
                return {"content": answer}, reason
            return {"content": answer or None, "reasoning_content": thinking}, reason
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in folder.complete_calls()
        ]
        if not calls:
            return {"content": answer, "reasoning_content": thinking}, reason
        message = {"content": answer or None, "tool_calls": calls, "reasoning_content": thinking}
        return message, (reason if reason == "length" else "tool_calls")

    def _echo(self, request: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text, and its tokens' logprobs when they were asked for."""
        text: str = self.decode(request.prompt_token_ids)
        if request.prompt_logprobs is None:
            return text, None
        return text, self._completion_logprobs(request.prompt_logprobs, request.prompt_token_ids, 0)

    def chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> bytes:
        """One streamed chunk as its server-sent event, encoded."""
        envelope = self.envelope(choices, None)
        if not include_usage:
            envelope.pop("usage")
        return sse_event(envelope)

    def envelope(self, choices: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
            **self.echoed,
        }

    def _token(self, token_id: int) -> str:
        text: str = self.decode([token_id])
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


def chat_delta(events: Sequence[ReplyEvent | ReasoningDelta]) -> dict[str, Any]:
    """One chat delta for a reply's events: their thinking as ``reasoning_content``,
    their text as ``content``, and one ``tool_calls`` entry per call they touch (a
    call's first entry carries its id, type and name; each its arguments' text so far
    unsent)."""
    delta: dict[str, Any] = {}
    thinking = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    if thinking:
        delta["reasoning_content"] = thinking
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    if text:
        delta["content"] = text
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, CallStarted):
            calls[e.index] = {
                "index": e.index,
                "id": e.id,
                "type": "function",
                "function": {"name": e.name, "arguments": ""},
            }
        elif isinstance(e, ArgumentsDelta):
            entry = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += e.text
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    return delta


def choice_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, "delta": with_reasoning(delta), "logprobs": None, "finish_reason": None}


def with_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` (or a delta) with ``reasoning_content`` and ``reasoning`` set, both
    the thinking it carries or null."""
    thinking = message.get("reasoning_content")
    message["reasoning_content"] = thinking
    message["reasoning"] = thinking
    return message


def usage(finals: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(f.num_generated_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
