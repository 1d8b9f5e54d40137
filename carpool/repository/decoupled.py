"""Decoupled models (Triton's ``model_transaction_policy { decoupled: true }``): a
request's responses are sent through its ``pb_utils.InferenceResponseSender``, any
number of them, from any thread, during ``execute`` or after it returned, until one
carries the final flag.

``ResponseStream`` carries one request's responses from the model's threads to the
event loop: the model's side appends (``put``, ``finish``), one consumer awaits them
in order (``responses``). Each response is checked against the config as it is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from carpool.batching.request import Failed
from carpool.errors import ModelExecutionError

Outputs = dict[str, np.ndarray[Any, Any]]


@dataclass(frozen=True)
class _End:
    """The final flag was sent."""


_END = _End()


class ResponseStream:
    """One request's responses, in the order the model sent them.

    ``check`` (set by the model's batch before the stream reaches a consumer) turns a
    response's outputs into checked outputs or ``Failed``. ``cancelled`` is set when
    the consumer leaves before the final flag, so the model's sender can report it
    (``is_cancelled``); ``on_cancel``, when set, is called then too (a worker process's
    stream: its model's sender is in the worker, which must be told)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: deque[Outputs | Failed | _End] = deque()
        self._wake: Callable[[], None] | None = None
        self._forward: Callable[[Outputs | Failed | None], None] | None = None
        self.check: Callable[[Outputs], Outputs | Failed] = lambda outputs: outputs
        self.cancelled = False
        self.on_cancel: Callable[[], None] | None = None

    # --- the model's side (any thread) ---------------------------------------------

    def put(self, item: Outputs | Failed) -> None:
        self._append(item)

    def finish(self) -> None:
        self._append(_END)

    def _append(self, item: Outputs | Failed | _End) -> None:
        with self._lock:
            if self._forward is not None:
                self._forward(None if isinstance(item, _End) else item)
                return
            self._items.append(item)
            wake = self._wake
        if wake is not None:
            wake()

    def forward(self, send: Callable[[Outputs | Failed | None], None]) -> None:
        """From now on hand each response to ``send`` (None for the final flag), in
        order, the ones already sent first, instead of keeping them for a consumer
        here: a worker process's stream, whose responses cross to the server's."""
        with self._lock:
            for item in self._items:
                send(None if isinstance(item, _End) else item)
            self._items.clear()
            self._forward = send

    # --- a BLS caller (its instance thread) ---------------------------------------

    def collect(self, gap_s: float | None) -> list[Outputs]:
        """Every response's checked outputs until the final flag, waiting on the
        calling thread; raises as ``responses`` does."""
        arrived = threading.Event()
        with self._lock:
            self._wake = arrived.set
        collected: list[Outputs] = []
        try:
            while True:
                with self._lock:
                    item = self._items.popleft() if self._items else None
                if item is None:
                    if not arrived.wait(gap_s):
                        raise ModelExecutionError(f"the model sent no response for {gap_s:g}s")
                    arrived.clear()
                    continue
                if isinstance(item, _End):
                    return collected
                checked = item if isinstance(item, Failed) else self.check(item)
                if isinstance(checked, Failed):
                    raise checked.error
                collected.append(checked)
        finally:
            with self._lock:
                self._wake = None

    # --- the consumer (the event loop) ---------------------------------------------

    async def responses(self, gap_s: float | None) -> AsyncGenerator[Outputs, None]:
        """Each response's checked outputs until the final flag; raises the first
        failed response's error, or ``ModelExecutionError`` when no response comes
        for ``gap_s`` seconds (None: wait forever). Leaving early cancels."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads on
                loop.call_soon_threadsafe(arrived.set)

        with self._lock:
            self._wake = wake
        ended = False
        try:
            while True:
                with self._lock:
                    item = self._items.popleft() if self._items else None
                if item is None:
                    try:
                        await asyncio.wait_for(arrived.wait(), gap_s)
                    except TimeoutError:
                        raise ModelExecutionError(
                            f"the model sent no response for {gap_s:g}s"
                        ) from None
                    arrived.clear()
                    continue
                if isinstance(item, _End):
                    ended = True
                    return
                checked = item if isinstance(item, Failed) else self.check(item)
                if isinstance(checked, Failed):
                    raise checked.error
                yield checked
        finally:
            with self._lock:
                self._wake = None
            if not ended:
                self.cancelled = True
                if self.on_cancel is not None:
                    self.on_cancel()
