"""Business logic scripting (Triton's BLS): a Python-backend model's ``execute``
calls another served model with ``pb_utils.InferenceRequest(...).exec()``.

The server hands each Triton backend a ``CallModel``; while the backend runs
``execute`` it is the current caller (a context variable, so ``async_exec`` on a
helper thread sees it too). The call runs the target's model at once on one of the
target's instances, outside its batcher, waiting at most the target's execution
timeout. A call into the calling model itself is refused (its instance is the one
waiting). ``exec(decoupled=True)`` calls a decoupled model and returns its responses
once the last has come (Triton hands them over as they come: the same responses, the
first later). In a model's worker process the ``CallModel`` sends the call back over the
worker's pipe, and the server's side of the pipe makes it (``process``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray[Any, Any]]

# (calling model, target model, target version or "", inputs, outputs asked, parameters,
# decoupled) -> each response's outputs (one, unless ``decoupled``: a decoupled
# target's, all of them, once its final flag came); raises the call's ``CarpoolError``.
CallModel = Callable[
    [str, str, str, Arrays, tuple[str, ...], Mapping[str, Any], bool], list[Arrays]
]

_current: contextvars.ContextVar[tuple[str, CallModel] | None] = contextvars.ContextVar(
    "carpool_bls_caller", default=None
)


@contextmanager
def calling_as(model: str, call: CallModel | None) -> Iterator[None]:
    """Within: BLS calls are made as ``model`` through ``call``."""
    token = _current.set(None if call is None else (model, call))
    try:
        yield
    finally:
        _current.reset(token)


def current() -> tuple[str, CallModel] | None:
    """The calling model and its ``CallModel``, or None outside a backend's execute."""
    return _current.get()
