"""Text Generation Inference's responses, as functions of the engine's outputs: the
``/generate`` body (``generated_text``, and with ``details`` the tokens, their
logprobs, the prompt's and the finish reason), ``/generate_stream``'s event per
token (the last one carries the whole text and the stream's details), and the error
body ``{"error", "error_type"}``. Pure: no I/O, no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.engine.sequence import FinishReason


@dataclass(frozen=True)
class TokenFacts:
    """What a token entry needs of the model: its text and whether it is special."""

    decode: Callable[[list[int]], str]
    special_ids: frozenset[int]


def finish_reason(out: CompletionOutput) -> str:
    """TGI's finish reason: ``length``, ``stop_sequence`` (a stop string ended it) or
    ``eos_token`` (an end-of-text or stop token)."""
    if out.finish_reason is FinishReason.LENGTH:
        return "length"
    return "stop_sequence" if isinstance(out.stop_reason, str) else "eos_token"


def token_entry(
    facts: TokenFacts, token_id: int, text: str, logprob: float | None
) -> dict[str, Any]:
    return {
        "id": token_id,
        "text": text,
        "logprob": logprob,
        "special": token_id in facts.special_ids,
    }


def token_texts(facts: TokenFacts, token_ids: Sequence[int], text: str) -> list[str]:
    """Each token's text, such that together they are ``text`` (what a step added, after
    incremental decoding and stop strings): each token decoded alone where those
    pieces join to it, else the whole text on the last token."""
    if len(token_ids) == 1:  # a step's one token: its text is what the step added
        return [text]
    pieces = [facts.decode([t]) for t in token_ids]
    if "".join(pieces) == text or not pieces:
        return pieces
    return [""] * (len(pieces) - 1) + [text]


def _top(facts: TokenFacts, lp: TokenLogprobs | None) -> list[dict[str, Any]]:
    if lp is None:
        return []
    return [token_entry(facts, t, facts.decode([t]), v) for t, v in lp.top]


def _logprob(logprobs: Sequence[TokenLogprobs | None], i: int) -> float | None:
    entry = logprobs[i] if i < len(logprobs) else None
    return None if entry is None else entry.logprob


def generate_body(
    facts: TokenFacts,
    final: RequestOutput,
    *,
    prefix: str,
    details: bool,
    seed: int | None,
    top_n: bool,
) -> dict[str, Any]:
    """``/generate``'s answer: the text (after ``prefix``, the prompt with
    ``return_full_text``), and with ``details`` TGI's ``Details``."""
    out = final.outputs[0]
    body: dict[str, Any] = {"generated_text": prefix + out.text}
    if not details:
        return body
    ids = out.token_ids
    texts = [facts.decode([t]) for t in ids]
    body["details"] = {
        "finish_reason": finish_reason(out),
        "generated_tokens": len(ids),
        "seed": seed,
        "prefill": _prefill(facts, final),
        "tokens": [
            token_entry(facts, t, texts[i], _logprob(out.logprobs, i)) for i, t in enumerate(ids)
        ],
        "top_tokens": [_top(facts, lp) for lp in out.logprobs] if top_n else None,
        "best_of_sequences": None,
    }
    return body


def _prefill(facts: TokenFacts, final: RequestOutput) -> list[dict[str, Any]]:
    """The prompt's tokens, with their logprobs where they were computed
    (``decoder_input_details``; the first is null: nothing predicts it)."""
    if final.prompt_logprobs is None:
        return []
    return [
        {"id": t, "text": facts.decode([t]), "logprob": _logprob(final.prompt_logprobs, i)}
        for i, t in enumerate(final.prompt_token_ids)
    ]


class StreamShaper:
    """``/generate_stream``'s events for one request: one per generated token, the
    last with ``generated_text`` and (with ``details``) the stream's details."""

    def __init__(
        self, facts: TokenFacts, *, prefix: str, details: bool, seed: int | None, top_n: bool
    ) -> None:
        self.facts = facts
        self.prefix = prefix
        self.details = details
        self.seed = seed
        self.top_n = top_n
        self.index = 0
        self.last_id = 0

    def events(self, request: RequestOutput) -> list[dict[str, Any]]:
        """The events for what this output added (none if it added nothing and is
        not the last)."""
        out = request.outputs[0]
        ids = out.new_token_ids
        texts = token_texts(self.facts, ids, out.new_text)
        events = [self._event(t, texts[i], out.new_logprobs, i) for i, t in enumerate(ids)]
        if out.finish_reason is None:
            return events
        if not events:  # the last output added text but no token: it ends on its own
            events.append(self._event(self.last_id, out.new_text, [], 0))
        events[-1]["generated_text"] = self.prefix + out.text
        if self.details:
            events[-1]["details"] = {
                "finish_reason": finish_reason(out),
                "generated_tokens": len(out.token_ids),
                "seed": self.seed,
                "input_length": len(request.prompt_token_ids),
            }
        return events

    def _event(
        self, token_id: int, text: str, logprobs: Sequence[TokenLogprobs | None], i: int
    ) -> dict[str, Any]:
        self.index += 1
        self.last_id = token_id
        top = _top(self.facts, logprobs[i] if i < len(logprobs) else None) if self.top_n else []
        return {
            "index": self.index,
            "token": token_entry(self.facts, token_id, text, _logprob(logprobs, i)),
            "top_tokens": top,
            "generated_text": None,
            "details": None,
        }


# TGI's error types by status (its router's; overload is carpool's 503).
_ERROR_TYPES = {
    401: "authentication",
    404: "not_found",
    413: "validation",
    424: "generation",
    503: "overloaded",
}


def error_body(status: int, message: str) -> dict[str, str]:
    """TGI's error body: the message and its kind (``validation`` for a bad request,
    ``generation`` for a failure while generating)."""
    kind = _ERROR_TYPES.get(status) or ("validation" if status < 500 else "generation")
    return {"error": message, "error_type": kind}
