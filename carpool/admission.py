"""Admission, the same for every queue a request waits in (a batcher's priority
levels, a generation engine's waiting room): a request's inputs are admitted all
together or not at all, so a refused request leaves nothing behind to crowd out its
neighbours; a queue holds at most its limit; and one request may bring at most half of
it (``per_request``), so no single request fills a queue. Any thread; no torch."""

from __future__ import annotations

import threading

from carpool.errors import Overloaded, RequestTooLarge


def per_request(limit: int) -> int:
    """Most inputs one request may bring to a queue of ``limit``: half, at least one."""
    return max(1, limit // 2)


def refuse_oversized(
    count: int, most: int, *, what: str, taker: str, param: str, why: str = ""
) -> None:
    """Raise ``RequestTooLarge`` (413: retrying cannot help) if one request brings
    ``count`` of ``what`` where ``taker`` takes at most ``most`` (``why``: the limit's
    origin, appended)."""
    if count > most:
        raise RequestTooLarge(
            f"{count} {what} in one request; {taker} takes at most {most} per request{why}",
            param=param,
        )


class Room:
    """How many inputs a queue holds (admitted, not yet gone)."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    def take(self, count: int, limit: int | None) -> bool:
        """Admit ``count`` inputs if all fit under ``limit`` (None: no limit); False,
        with nothing admitted, if they do not."""
        with self._lock:
            if limit is not None and self._count + count > limit:
                return False
            self._count += count
            return True

    def leave(self, count: int = 1) -> None:
        """``count`` inputs left the queue (started, finished, or failed first)."""
        with self._lock:
            self._count -= count


RETRY_AFTER_S = 1.0  # what an overloaded queue's 503 asks a client to wait


class Gate:
    """The admission of one queue: ``taker`` takes ``what`` (named by ``param`` in a
    request). ``admit`` lets a request's inputs in all together or raises, with nothing
    admitted: ``RequestTooLarge`` for more than one request may bring (half the
    limit, or what the caller says), ``Overloaded`` (503, Retry-After) when the queue
    has no room for all of them. Any thread."""

    def __init__(self, taker: str, what: str, param: str) -> None:
        self.taker = taker
        self.what = what
        self.param = param
        self._room = Room()

    @property
    def count(self) -> int:
        """Inputs admitted and not yet gone."""
        return self._room.count

    def admit(self, count: int, limit: int | None, most: int | None = None, why: str = "") -> None:
        """Take ``count`` inputs in under ``limit`` (None: no limit); ``most``: the
        most one request may bring (None: half of ``limit``), ``why`` its origin."""
        if most is None and limit is not None:
            most = per_request(limit)
        if most is not None:
            refuse_oversized(
                count, most, what=self.what, taker=self.taker, param=self.param, why=why
            )
        if not self._room.take(count, limit):
            raise Overloaded(
                f"{self._room.count} {self.what} are already waiting for {self.taker}",
                retry_after_s=RETRY_AFTER_S,
            )

    def leave(self, count: int = 1) -> None:
        """``count`` inputs left the queue (started, finished, or failed first)."""
        self._room.leave(count)
