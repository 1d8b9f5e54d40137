"""Admission (``carpool.admission``), as every queue uses it: all of a request's
inputs or none, under a limit; at most half a queue per request."""

from __future__ import annotations

import pytest

from carpool.admission import RETRY_AFTER_S, Gate, Room, per_request
from carpool.errors import Overloaded, RequestTooLarge


def test_a_room_admits_all_of_a_request_or_none() -> None:
    room = Room()
    assert room.take(3, 4)
    assert not room.take(2, 4)  # one would fit; neither is taken
    assert room.count == 3
    room.leave(3)
    assert room.take(4, 4) and not room.take(1, 4)
    assert room.take(100, None) and room.count == 104  # no limit


def test_one_request_may_bring_half_a_queue_and_always_one() -> None:
    assert [per_request(n) for n in (0, 1, 2, 9, 256)] == [1, 1, 1, 4, 128]


def test_a_gate_tells_a_request_too_large_from_an_overload() -> None:
    gate = Gate("model 'm'", "inputs", "input")
    with pytest.raises(RequestTooLarge, match="3 inputs in one request; model 'm' takes at most 2"):
        gate.admit(3, 4)  # more than half of 4: retrying cannot help
    assert gate.count == 0
    gate.admit(2, 4)
    gate.admit(2, 4)
    with pytest.raises(Overloaded, match="4 inputs are already waiting for model 'm'") as full:
        gate.admit(1, 4)
    assert full.value.retry_after_s == RETRY_AFTER_S and gate.count == 4
    gate.leave(2)
    gate.admit(2, 4)
    gate.admit(50, None)  # no limit, no per-request bound
    with pytest.raises(RequestTooLarge, match=r"at most 3 per request \(the reason\)") as big:
        gate.admit(4, None, most=3, why=" (the reason)")
    assert big.value.param == "input" and gate.count == 54
