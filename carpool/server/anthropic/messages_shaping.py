"""Anthropic's Messages shapes, as functions of a reply's events (``reply_stream``): the
message object, and the stream's events (``message_start``, ``content_block_start``,
``content_block_delta`` with ``thinking_delta``, ``text_delta`` or ``input_json_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``). One ``MessageShaper`` per
reply: fed every event, it returns that event's stream events and keeps the content,
so the streamed and the whole answer are one code path. No I/O."""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson

from carpool.engine.request_output import RequestOutput
from carpool.engine.sequence import FinishReason
from carpool.errors import CarpoolError
from carpool.server.generation.reply_reader import ArgumentsDelta, CallStarted, TextDelta
from carpool.server.generation.reply_stream import Finished, ReasoningDelta, StreamEvent
from carpool.server.http.errors import anthropic_error, status_of

Event = dict[str, str]  # one Server-Sent Event: its name and its JSON data


def _sse(kind: str, **fields: Any) -> Event:
    return {"event": kind, "data": orjson.dumps({"type": kind, **fields}).decode()}


class MessageShaper:
    """Shapes one reply from ``model`` to a prompt of ``input_tokens`` tokens, which
    asked to stop at ``stop_sequences``."""

    def __init__(self, model: str, input_tokens: int, stop_sequences: list[str]) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.stop_sequences = stop_sequences
        self.content: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": input_tokens, "output_tokens": 0}
        self._open: int | None = None  # the content block being written
        self._arguments: dict[int, str] = {}  # a tool_use block's input JSON so far
        self._calls: dict[int, int] = {}  # a call's index in the reply -> its block

    def message(self) -> dict[str, Any]:
        content = []
        for k, block in enumerate(self.content):
            if block["type"] == "tool_use":
                block = {**block, "input": _input(self._arguments.get(k, ""))}
            content.append(block)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }

    def started(self) -> list[Event]:
        opening = {**self.message(), "content": []}
        return [_sse("message_start", message=opening), _sse("ping")]

    def on(self, event: StreamEvent) -> list[Event]:
        if isinstance(event, ReasoningDelta):
            block: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            events = [] if self._is_open("thinking") else self._start(block)
            assert self._open is not None
            self.content[self._open]["thinking"] += event.text
            delta = {"type": "thinking_delta", "thinking": event.text}
            return [*events, _sse("content_block_delta", index=self._open, delta=delta)]
        if isinstance(event, TextDelta):
            events = [] if self._is_open("text") else self._start({"type": "text", "text": ""})
            assert self._open is not None
            self.content[self._open]["text"] += event.text
            delta = {"type": "text_delta", "text": event.text}
            return [*events, _sse("content_block_delta", index=self._open, delta=delta)]
        if isinstance(event, CallStarted):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            events = self._start(block)
            self._calls[event.index] = len(self.content) - 1
            return events
        if isinstance(event, ArgumentsDelta):
            at = self._calls[event.index]
            self._arguments[at] = self._arguments.get(at, "") + event.text
            delta = {"type": "input_json_delta", "partial_json": event.text}
            return [_sse("content_block_delta", index=at, delta=delta)]
        return self._finished(event)

    def failed(self, exc: CarpoolError) -> list[Event]:
        status, kind = status_of(exc)
        return [_sse("error", error=anthropic_error(status, kind, exc.message, exc.param))]

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self.content[self._open]["type"] == kind

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = self._stop()
        self._open = len(self.content)
        self.content.append(block)
        return [*events, _sse("content_block_start", index=self._open, content_block=block)]

    def _stop(self) -> list[Event]:
        if self._open is None:
            return []
        at, self._open = self._open, None
        return [_sse("content_block_stop", index=at)]

    def _finished(self, event: Finished) -> list[Event]:
        events = self._stop()
        self.stop_reason, self.stop_sequence = self._reason(event.output)
        self.usage["output_tokens"] = event.output.num_generated_tokens
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [
            *events,
            _sse(
                "message_delta", delta=delta, usage={"output_tokens": self.usage["output_tokens"]}
            ),
            _sse("message_stop"),
        ]

    def _reason(self, final: RequestOutput) -> tuple[str, str | None]:
        """Anthropic's stop reason (and the stop sequence met, if one was)."""
        out = final.outputs[0]
        if out.finish_reason == FinishReason.LENGTH:  # even mid-call: it was cut short
            return "max_tokens", None
        if self._calls:
            return "tool_use", None
        if isinstance(out.stop_reason, str) and out.stop_reason in self.stop_sequences:
            return "stop_sequence", out.stop_reason
        return "end_turn", None


def _input(arguments: str) -> Any:
    """A tool_use block's input: its arguments' JSON (a call cut by ``max_tokens``
    has none that parse: an empty object)."""
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
