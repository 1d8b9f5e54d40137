"""OpenAI's Responses shapes, as functions of a reply's events (``reply_stream``): the
response object, and the stream's events (``response.created``, ``...output_item.added``,
``...reasoning_text.delta``, ``...output_text.delta``, ``...function_call_arguments.delta``,
``...completed``). One
``ResponseShaper`` per response: fed every event, it returns that event's stream events
and keeps the output, so the streamed and the whole answer are one code path. No I/O."""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from carpool.engine.request_output import RequestOutput
from carpool.engine.sequence import FinishReason
from carpool.errors import CarpoolError
from carpool.server.generation.reply_reader import ArgumentsDelta, CallStarted, TextDelta
from carpool.server.generation.reply_stream import Finished, ReasoningDelta, StreamEvent
from carpool.server.http.errors import status_of
from carpool.server.responses.responses_schemas import NamedFunction, ResponsesRequest

Event = dict[str, str]  # one Server-Sent Event: its name and its JSON data


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShaper:
    """Shapes one response to ``body`` from model ``model``, created at ``created``."""

    def __init__(self, body: ResponsesRequest, model: str, created: int) -> None:
        self.body = body
        self.model = model
        self.created = created
        self.id = _id("resp")
        self.status = "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.incomplete: dict[str, str] | None = None
        self._sequence = 0
        self._message: int | None = None  # the output index of the message being written
        self._reasoning: int | None = None  # ... and of the reasoning item being written
        self._calls: dict[int, int] = {}  # a call's index in the reply -> its output index

    # -- the response object -----------------------------------------------------------

    def response(self) -> dict[str, Any]:
        body = self.body
        choice: Any = body.tool_choice or "auto"
        if isinstance(choice, NamedFunction):
            choice = choice.model_dump()
        text_format: dict[str, Any] = {"type": "text"}
        if body.text is not None and body.text.format is not None:
            text_format = body.text.format.model_dump(by_alias=True, exclude_none=True)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "error": None,
            "incomplete_details": self.incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {
                "effort": None if body.reasoning is None else body.reasoning.effort,
                "summary": None,
            },
            "service_tier": body.service_tier or "default",
            "background": bool(body.background),
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format},
            "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": self.usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    # -- events ------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        """One Server-Sent Event, its data serialized now (the output changes later)."""
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return {"event": kind, "data": orjson.dumps(data).decode()}

    def started(self) -> list[Event]:
        """The stream's first events."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def on(self, event: StreamEvent) -> list[Event]:
        """The stream events for one reply event (the output is kept either way)."""
        if isinstance(event, ReasoningDelta):
            return self._reasoning_text(event.text)
        if isinstance(event, TextDelta):
            return self._close_reasoning() + self._text(event.text)
        if isinstance(event, CallStarted):
            return self._close_reasoning() + self._call_started(event)
        if isinstance(event, ArgumentsDelta):
            at = self._calls[event.index]
            self.output[at]["arguments"] += event.text
            item_id = self.output[at]["id"]
            return [
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=at,
                    delta=event.text,
                )
            ]
        return self._finished(event)

    def failed(self, exc: CarpoolError) -> list[Event]:
        """The events that end a stream whose request failed."""
        self.status = "failed"
        _, code = status_of(exc)
        response = self.response()
        response["error"] = {"code": code, "message": exc.message}
        return [
            self._event("error", code=code, message=exc.message, param=exc.param),
            self._event("response.failed", response=response),
        ]

    def _text(self, text: str) -> list[Event]:
        events = [] if self._message is not None else self._open_message()
        assert self._message is not None
        item = self.output[self._message]
        item["content"][0]["text"] += text
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self._message,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _reasoning_text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._reasoning is None:
            item: dict[str, Any] = {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            self._reasoning = len(self.output)
            self.output.append(item)
            events.append(
                self._event("response.output_item.added", output_index=self._reasoning, item=item)
            )
        at = self._reasoning
        item = self.output[at]
        item["content"][0]["text"] += text
        events.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=at,
                content_index=0,
                delta=text,
            )
        )
        return events

    def _close_reasoning(self) -> list[Event]:
        if self._reasoning is None:
            return []
        at, self._reasoning = self._reasoning, None
        item = self.output[at]
        item["status"] = "completed"
        text = item["content"][0]["text"]
        return [
            self._event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=at,
                content_index=0,
                text=text,
            ),
            self._event("response.output_item.done", output_index=at, item=item),
        ]

    def _open_message(self) -> list[Event]:
        item: dict[str, Any] = {
            "type": "message",
            "id": _id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._message = len(self.output)
        self.output.append(item)
        added = self._event("response.output_item.added", output_index=self._message, item=item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return [
            added,
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._message,
                content_index=0,
                part=part,
            ),
        ]

    def _close_message(self) -> list[Event]:
        if self._message is None:
            return []
        at, self._message = self._message, None
        item = self.output[at]
        item["status"] = "completed"
        part = item["content"][0]
        return [
            self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=at,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=at,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=at, item=item),
        ]

    def _call_started(self, event: CallStarted) -> list[Event]:
        events = self._close_message()
        item = {
            "type": "function_call",
            "id": _id("fc"),
            "call_id": event.id,
            "name": event.name,
            "arguments": "",
            "status": "in_progress",
        }
        self._calls[event.index] = len(self.output)
        self.output.append(item)
        events.append(
            self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        )
        return events

    def _finished(self, event: Finished) -> list[Event]:
        events = self._close_reasoning() + self._close_message()
        for at in self._calls.values():
            item = self.output[at]
            item["status"] = "completed"
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=at,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self._event("response.output_item.done", output_index=at, item=item))
        if all(item["type"] == "reasoning" for item in self.output):
            # An empty answer (or one all thinking) is still a message.
            events += self._open_message()
            events += self._close_message()
        self.usage = usage(event.output)
        if event.output.outputs[0].finish_reason == FinishReason.LENGTH:
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", response=self.response()))
        else:
            self.status = "completed"
            events.append(self._event("response.completed", response=self.response()))
        return events


def usage(final: RequestOutput) -> dict[str, Any]:
    """The Responses ``usage`` of a finished request."""
    prompt = len(final.prompt_token_ids)
    generated = final.num_generated_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }
