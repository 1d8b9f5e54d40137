"""What the engine reports about a request after a step (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.engine.runner import TokenLogprobs
from carpool.engine.sequence import FinishReason


# Slotted: one of each is built per request per step on the engine's thread.
@dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` sequences: everything so far, and what this step added."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step. ``finished`` is true exactly once, on the last
    output; ``error`` is set when the model failed on this request."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs, once the prompt is computed: one entry per
    # prompt token, the first None (nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One output saying what this one and ``later`` (the next of the same
        request) say: ``later``'s state, with both steps' new pieces joined."""
        # Built field by field: dataclasses.replace inspects the fields on every call,
        # and this runs per stream per step when the event loop falls behind.
        joined = [
            CompletionOutput(
                b.index,
                b.text,
                b.token_ids,
                b.logprobs,
                a.new_text + b.new_text,
                a.new_token_ids + b.new_token_ids,
                a.new_logprobs + b.new_logprobs,
                b.finish_reason,
                b.stop_reason,
            )
            for a, b in zip(self.outputs, later.outputs, strict=True)
        ]
        return RequestOutput(
            later.request_id,
            later.prompt_token_ids,
            joined,
            later.finished,
            later.error,
            later.num_cached_tokens,
            later.prompt_logprobs,
        )
