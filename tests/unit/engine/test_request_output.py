"""Joining a stream's waiting outputs: the later output's state, both steps' pieces."""

from __future__ import annotations

from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.engine.sequence import FinishReason


def test_followed_by_keeps_the_later_state_and_joins_the_new_pieces() -> None:
    first = RequestOutput(
        "r",
        [1, 2],
        [CompletionOutput(0, "ab", [5, 6], [], "b", [6], [TokenLogprobs(-0.5, [])])],
    )
    later = RequestOutput(
        "r",
        [1, 2],
        [
            CompletionOutput(
                0,
                "abc",
                [5, 6, 7],
                [],
                "c",
                [7],
                [TokenLogprobs(-0.25, [])],
                FinishReason.STOP,
                "c",
            )
        ],
        finished=True,
        error=None,
        num_cached_tokens=16,
        prompt_logprobs=[None, TokenLogprobs(-1.0, [])],
    )
    joined = first.followed_by(later)
    [out] = joined.outputs
    assert (out.new_text, out.new_token_ids) == ("bc", [6, 7])
    assert [lp.logprob for lp in out.new_logprobs] == [-0.5, -0.25]
    assert (out.index, out.text, out.token_ids) == (0, "abc", [5, 6, 7])
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, "c")
    assert (joined.request_id, joined.prompt_token_ids, joined.finished) == ("r", [1, 2], True)
    assert joined.num_cached_tokens == 16 and joined.prompt_logprobs == later.prompt_logprobs
    assert first.outputs[0].new_text == "b"  # neither input is changed
