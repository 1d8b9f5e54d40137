"""Admission (``carpool.admission``), as every queue uses it: all of a request's
inputs or none, under a limit; at most half a queue per request."""

from __future__ import annotations

from carpool.admission import Room, per_request


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
