"""Admission, the same for every queue a request waits in (a batcher's priority
levels, a generation engine's waiting room): a request's inputs are admitted all
together or not at all, so a refused request leaves nothing behind to crowd out its
neighbours; a queue holds at most its limit; and one request may bring at most half of
it (``per_request``), so no single request fills a queue. Any thread; no torch."""

from __future__ import annotations

import threading

from carpool.errors import RequestTooLarge


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
