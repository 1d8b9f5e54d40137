"""What the Responses and Messages adapters share: each turns its request into a
``ChatCompletionRequest`` and goes down the one chat path (``prepare_chat``); errors
that path raises name chat's fields, which are renamed to the protocol's own."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from carpool.errors import CarpoolError, InvalidRequest
from carpool.server.generation.schemas import ChatCompletionRequest

_FIELD = re.compile(r"^([A-Za-z_]+)(.*)$")


def as_chat_request(fields: dict[str, Any], names: Mapping[str, str]) -> ChatCompletionRequest:
    """``fields`` (chat's field names, None for unset) as a chat request; a value
    chat refuses is a 400 naming the protocol's field (``names``: chat's to its)."""
    given = {k: v for k, v in fields.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(given)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        field = loc[0] if loc else None
        where = ".".join(loc)
        error = InvalidRequest(f"'{where}': {first.get('msg', 'invalid value')}", param=field)
        raise renamed(error, names) from None


def renamed(exc: CarpoolError, names: Mapping[str, str]) -> CarpoolError:
    """``exc`` with its ``param`` in the protocol's names (``messages[3].tool_calls``
    becomes ``input`` when ``names`` maps ``messages`` to ``input``)."""
    match = _FIELD.match(exc.param or "")
    if match is not None and match.group(1) in names:
        exc.param = names[match.group(1)]
    return exc


@contextmanager
def protocol_names(names: Mapping[str, str]) -> Iterator[None]:
    """Errors raised inside name the protocol's fields, not chat's."""
    try:
        yield
    except CarpoolError as exc:
        raise renamed(exc, names) from None
