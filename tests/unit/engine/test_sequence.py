"""A sequence's view of its generated tokens: what a sampling row reads each step
without a copy made for it."""

from __future__ import annotations

from carpool.engine.sequence import Sequence


def test_the_outputs_view_reads_the_tokens_generated_so_far() -> None:
    seq = Sequence("s", [5, 6, 7], max_tokens=8, arrival=0.0)
    view = seq.outputs_view
    assert len(view) == 0 and not view and list(view) == []
    seq.extend([11])
    seq.extend([12, 13])
    assert len(view) == 3 and view  # the view sees what came after it was made
    assert list(view) == [11, 12, 13] == seq.output_ids
    assert view[0] == 11 and view[-1] == 13 and view[1:] == [12, 13]
    assert {*seq.prompt_ids, *view} == {5, 6, 7, 11, 12, 13}
    seq.num_pending = 1  # a token in flight (asynchronous scheduling): not in the view
    assert len(view) == 3 and seq.num_output_tokens == 4 and seq.num_tokens == 7
    seq.land(99)
    assert list(view) == [11, 12, 13, 99] and seq.num_pending == 0 and seq.num_tokens == 7
